"""One rank's view of a tensor-parallel group over torch.distributed: the layers' collectives (all-reduce,
all-gather; NCCL on CUDA, gloo on CPU), the driver's per-step broadcast (always over a gloo group, since
it carries pickled Python objects), and a count of the bytes this rank sends.

Bytes are counted with the ring algorithms' cost (what NCCL and gloo run for large messages): an
all-reduce of B bytes sends 2 (N-1)/N B per rank, an all-gather of B bytes per rank sends (N-1) B, and the
driver's broadcast of B bytes sends (N-1) B from rank 0 (0 from the others).
"""
from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvserve.layers.parallel import ShardContext

logger = logging.getLogger("kvserve")


@dataclass
class CommStats:
    """What this rank sent so far, by collective."""

    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0
    all_gather_calls: int = 0
    all_gather_bytes: int = 0
    broadcast_calls: int = 0
    broadcast_bytes: int = 0
    """The driver's step messages (scheduler diff + sampled tokens); counted on rank 0 only."""
    steps: int = 0
    """Steps the driver broadcast (forward passes every rank ran)."""

    @property
    def total_bytes(self) -> int:
        return self.all_reduce_bytes + self.all_gather_bytes + self.broadcast_bytes


class TPGroup:
    """Rank `rank` of `size` after init_process_group. Owns no model state; the executor and the worker loop
    call broadcast_object in the same order on every rank, the layers call the collectives in the same order
    because every rank runs the same forward pass."""

    def __init__(self, rank: int, size: int, device: torch.device, store: dist.Store | None, timeout_s: float,
                 init_method: str | None = None):
        self.rank, self.size, self.device = rank, size, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=init_method, store=store, rank=rank, world_size=size,
                                timeout=timeout)
        # NOTE: object broadcasts go over gloo even on CUDA (no device round trip for a few hundred bytes)
        self.cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
        self.stats = CommStats()
        self._closed = False

    def shard_context(self) -> ShardContext:
        return ShardContext(self.rank, self.size, self.all_reduce, self.all_gather)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; every rank gets the same bytes back."""
        n = x.numel() * x.element_size()
        self.stats.all_reduce_calls += 1
        self.stats.all_reduce_bytes += 2 * (self.size - 1) * n // self.size
        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d] per rank -> [..., size * d], rank order (the vocabulary-parallel LM head's logits)."""
        x = x.contiguous()
        self.stats.all_gather_calls += 1
        self.stats.all_gather_bytes += (self.size - 1) * x.numel() * x.element_size()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj=None, timeout_s: float | None = None):
        """Rank 0's `obj` on every rank (the others pass None): a length, then the pickled bytes.
        timeout_s: give up (raise) after this long instead of the group's timeout."""
        group = self.cpu_group

        def bcast(t: torch.Tensor) -> None:
            work = dist.broadcast(t, 0, group=group, async_op=True)
            if timeout_s is None:
                work.wait()
            else:
                work.wait(timedelta(seconds=timeout_s))

        if self.rank == 0:
            raw = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            length = torch.tensor([len(raw)], dtype=torch.int64)
            self.stats.broadcast_calls += 1
            self.stats.broadcast_bytes += (self.size - 1) * (len(raw) + 8)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        bcast(length)
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        else:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        bcast(payload)
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 — a broken group still counts as gone for this process
                logger.warning("destroying the tensor-parallel process group failed", exc_info=True)
