"""Linear layers that load their own weights and delegate the matmul to a method (layers/linear_methods.py).

Each layer knows which rows (or columns) of a checkpoint tensor it holds: the fused QKV and gate/up
projections take their parts from separate checkpoint tensors (`shard_id`), and a layer built for rank r
of tp_size keeps only its slice (Megatron: column-parallel splits the outputs, row-parallel the inputs and
sums the partial outputs across ranks). With tp_size 1 every layer holds the whole tensor.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvserve.layers.linear_methods import DenseMethod, LinearMethod
from kvserve.model_loader.lazy_tensor import materialize

# All-reduce (sum) of a row-parallel layer's partial outputs across ranks; None on one rank.
Reduce = Callable[[torch.Tensor], torch.Tensor] | None


class LinearBase(nn.Module):
    """y = x W^T (+ b), W [output_size, input_size] as held by this rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool, method: LinearMethod | None = None,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.method = method or DenseMethod()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.checkpoint_parts: list[tuple[int, object]] = []
        """(first row, part) of each weight part kept in the checkpoint's own encoding (a GGUF block tensor,
        model_loader/gguf_blocks.py: not a torch.Tensor) for the method to repack; empty otherwise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's part of checkpoint tensor `loaded` into parameter `name` ("weight" or "bias")."""
        _copy_rows(self, name, 0, getattr(self, name).shape[0], loaded)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, method={self.method.name}, "
                f"tp={self.tp_rank}/{self.tp_size}")


def _copy_rows(layer: LinearBase, name: str, start: int, size: int, src) -> None:
    """Fill rows [start, start + size) of parameter `name` from `src`: a tensor is copied; a weight part kept
    in checkpoint blocks (not a tensor: it has .shape and .narrow) is recorded for the method to repack
    (`checkpoint_parts`) and the rows are left as they are."""
    dest = getattr(layer, name).data.narrow(0, start, size)
    src = materialize(src)  # a checkpoint slice not read yet (tensor parallelism) is read now
    if isinstance(src, torch.Tensor):
        _copy(dest, src)
        return
    if name != "weight" or tuple(dest.shape) != tuple(src.shape):
        raise ValueError(f"has shape {tuple(src.shape)}, expected {tuple(dest.shape)}")
    layer.checkpoint_parts.append((start, src))


def _copy(dest: torch.Tensor, src: torch.Tensor) -> None:
    src = materialize(src)
    if tuple(dest.shape) != tuple(src.shape):
        raise ValueError(f"has shape {tuple(src.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(src)


def _rank_slice(tensor: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    return tensor.narrow(dim, rank * size, size)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""


class ColumnParallelLinear(LinearBase):
    """Outputs split across ranks: rank r holds rows [r * out/tp, (r + 1) * out/tp) of W (and of b)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, method: LinearMethod | None = None,
                 tp_rank: int = 0, tp_size: int = 1):
        if output_size % tp_size:
            raise ValueError(f"output size {output_size} is not divisible by tensor_parallel_size {tp_size}")
        super().__init__(input_size, output_size // tp_size, bias, method, tp_rank, tp_size)

    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id=None) -> None:
        size = getattr(self, name).shape[0]
        _copy_rows(self, name, 0, size, _rank_slice(loaded, 0, size, self.tp_rank))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate and up): checkpoint part
    `shard_id` (its index) fills this rank's slice of that part."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, method: LinearMethod | None = None,
                 tp_rank: int = 0, tp_size: int = 1):
        if any(size % tp_size for size in output_sizes):
            raise ValueError(f"output sizes {output_sizes} are not divisible by tensor_parallel_size {tp_size}")
        self.output_sizes = [size // tp_size for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, method, tp_rank, tp_size)

    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id=None) -> None:
        """shard_id: the part's index, or "fused" for a checkpoint tensor holding every part (Phi-3)."""
        if shard_id == "fused":
            start = 0
            for i, size in enumerate(self.output_sizes):
                self.weight_loader(name, loaded.narrow(0, start, size * self.tp_size), i)
                start += size * self.tp_size
            return
        start = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        _copy_rows(self, name, start, size, _rank_slice(loaded, 0, size, self.tp_rank))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused: each rank holds num_heads/tp query heads and its KV heads. When there
    are fewer KV heads than ranks, each KV head is replicated on tp/num_kv_heads ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 method: LinearMethod | None = None, tp_rank: int = 0, tp_size: int = 1):
        if num_heads % tp_size:
            raise ValueError(f"{num_heads} attention heads are not divisible by tensor_parallel_size {tp_size}")
        if num_kv_heads % tp_size and tp_size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split or replicated over {tp_size} ranks")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_head_start = (tp_rank * num_kv_heads // tp_size if num_kv_heads >= tp_size
                              else tp_rank // (tp_size // num_kv_heads))
        output = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, output, bias, method, tp_rank, tp_size)

    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id=None) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "qkv":  # a checkpoint tensor holding q, k and v (Phi-3): each part as if separate
            q_full = q * self.tp_size
            kv_full = (loaded.shape[0] - q_full) // 2
            for part, start, size in (("q", 0, q_full), ("k", q_full, kv_full), ("v", q_full + kv_full, kv_full)):
                self.weight_loader(name, loaded.narrow(0, start, size), part)
            return
        if shard_id == "q":
            start, size, src = 0, q, _rank_slice(loaded, 0, q, self.tp_rank)
        elif shard_id in ("k", "v"):
            start, size = (q if shard_id == "k" else q + kv), kv
            src = loaded.narrow(0, self.kv_head_start * self.head_dim, kv)
        else:
            raise ValueError(f"QKV shard must be q, k or v, got {shard_id!r}")
        _copy_rows(self, name, start, size, src)


class RowParallelLinear(LinearBase):
    """Inputs split across ranks: rank r holds columns [r * in/tp, (r + 1) * in/tp) of W; the partial outputs
    are summed by `reduce`, then the bias (whole, on every rank) is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool, method: LinearMethod | None = None,
                 tp_rank: int = 0, tp_size: int = 1, reduce: Reduce = None):
        if input_size % tp_size:
            raise ValueError(f"input size {input_size} is not divisible by tensor_parallel_size {tp_size}")
        super().__init__(input_size // tp_size, output_size, bias, method, tp_rank, tp_size)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x, None if self.reduce else self.bias)
        if self.reduce is not None:
            y = self.reduce(y)
            if self.bias is not None:
                y = y + self.bias
        return y

    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id=None) -> None:
        param = getattr(self, name)
        if name == "bias":
            _copy(param.data, loaded)
        else:
            _copy_rows(self, name, 0, param.shape[0], _rank_slice(loaded, 1, param.shape[1], self.tp_rank))
