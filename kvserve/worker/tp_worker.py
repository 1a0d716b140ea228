"""A tensor-parallel follower rank (1 .. tp-1): its Worker, driven by the driver's step broadcasts.

    python -m kvserve.worker.tp_worker     (the mp executor starts it; a WorkerSpec arrives on stdin)

Start-up, over the driver's TCPStore (keys under "kvserve/"): `hello/<rank>` once the process is up,
then join the process group, load this rank's shard, `ready/<rank>` = its KV block budget or the error
that stopped it. Then, in step order: the block count the driver chose, then one StepMessage per step
(None: shut down). A follower never decides anything: it applies the driver's sampled tokens and diff,
runs the forward pass (its collectives pair with the other ranks') and waits for the next message.
"""
from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass, field

from kvserve.config.engine import EngineConfig
from kvserve.core_types import SchedulerOutput

logger = logging.getLogger("kvserve")


@dataclass
class WorkerSpec:
    config: EngineConfig
    rank: int
    size: int
    store_host: str
    store_port: int
    timeout_s: float


@dataclass(slots=True)
class StepMessage:
    """What the driver broadcasts each step: the scheduler's diff and the tokens its previous step sampled
    (the followers' input batches append them, as the driver's own runner did)."""

    sched_out: SchedulerOutput
    sampled: dict[str, list[int]] = field(default_factory=dict)
    lora_slots: dict = field(default_factory=dict)
    """enable_lora: slot -> LoRARequest of this step's adapters, as the driver's manager placed them (each
    rank loads its own shard of an adapter from its path)."""


def driver_lora_slots(worker, out: SchedulerOutput) -> dict:
    """The driver, before it broadcasts a step: make the step's adapters resident in its own slots (the
    choice its runner's activate would make next, which then finds them there) and say where they went."""
    if worker.lora is None or out.is_empty:
        return {}
    known = worker.runner.requests
    new = {r.req_id: r.lora_request for r in out.scheduled_new_reqs}
    adapters = {}
    for req_id in out.num_scheduled_tokens:
        lora = new[req_id] if req_id in new else known[req_id].lora_request
        if lora is not None:
            adapters[lora.lora_int_id] = lora
    return {slot: adapters[lora_id] for lora_id, slot in worker.lora.activate(adapters).items()}


def rank_config(config: EngineConfig, local_rank: int) -> EngineConfig:
    """On CUDA each rank of one host drives its own GPU (cuda:<local rank>); on CPU nothing changes."""
    device = config.device.device
    if device.type != "cuda":
        return config
    import dataclasses

    import torch

    torch.cuda.set_device(local_rank)
    return dataclasses.replace(config, device=dataclasses.replace(config.device,
                                                                  device=torch.device("cuda", local_rank)))


def ready_key(rank: int) -> str:
    return f"kvserve/ready/{rank}"


def hello_key(rank: int) -> str:
    return f"kvserve/hello/{rank}"


def follow(group, worker) -> None:
    """The follower's loop, after load_model: block count, then steps until the driver says stop."""
    num_blocks = group.broadcast_object()
    worker.init_kv_cache(num_blocks)
    runner = worker.runner
    while True:
        msg = group.broadcast_object()
        if msg is None:
            return
        runner.append_sampled(msg.sampled)
        if msg.lora_slots:
            worker.lora.assign(msg.lora_slots)
        worker.execute_model(msg.sched_out)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the driver exits, however it exits (no orphans after a kill -9)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main() -> int:
    _die_with_parent()
    # NOTE: Ctrl-C reaches the whole process group; the driver decides (it shuts us down, or its exit kills us)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec: WorkerSpec = pickle.load(sys.stdin.buffer)
    if os.getppid() == 1:  # the driver died before prctl took effect
        return 1
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s tp-rank{spec.rank}: %(message)s")
    import torch.distributed as dist

    from kvserve.distributed.comm import TPGroup
    from kvserve.worker.worker import Worker

    spec.config = rank_config(spec.config, spec.rank)
    store = dist.TCPStore(spec.store_host, spec.store_port, spec.size, is_master=False,
                          timeout=_timedelta(spec.timeout_s))
    store.set(hello_key(spec.rank), "1")
    group = TPGroup(spec.rank, spec.size, spec.config.device.device, dist.PrefixStore("pg", store),
                    spec.timeout_s)
    try:
        worker = Worker(spec.config, group.shard_context())
        worker.load_model()
        store.set(ready_key(spec.rank), pickle.dumps(("ok", worker.determine_num_blocks())))
    except Exception as e:
        store.set(ready_key(spec.rank), pickle.dumps(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
        _exit(1)
    try:
        follow(group, worker)
    except Exception:  # the driver or another rank is gone (the collective broke), or this rank failed
        logger.error("tensor-parallel rank %d stops:\n%s", spec.rank, traceback.format_exc())
        _exit(1)
    group.close()
    return 0


def _exit(code: int) -> None:
    """Leave now: a broken process group's teardown at interpreter exit may wait on peers that are gone."""
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


if __name__ == "__main__":
    sys.exit(main())
