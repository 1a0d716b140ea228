"""RayExecutor: tensor parallelism with the follower ranks as Ray actors (`--distributed-executor-backend
ray`), on this machine or a Ray cluster's nodes. Everything else is as with the mp backend
(worker/tp_executor.py): the driver (rank 0) is this process and samples; each actor runs the follower loop
(`tp_worker.follow`) over the same torch.distributed group (gloo on CPU, NCCL on CUDA), whose rendezvous is
a TCPStore on the driver's node IP.

Placement: one placement-group bundle per rank (PACK: as few nodes as possible), bundle r for rank r;
bundle 0 reserves the driver's share on the driver's node. Ray is joined where one runs (`RAY_ADDRESS`,
or `address="auto"` finding a started cluster); otherwise a local instance is started and shut down again
with the engine.

Failures: an actor that raises while loading is reported with its error; one that dies mid-run breaks the
next collective, and execute_model raises a TensorParallelError naming the rank. Shutdown sends the stop
message, then kills the actors and removes the placement group.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from datetime import timedelta

import torch.distributed as dist

from kvserve.config.engine import EngineConfig
from kvserve.distributed.comm import TPGroup
from kvserve.worker.tp_executor import DriverCalls, TensorParallelError, _is_comm_error
from kvserve.worker.tp_worker import WorkerSpec, follow, hello_key
from kvserve.worker.worker import Worker

logger = logging.getLogger("kvserve")
_POLL_S = 0.05


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise ValueError("--distributed-executor-backend ray needs Ray: pip install 'kvserve[ray]' (or use mp on "
                         "one machine)") from e
    return ray


class RayFollower:
    """A follower rank in a Ray actor: start() joins the group and loads the shard (returns its KV block
    budget), then follow() runs until the driver's stop message."""

    def __init__(self):
        self.group = None
        self.worker = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def start(self, spec: WorkerSpec) -> int:
        logging.basicConfig(level=logging.WARNING,
                            format=f"%(asctime)s %(levelname)s tp-rank{spec.rank}: %(message)s")
        config = spec.config
        if config.device.device.type == "cuda":  # NOTE: Ray gives each actor its own GPU as cuda:0
            import torch

            torch.cuda.set_device(0)
            config = dataclasses.replace(config, device=dataclasses.replace(config.device,
                                                                            device=torch.device("cuda", 0)))
        store = dist.TCPStore(spec.store_host, spec.store_port, spec.size, is_master=False,
                              timeout=timedelta(seconds=spec.timeout_s))
        store.set(hello_key(spec.rank), "1")
        self.group = TPGroup(spec.rank, spec.size, config.device.device, dist.PrefixStore("pg", store),
                             spec.timeout_s)
        self.worker = Worker(config, self.group.shard_context())
        self.worker.load_model()
        return self.worker.determine_num_blocks()

    def follow(self) -> None:
        try:
            follow(self.group, self.worker)
        finally:
            self.group.close()


class RayExecutor(DriverCalls):
    def __init__(self, config: EngineConfig):
        if dist.is_initialized():
            raise ValueError("this process already holds a torch.distributed group (another tensor-parallel "
                             "engine?): one tensor-parallel engine per process")
        ray = _import_ray()
        self.config = config
        self.size = config.parallel.tensor_parallel_size
        timeout = config.parallel.start_timeout_s
        self._sampled: dict[str, list[int]] = {}
        self._failed: str | None = None
        self._lock = threading.Lock()
        self.group: TPGroup | None = None
        self._follow_refs: list = []
        self._state = {"actors": [], "pg": None, "started_ray": False, "groups": []}
        self._finalizer = weakref.finalize(self, _release, self._state)
        try:
            self._state["started_ray"] = _connect(ray, self.size)
            cuda = config.device.device.type == "cuda"
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            bundle = {"GPU": 1, "CPU": 1} if cuda else {"CPU": 1}
            host = ray.util.get_node_ip_address()
            # NOTE: bundle 0 is the driver's: pinned to this node (Ray's per-node resource), so PACK fills
            # this node first and a GPU reserved for rank 0 is the one it uses
            bundles = [{**bundle, f"node:{host}": 0.001}] + [dict(bundle) for _ in range(1, self.size)]
            pg = self._state["pg"] = placement_group(bundles, strategy="PACK")
            try:
                ray.get(pg.ready(), timeout=timeout)
            except ray.exceptions.GetTimeoutError:
                raise TensorParallelError(f"Ray could not place {self.size} bundles of {bundle} within "
                                          f"{timeout:.0f} s (ray status shows the cluster's resources)") from None
            self._store = dist.TCPStore(host, 0, self.size, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=timeout))
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            actor_cls = ray.remote(RayFollower)
            for rank in range(1, self.size):
                actor = actor_cls.options(
                    num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
                    runtime_env={"env_vars": {"PYTHONPATH": _pythonpath(root)}}).remote()
                self._state["actors"].append(actor)
            starts = [a.start.remote(WorkerSpec(config, r, self.size, host, self._store.port, timeout))
                      for r, a in enumerate(self._state["actors"], 1)]
            self._wait_hello(ray, starts, timeout)
            self.group = TPGroup(0, self.size, config.device.device, dist.PrefixStore("pg", self._store), timeout)
            self._state["groups"].append(self.group)
            self.worker = Worker(config, self.group.shard_context())
            self.worker.load_model()
            self._worker_blocks = [self._get(ray, ref, rank, timeout, "load its shard")
                                   for rank, ref in enumerate(starts, 1)]
            self._follow_refs = [a.follow.remote() for a in self._state["actors"]]
        except BaseException:
            self._failed = "start-up failed"
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks (driver + %d Ray actors, %s)", self.size, self.size - 1,
                    "nccl" if config.device.device.type == "cuda" else "gloo")

    def _wait_hello(self, ray, starts: list, timeout: float) -> None:
        """Every actor is up and about to join the group; one whose start() ended first failed: say why."""
        deadline = time.monotonic() + timeout
        pending = set(range(1, self.size))
        while pending:
            for rank in sorted(pending):
                if self._store.check([hello_key(rank)]):
                    pending.discard(rank)
                elif ray.wait([starts[rank - 1]], timeout=0)[0]:
                    self._get(ray, starts[rank - 1], rank, 0, "start")
            if pending and time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel Ray actor rank(s) {sorted(pending)} did not start "
                                          f"within {timeout:.0f} s")
            if pending:
                time.sleep(_POLL_S)

    @staticmethod
    def _get(ray, ref, rank: int, timeout: float, what: str):
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            raise TensorParallelError(f"tensor-parallel worker rank {rank} (Ray actor) failed to {what}: "
                                      f"{type(cause).__name__}: {cause}") from None
        except ray.exceptions.RayError as e:
            raise TensorParallelError(f"tensor-parallel worker rank {rank} (Ray actor) died before it could "
                                      f"{what}: {type(e).__name__}") from None

    def _collective(self, fn):
        try:
            return fn()
        except TensorParallelError:
            raise
        except Exception as e:
            dead = self._dead_ranks(wait_s=1.0)
            if not dead and not _is_comm_error(e):
                self._failed = f"the driver's step failed ({type(e).__name__}: {e}); the engine cannot continue"
                self.shutdown()
                raise
            raise self._group_failed([f"rank {r} (Ray actor) {why}" for r, why in dead], e) from e

    def _dead_ranks(self, wait_s: float = 0.0) -> list[tuple[int, str]]:
        """Ranks whose follow() ended (an actor only returns on the stop message): died, or failed."""
        if not self._follow_refs:
            return []
        import ray

        ready, _ = ray.wait(self._follow_refs, num_returns=len(self._follow_refs), timeout=wait_s)
        dead = []
        for ref in ready:
            rank = self._follow_refs.index(ref) + 1
            try:
                ray.get(ref, timeout=0)
                why = "stopped"
            except ray.exceptions.RayActorError:
                why = "died"
            except ray.exceptions.RayTaskError as e:
                why = f"failed ({type(e.cause).__name__ if getattr(e, 'cause', None) else 'error'})"
            dead.append((rank, why))
        return dead

    @property
    def actors(self) -> list:
        return list(self._state["actors"])

    def shutdown(self) -> None:
        """The stop message (when the group still works), then the actors, the placement group and a Ray
        instance this executor started are gone."""
        with self._lock:
            if self.group is not None and self._failed is None and self._follow_refs and not self._dead_ranks():
                try:
                    self.group.broadcast_object(None, timeout_s=10.0)
                    import ray

                    ray.wait(self._follow_refs, num_returns=len(self._follow_refs), timeout=10.0)
                except Exception:  # noqa: BLE001 — a broken group: the actors are killed below
                    pass
            self.group = None
            self._store = None
            self._finalizer()


def _connect(ray, size: int) -> bool:
    """Join a running Ray (RAY_ADDRESS, or a cluster `ray start` left on this machine) or start a local one;
    True when this executor started it (and so shuts it down)."""
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return False
    try:
        ray.init(address="auto", log_to_driver=True)
        return False
    except ConnectionError:
        pass
    # NOTE: CPU slots here are bookkeeping for placement, not cores: a 2-core box still runs 4 ranks
    ray.init(num_cpus=max(os.cpu_count() or 1, size) + 1, include_dashboard=False, log_to_driver=True)
    return True


def _pythonpath(root: str) -> str:
    """This checkout first (as the mp backend's children get it); a node without it keeps its own install."""
    rest = os.environ.get("PYTHONPATH")
    return root + (os.pathsep + rest if rest else "")


def _release(state: dict) -> None:
    """Kill the actors, free the group and the placement group, stop a Ray this executor started; also
    runs when the executor is dropped without shutdown."""
    try:
        import ray
    except ImportError:
        return
    if ray.is_initialized():
        for actor in state["actors"]:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 — dead already
                pass
        if state["pg"] is not None:
            try:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(state["pg"])
            except Exception:  # noqa: BLE001
                pass
    state["actors"].clear()
    state["pg"] = None
    for group in state["groups"]:
        group.close()
    state["groups"].clear()
    if state["started_ray"] and ray.is_initialized():
        ray.shutdown()
        state["started_ray"] = False
