"""ParallelConfig: how the model is split across processes (Megatron tensor parallelism, docs/PARALLELISM.md)."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray", "external_launcher")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Ranks each layer's weights are sharded over (Megatron-style)."""
    distributed_executor_backend: str = "mp"
    """How the ranks other than the driver (rank 0) start: mp (processes on this machine), ray (Ray actors in
    a placement group, on this machine or a Ray cluster's nodes; the optional extra kvserve[ray]),
    external_launcher (every rank started by torchrun, which sets RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT)."""
    start_timeout_s: float = 600.0
    """How long the driver waits for a worker to join and load its shard before giving up."""
    data_parallel_size: int = 1
    """Engine cores behind one API server, each with a whole copy of the model (engine/data_parallel.py)."""

    def __post_init__(self) -> None:
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if isinstance(self.data_parallel_size, bool) or not isinstance(self.data_parallel_size, int) \
                or self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {self.data_parallel_size!r}")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" and max(self.tensor_parallel_size, self.data_parallel_size) > 1 \
                and importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend 'ray' needs Ray, which is not installed: "
                             "pip install 'kvserve[ray]' (or use mp on one machine)")

    def check_model(self, hf_config) -> None:
        """Refuse a model whose shapes this many ranks cannot split (a clear error at start-up, not a shape
        error inside a layer): query heads, MLP width and vocabulary must divide; KV heads must divide, or
        divide the rank count (then each KV head is replicated on tp / kv_heads ranks)."""
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
        if heads % tp:
            sizes = ", ".join(str(n) for n in range(1, heads + 1) if heads % n == 0 and
                              (kv_heads % n == 0 or n % kv_heads == 0))
            raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {heads} attention heads "
                             f"({kv_heads} KV heads): each rank must hold whole heads; sizes that work: {sizes}")
        if kv_heads % tp and tp % kv_heads:
            raise ValueError(f"the model's {kv_heads} KV heads can be neither split over nor replicated on "
                             f"{tp} ranks: tensor_parallel_size must divide {kv_heads} or be a multiple of it")
        from kvserve.model_loader.architectures import resolve_architecture

        arch, feats = resolve_architecture(hf_config)
        if not feats.tensor_parallel:
            raise ValueError(f"{arch} does not run with tensor parallelism yet (its q/k norm spans every head): "
                             "use tensor_parallel_size 1")
        names = ["intermediate_size", "vocab_size"]
        if feats.moe:  # experts split over their intermediate dimension (layers/moe.py)
            names += ["moe_intermediate_size", "shared_expert_intermediate_size"]
        for name in names:
            value = getattr(hf_config, name, None)
            if value is not None and value % tp:
                raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {name} {value}")
