"""ExternalLauncherExecutor: tensor parallelism where torchrun (or any launcher that sets RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT) starts every rank, on one host or several, without Ray (docs/PARALLELISM.md).

Every process runs the same command. Rank 0 becomes the driver: its engine (offline, or the server) goes
on as with the mp backend. Every other rank builds its Worker here, follows the driver's steps, and exits
the process when the driver stops; it never returns to its caller. torchrun's own agent ends the other
ranks when one fails.
"""
from __future__ import annotations

import logging
import sys
import weakref

import torch
import torch.distributed as dist

import kvserve.envs as envs
from kvserve.config.engine import EngineConfig
from kvserve.core_types import ModelRunnerOutput, SchedulerOutput
from kvserve.distributed.comm import TPGroup
from kvserve.kv_cache.layout import KVCacheSpec
from kvserve.worker.tp_worker import StepMessage, driver_lora_slots, follow, rank_config
from kvserve.worker.worker import Worker

logger = logging.getLogger("kvserve")


class ExternalLauncherExecutor:
    def __init__(self, config: EngineConfig):
        ranks = envs.torchrun_rank()
        size = config.parallel.tensor_parallel_size
        if ranks is None:
            raise ValueError("--distributed-executor-backend external_launcher needs RANK and WORLD_SIZE (start "
                             "every rank with torchrun; docs/PARALLELISM.md)")
        rank, world = ranks
        if world != size:
            raise ValueError(f"WORLD_SIZE is {world} but --tensor-parallel-size is {size}: start one process "
                             "per rank")
        config = rank_config(config, envs.torchrun_local_rank())
        self.group = TPGroup(rank, size, config.device.device, None, config.parallel.start_timeout_s,
                             init_method="env://")
        self.worker = Worker(config, self.group.shard_context())
        self.worker.load_model()
        blocks = torch.tensor([self.worker.determine_num_blocks()], dtype=torch.int64)
        dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=self.group.cpu_group)
        self._num_blocks = int(blocks.item())
        self._sampled: dict[str, list[int]] = {}
        if rank != 0:
            logger.info("tensor parallel rank %d of %d follows the driver", rank, size)
            follow(self.group, self.worker)
            self.group.close()
            sys.exit(0)
        # NOTE: a CLI run that never calls shutdown still stops the followers cleanly at exit (torchrun
        # would report their broken connection as a failure)
        self._finalizer = weakref.finalize(self, _stop_followers, self.group)

    def determine_num_blocks(self) -> int:
        return self._num_blocks

    def init_kv_cache(self, num_blocks: int) -> KVCacheSpec:
        self.group.broadcast_object(num_blocks)
        return self.worker.init_kv_cache(num_blocks)

    def step_cost_knee(self) -> int:
        return self.worker.step_cost_knee()

    def startup_phases(self) -> dict[str, float]:
        """Seconds the driver's worker spent loading, by phase (weights, kernels, kv cache, warm-up)."""
        return dict(self.worker.startup.seconds)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.group.broadcast_object(StepMessage(out, self._sampled, driver_lora_slots(self.worker, out)))
        self.group.stats.steps += 1
        result = self.worker.execute_model(out)
        self._sampled = dict(zip(result.req_ids, result.sampled_token_ids))
        return result

    def shutdown(self) -> None:
        self._finalizer()


def _stop_followers(group: TPGroup) -> None:
    try:
        group.broadcast_object(None, timeout_s=10.0)
    except Exception:  # noqa: BLE001 — the followers are gone already (torchrun ends the rest)
        pass
    group.close()
