"""Executor: how the engine core reaches its workers. One worker in this process today; the tensor-parallel
executor (a driver plus worker processes over torch.distributed) implements the same four calls."""
from __future__ import annotations

from kvserve.config.engine import EngineConfig
from kvserve.kv_cache.layout import KVCacheSpec
from kvserve.scheduler.output import SchedulerOutput
from kvserve.worker.runner_output import ModelRunnerOutput
from kvserve.worker.worker import Worker


class UniprocExecutor:
    def __init__(self, config: EngineConfig):
        self.worker = Worker(config)
        self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def init_kv_cache(self, num_blocks: int) -> KVCacheSpec:
        return self.worker.init_kv_cache(num_blocks)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(out)
