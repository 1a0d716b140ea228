"""Zero-filled host tensors whose pages the OS supplies on first touch.

`torch.zeros` writes every byte up front: for the CPU KV pool (2 GiB by default) that is a page fault and a
memset per page before the server is ready, for blocks most of which no request may ever use. An anonymous
memory map is zero by definition and is backed page by page as it is written, so the pool costs nothing
until used and only the pages used become resident.
"""
from __future__ import annotations

import math
import mmap

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros over an anonymous memory map (kept alive by the tensor)."""
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count).view(shape)
