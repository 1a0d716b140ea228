"""A GGUF tensor kept in the file's own blocks, and its Q4_0 / Q4_1 / Q8_0 blocks repacked for our kernels
(kernels.py) without requantizing: the same codes, scales and mins.

Block layouts (ggml-common.h; 32 weights per block, `d` and `m` float16):
    Q4_0  [d, qs[16]]         w = d * (q - 8)      q = low nibbles of qs (weights 0..15), then high (16..31)
    Q4_1  [d, m, qs[16]]      w = d * q + m
    Q8_0  [d, qs[32] int8]    w = d * q

The int4 kernel computes w = q * scale + min with GGUF's nibble order, so Q4_1 is (qs, d, m) and Q4_0 is
(qs, d, -8 d), both group 32; Q8_0 is the int8 kernel with group 32 (q, d). The kernels' dequantized
weights equal `gguf.quants.dequantize` on the same blocks (Q4_0 up to one float32 rounding of d * (q - 8)
versus d * q - 8 d).
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

QK = 32  # weights per block in Q4_0 / Q4_1 / Q8_0
Q4_TYPES = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1)
Q8_TYPES = (gguf.GGMLQuantizationType.Q8_0,)
KEPT_TYPES = Q4_TYPES + Q8_TYPES
"""The block types `--quantization gguf` keeps as stored; other types are dequantized at load."""


@dataclass
class GGUFWeight:
    """A linear weight [rows, cols] as the file stores it: each row a run of blocks along the input."""

    blocks: np.ndarray
    """[rows, cols / 32 * bytes_per_block] uint8."""
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, int]
    """The weight's logical [out, in] shape (what the layer expects)."""

    def narrow(self, dim: int, start: int, length: int) -> "GGUFWeight":
        """Rows [start, start + length) (dim 0), or columns at block granularity (dim 1, a row-parallel shard)."""
        rows, cols = self.shape
        if dim == 0:
            return GGUFWeight(self.blocks[start:start + length], self.ggml_type, (length, cols))
        if start % QK or length % QK:
            raise ValueError(f"a GGUF {self.ggml_type.name} weight splits only at {QK}-column blocks "
                             f"(columns {start}..{start + length})")
        per_block = self.blocks.shape[1] // (cols // QK)
        cut = self.blocks[:, start // QK * per_block:(start + length) // QK * per_block]
        return GGUFWeight(cut, self.ggml_type, (rows, length))

    def dequantize(self) -> torch.Tensor:
        """[rows, cols] float32, by the gguf package (what the default, dequantizing load computes)."""
        w = gguf.quants.dequantize(self.blocks, self.ggml_type).reshape(self.shape)
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)


def _split_blocks(weight: GGUFWeight) -> np.ndarray:
    rows, cols = weight.shape
    return np.ascontiguousarray(weight.blocks).reshape(rows, cols // QK, -1)      # [N, G, bytes_per_block]


def _f16(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def q4_blocks(weight: GGUFWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 -> (q [N, K / 2] uint8 as stored, scales [N, K / 32], mins [N, K / 32]) float32."""
    b = _split_blocks(weight)
    rows, cols = weight.shape
    d = _f16(b[..., 0:2])                                                         # [N, G]
    if weight.ggml_type == gguf.GGMLQuantizationType.Q4_0:
        qs, mins = b[..., 2:18], -8 * d
    elif weight.ggml_type == gguf.GGMLQuantizationType.Q4_1:
        qs, mins = b[..., 4:20], _f16(b[..., 2:4])
    else:
        raise ValueError(f"not a Q4_0/Q4_1 weight: {weight.ggml_type.name}")
    return torch.from_numpy(np.ascontiguousarray(qs).reshape(rows, cols // 2)), d, mins


def q8_0_blocks(weight: GGUFWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 -> (q [N, K] int8, scales [N, K / 32] float32): the codes and per-block scales as stored."""
    if weight.ggml_type != gguf.GGMLQuantizationType.Q8_0:
        raise ValueError(f"not a Q8_0 weight: {weight.ggml_type.name}")
    b = _split_blocks(weight)
    rows, cols = weight.shape
    q = torch.from_numpy(np.ascontiguousarray(b[..., 2:34]).view(np.int8).reshape(rows, cols))
    return q, _f16(b[..., 0:2])
