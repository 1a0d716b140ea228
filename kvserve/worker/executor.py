"""Executor: how the engine core reaches its workers. UniprocExecutor: one worker in this process; the
tensor-parallel executor (worker/tp_executor.py: a driver plus worker processes over torch.distributed)
implements the same calls. make_executor picks one from the parallel config.

The engine core learns what it needs to know about the workers (the KV cache spec, the step-cost knee) from
these calls alone: it imports no worker-side module."""
from __future__ import annotations

from kvserve.config.engine import EngineConfig
from kvserve.core_types import ModelRunnerOutput, SchedulerOutput
from kvserve.kv_cache.layout import KVCacheSpec
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

    def step_cost_knee(self) -> int:
        return self.worker.step_cost_knee()

    def startup_phases(self) -> dict[str, float]:
        """Seconds the driver's worker spent loading, by phase (weights, kernels, kv cache, warm-up)."""
        return dict(self.worker.startup.seconds)

    def kv_connector_handshake_metadata(self) -> dict | None:
        return self.worker.kv_connector_handshake_metadata()

    def shutdown(self) -> None:
        self.worker.shutdown_kv_connector()


def make_executor(config: EngineConfig):
    if config.parallel.tensor_parallel_size == 1:
        return UniprocExecutor(config)
    if config.parallel.distributed_executor_backend == "external_launcher":
        from kvserve.worker.tp_launcher import ExternalLauncherExecutor
        return ExternalLauncherExecutor(config)
    if config.parallel.distributed_executor_backend == "ray":
        from kvserve.worker.tp_ray import RayExecutor
        return RayExecutor(config)
    from kvserve.worker.tp_executor import MultiprocExecutor
    return MultiprocExecutor(config)
