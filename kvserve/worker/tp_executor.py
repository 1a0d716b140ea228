"""MultiprocExecutor: tensor parallelism on this machine. The driver (rank 0) is this process: the engine
core's scheduler and rank 0's Worker, which samples. Ranks 1 .. tp-1 are child processes
(worker/tp_worker.py) that load their own shards and run each step's forward pass with it.

Each step the driver broadcasts one StepMessage (the scheduler's diff and the tokens it sampled in the
previous step, a few hundred bytes), then runs its own forward pass; the layers' all-reduces and the LM
head's all-gather pair up across ranks inside it.

Failures end the engine, never hang it: a worker that exits during start-up is reported with its error;
one that dies mid-run breaks the next collective (gloo sees the closed connection), and execute_model
raises naming the rank and its exit code, so the engine fails its in-flight requests. Shutting down (or
the driver exiting in any way: followers die with their parent) leaves no process behind.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import weakref
from datetime import timedelta

import torch.distributed as dist

from kvserve.config.engine import EngineConfig
from kvserve.core_types import ModelRunnerOutput, SchedulerOutput
from kvserve.distributed.comm import TPGroup
from kvserve.kv_cache.layout import KVCacheSpec
from kvserve.worker.tp_worker import StepMessage, WorkerSpec, driver_lora_slots, hello_key, ready_key
from kvserve.worker.worker import Worker

logger = logging.getLogger("kvserve")
_LOCALHOST = "127.0.0.1"
_POLL_S = 0.05


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed: the engine cannot step any more."""


class DriverCalls:
    """The executor's calls as the driver (rank 0) makes them, whatever started the other ranks: it needs
    `worker`, `group`, `_worker_blocks`, `_failed`, `_sampled` and `_collective` (which turns a broken group
    into a TensorParallelError)."""

    def determine_num_blocks(self) -> int:
        """The smallest budget of any rank: every rank holds the same block ids (each its heads' share)."""
        return min([self.worker.determine_num_blocks()] + self._worker_blocks)

    def init_kv_cache(self, num_blocks: int) -> KVCacheSpec:
        self._collective(lambda: self.group.broadcast_object(num_blocks))
        return self.worker.init_kv_cache(num_blocks)

    def step_cost_knee(self) -> int:
        return self.worker.step_cost_knee()

    def startup_phases(self) -> dict[str, float]:
        """Seconds the driver's worker spent loading, by phase (weights, kernels, kv cache, warm-up)."""
        return dict(self.worker.startup.seconds)

    def kv_connector_handshake_metadata(self) -> dict | None:
        """The driver's (rank 0's); the connectors that need one refuse tensor parallelism for now."""
        return self.worker.kv_connector_handshake_metadata()

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self._failed is not None:
            raise TensorParallelError(self._failed)
        # NOTE: the grammar bitmask is read by the sampler alone, which runs here
        shared = out if out.grammar_bitmask is None else dataclasses.replace(
            out, grammar_bitmask=None, structured_output_request_ids={})
        msg = StepMessage(shared, self._sampled, driver_lora_slots(self.worker, out))
        self._collective(lambda: self.group.broadcast_object(msg))
        self.group.stats.steps += 1
        result = self._collective(lambda: self.worker.execute_model(out))
        self._sampled = dict(zip(result.req_ids, result.sampled_token_ids))
        return result


    def _group_failed(self, dead: list[str], e: Exception) -> TensorParallelError:
        """The group is over: record why (the ranks that died, or the collective's own error), stop every
        process, and return the error to raise."""
        what = ", ".join(dead) if dead else f"the process group failed ({type(e).__name__}: {e})"
        self._failed = f"tensor-parallel worker {what}; the engine cannot continue"
        logger.error("%s", self._failed)
        self.shutdown()
        return TensorParallelError(self._failed)


class MultiprocExecutor(DriverCalls):
    def __init__(self, config: EngineConfig):
        if dist.is_initialized():
            raise ValueError("this process already holds a torch.distributed group (another tensor-parallel "
                             "engine?): one tensor-parallel engine per process")
        self.config = config
        self.size = config.parallel.tensor_parallel_size
        timeout = config.parallel.start_timeout_s
        self._procs: list[subprocess.Popen] = []
        self._failed: str | None = None
        self._sampled: dict[str, list[int]] = {}
        self.group: TPGroup | None = None
        self._lock = threading.Lock()
        self._groups: list[TPGroup] = []  # the finalizer's handle on the group (it may not hold self)
        self._finalizer = weakref.finalize(self, _release, self._procs, self._groups)
        try:
            store = dist.TCPStore(_LOCALHOST, 0, self.size, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=timeout))
            self._store = store
            for rank in range(1, self.size):
                self._procs.append(_spawn(WorkerSpec(config, rank, self.size, _LOCALHOST, store.port, timeout)))
            self._wait_for(hello_key, timeout, "start")
            self.group = TPGroup(0, self.size, config.device.device, dist.PrefixStore("pg", store), timeout)
            self._groups.append(self.group)
            self.worker = Worker(config, self.group.shard_context())
            self.worker.load_model()
            self._worker_blocks = [pickle.loads(v)[1] for v in self._wait_for(ready_key, timeout, "load its shard")]
        except BaseException:
            self._failed = "start-up failed"  # NOTE: no stop message: a follower may be gone or still loading
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks (driver + %d worker processes, %s), pids %s", self.size,
                    self.size - 1, "nccl" if config.device.device.type == "cuda" else "gloo",
                    [p.pid for p in self._procs])

    def _wait_for(self, key, timeout: float, what: str) -> list[bytes]:
        """Every follower's value of `key(rank)`, watching the processes: one that exits first is an error."""
        deadline = time.monotonic() + timeout
        pending = set(range(1, self.size))
        values = {}
        while pending:
            for rank in sorted(pending):
                if self._store.check([key(rank)]):
                    values[rank] = self._store.get(key(rank))
                    pending.discard(rank)
                    if key is ready_key and pickle.loads(values[rank])[0] == "error":
                        raise TensorParallelError(f"tensor-parallel worker rank {rank} failed to {what}: "
                                                  f"{pickle.loads(values[rank])[1]}")
                elif self._procs[rank - 1].poll() is not None:
                    raise TensorParallelError(f"tensor-parallel worker rank {rank} exited with code "
                                              f"{self._procs[rank - 1].returncode} before it could {what}")
            if pending and time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel worker rank(s) {sorted(pending)} did not {what} within "
                                          f"{timeout:.0f} s")
            if pending:
                time.sleep(_POLL_S)
        return [values[r] for r in range(1, self.size)]

    def _collective(self, fn):
        """Run `fn` (which pairs with the followers); a broken group becomes a TensorParallelError naming
        the rank that died, and the engine is stopped for good."""
        try:
            return fn()
        except TensorParallelError:
            raise
        except Exception as e:
            if not self._dead_ranks() and not _is_comm_error(e):
                # NOTE: the driver failed on its own mid-step: the followers wait in a collective that will
                # never pair up, so the group is over (the engine stops on this error anyway)
                self._failed = f"the driver's step failed ({type(e).__name__}: {e}); the engine cannot continue"
                self.shutdown()
                raise
            time.sleep(0.2)  # let a dying follower's exit code land
            dead = self._dead_ranks()
            raise self._group_failed([f"rank {r} exited with code {c}" for r, c in dead], e) from e

    def _dead_ranks(self) -> list[tuple[int, int]]:
        return [(r, p.returncode) for r, p in enumerate(self._procs, 1) if p.poll() is not None]

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def shutdown(self) -> None:
        """Tell the followers to stop (when the group still works), then make sure they have."""
        with self._lock:
            grace = 0.0
            if self.group is not None and self._failed is None and not self._dead_ranks():
                try:
                    self.group.broadcast_object(None, timeout_s=10.0)
                    grace = 10.0
                except Exception:  # noqa: BLE001 — a broken group: the processes are killed below
                    pass
            _stop(self._procs, grace)
            if self.group is not None:
                self.group.close()
                self.group = None
            store, self._store = getattr(self, "_store", None), None
            del store


def _is_comm_error(e: Exception) -> bool:
    return isinstance(e, (dist.DistBackendError, ConnectionError)) or "Connection closed" in str(e) \
        or "Gloo" in type(e).__name__ or "gloo" in str(e).lower()


def _spawn(spec: WorkerSpec) -> subprocess.Popen:
    """A follower process running this interpreter on this checkout of kvserve (not a daemonic
    multiprocessing child, so an engine that is itself such a child may start it)."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.worker.tp_worker"], stdin=subprocess.PIPE, env=env)
    proc.stdin.write(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
    proc.stdin.close()
    return proc


def _release(procs: list[subprocess.Popen], groups: list[TPGroup]) -> None:
    """An executor collected (or the interpreter exiting) without shutdown: kill the followers, free the group."""
    _stop(procs, 0.0)
    for group in groups:
        group.close()


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Wait up to grace_s for the followers to exit on their own (after the stop message), then kill."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
