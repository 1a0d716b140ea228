"""A 2-D checkpoint tensor not read yet: `narrow` picks this rank's rows or columns (what the sharded
layers' weight loaders call), `materialize` reads only those from the file. A tensor-parallel rank loads
through these, so it reads its 1/tp of each sharded weight, not the whole checkpoint.

Sources: a safetensors file (safe_open's get_slice) and a GGUF file's memory map (only the selected rows,
and columns at block granularity where they align, are dequantized).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

# read(row_start, row_stop, col_start, col_stop) -> that block of the tensor, as stored (any float dtype)
Reader = Callable[[int, int, int, int], torch.Tensor]


class LazyTensor:
    def __init__(self, read: Reader, shape: tuple[int, int], dtype: torch.dtype,
                 rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None):
        self._read, self._dtype, self._full = read, dtype, shape
        self.rows = rows or (0, shape[0])
        self.cols = cols or (0, shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows[1] - self.rows[0], self.cols[1] - self.cols[0])

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> "LazyTensor":
        lo, hi = self.rows if dim == 0 else self.cols
        if dim not in (0, 1) or start < 0 or lo + start + length > hi:
            raise ValueError(f"cannot narrow a {self.shape} tensor at dim {dim} to [{start}, {start + length})")
        span = (lo + start, lo + start + length)
        return LazyTensor(self._read, self._full, self._dtype, span if dim == 0 else self.rows,
                          span if dim == 1 else self.cols)

    def materialize(self) -> torch.Tensor:
        return self._read(*self.rows, *self.cols).to(self._dtype).contiguous()


def safetensors_lazy(handle, name: str, dtype: torch.dtype) -> LazyTensor | torch.Tensor:
    """A 2-D tensor of an open safe_open file as a LazyTensor; others (norms, biases) read whole."""
    sl = handle.get_slice(name)
    shape = tuple(sl.get_shape())
    if len(shape) != 2:
        return handle.get_tensor(name).to(dtype)
    return LazyTensor(lambda r0, r1, c0, c1: sl[r0:r1, c0:c1], shape, dtype)


def gguf_lazy(data: np.ndarray, ggml_type, shape: tuple[int, int], dtype: torch.dtype,
              row_order: np.ndarray | None = None) -> LazyTensor:
    """A GGUF tensor's raw entries `data` [rows, entries per row] (a view of the memory map) as a LazyTensor
    of logical `shape` [out, in]. row_order: HF row i is file row row_order[i] (the Q/K RoPE permutation).
    Values equal gguf.quants.dequantize of the whole tensor, then the same rows and columns."""
    import gguf

    block = gguf.GGML_QUANT_SIZES[ggml_type][0]    # weights per block (1 for F32 / F16)
    per_block = data.shape[1] // (shape[1] // block)  # entries of `data` per block

    def read(r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        rows = data[row_order[r0:r1]] if row_order is not None else data[r0:r1]
        if c0 % block == 0 and c1 % block == 0:
            part = rows[:, c0 // block * per_block:c1 // block * per_block]
            w = gguf.quants.dequantize(np.ascontiguousarray(part), ggml_type).reshape(r1 - r0, c1 - c0)
        else:
            w = gguf.quants.dequantize(np.ascontiguousarray(rows), ggml_type).reshape(r1 - r0, shape[1])[:, c0:c1]
        return torch.from_numpy(np.array(w, dtype=np.float32, order="C"))

    return LazyTensor(read, shape, dtype)


def materialize(src):
    """`src` read now if it is a LazyTensor; anything else as it is."""
    return src.materialize() if isinstance(src, LazyTensor) else src
