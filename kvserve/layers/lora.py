"""Batched LoRA: a LinearMethod that wraps the base method and adds each token's adapter delta.

    y = base(x) + x @ A[slot] @ B[slot]          (PEFT's scaling folded into B when the slot is loaded)

Each adapted layer holds stacked slot tensors (zero where a slot or rank is unused):

    lora_a  [max_loras, in,  num_slices * max_rank]
    lora_b  [max_loras, num_slices * max_rank, out]

A fused layer (QKV, gate/up) has one slice per checkpoint module: slice j's A goes into rank columns
[j*R, j*R + r) and its B into the same rows and into that module's output columns only, so one pair of
matmuls per slot serves q, k and v at once (B is block diagonal). These are the shapes a GPU kernel (Punica
SGMV/BGMV) takes; the CPU path below is its reference: tokens sorted by slot once per step (LoRABatch),
then one [n, in] x [in, R] x [R, out] product per slot present, or, when the slots' token counts are
about equal (decode steps), all slots in one batched [S, L, in] x [S, in, R] x [S, R, out] pair; never a
loop over requests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from kvserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvserve.layers.linear_methods import LinearMethod


@dataclass
class LoRABatch:
    """The step's token -> slot mapping, shared by every LoRA layer of the model.

    NOTE: held by reference (vLLM's PunicaWrapper) instead of passed through every layer's forward: the model
    file stays LoRA-agnostic. Only the model runner sets it, once per step, before the forward pass."""

    order: torch.Tensor | None = None
    """[N] int64: the tokens that use an adapter, sorted by slot (None: the whole step is the base model)."""
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    """(slot, start, end): order[start:end] are the tokens of that slot."""
    slots: torch.Tensor | None = None
    """[S] int64: the slots present this step."""
    padded_out: torch.Tensor | None = None
    """[S * L] int64: `padded` flattened, padding clamped to a real row (where it adds an exact zero)."""
    padded: torch.Tensor | None = None
    """[S, L] int64: row s lists slot s's tokens, padded with T (a zero row appended to the input), so all
    slots run as one batched matmul pair whatever their number."""

    def set_token_slots(self, token_slots: np.ndarray, device: torch.device) -> None:
        """token_slots [T] int: each token's slot, -1 for the base model."""
        adapted = np.flatnonzero(token_slots >= 0)
        if adapted.size == 0:
            self.order, self.segments, self.slots, self.padded, self.padded_out = None, [], None, None, None
            return
        order = adapted[np.argsort(token_slots[adapted], kind="stable")]
        slots, starts, counts = np.unique(token_slots[order], return_index=True, return_counts=True)
        self.order = torch.from_numpy(order).to(device)
        self.segments = [(int(s), int(a), int(a + n)) for s, a, n in zip(slots, starts, counts)]
        self.slots = self.padded = self.padded_out = None
        if len(slots) == 1 or len(slots) * int(counts.max()) > 1.25 * len(order):
            return  # NOTE: padding would cost more than the batched call saves (a prefill chunk beside decodes)
        padded = np.full((len(slots), int(counts.max())), len(token_slots), dtype=np.int64)    # [S, L]
        for row, (a, n) in enumerate(zip(starts, counts)):
            padded[row, :n] = order[a:a + n]
        self.slots = torch.from_numpy(slots.astype(np.int64)).to(device)
        self.padded = torch.from_numpy(padded).to(device)
        self.padded_out = torch.from_numpy(np.minimum(padded, len(token_slots) - 1).reshape(-1)).to(device)


def lora_output_slices(layer: nn.Module) -> list[tuple[str, int, int]] | None:
    """(checkpoint module, output start, output size) of each part of `layer`; None: not adaptable."""
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        return [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)]
    if isinstance(layer, MergedColumnParallelLinear):
        gate, up = layer.output_sizes
        return [("gate_proj", 0, gate), ("up_proj", gate, up)]
    if isinstance(layer, RowParallelLinear):
        return [(None, 0, layer.output_size)]  # o_proj or down_proj: named by where the layer sits
    return None


def lora_rank_shard(layer: nn.Module, module_index: int, a: torch.Tensor,
                    b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of one checkpoint module's A [r, in] and B [out, r], sharded like the base weight:
    a column-parallel layer keeps A whole and B's rows of its outputs (per fused part; a replicated KV head
    takes its head's rows); a row-parallel layer keeps A's columns of its inputs and B whole, so its delta
    is a partial sum that the layer's all-reduce adds up with the base output's, once."""
    if layer.tp_size == 1:
        return a, b
    if isinstance(layer, RowParallelLinear):
        return a.narrow(1, layer.tp_rank * layer.input_size, layer.input_size), b
    _, _, size = layer.lora_slices[module_index]
    if isinstance(layer, QKVParallelLinear) and module_index > 0:
        return a, b.narrow(0, layer.kv_head_start * layer.head_dim, size)
    return a, b.narrow(0, layer.tp_rank * size, size)


class LoRAMethod:
    """Wraps a base LinearMethod (dense or prepacked: its weights are untouched). Layers it cannot adapt
    (the LM head) get no slot tensors and run the base method alone."""

    name = "lora"

    def __init__(self, base: LinearMethod, batch: LoRABatch, max_loras: int, max_lora_rank: int):
        self.base = base
        self.batch = batch
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.base.process_weights_after_loading(layer)
        slices = lora_output_slices(layer)
        if slices is None:
            return
        rank = len(slices) * self.max_lora_rank
        w = layer.weight
        layer.lora_slices = slices
        layer.lora_a = torch.zeros(self.max_loras, layer.input_size, rank, dtype=w.dtype, device=w.device)
        layer.lora_b = torch.zeros(self.max_loras, rank, layer.output_size, dtype=w.dtype, device=w.device)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.base.apply(layer, x, bias)                                   # [T, out]
        order = self.batch.order
        if order is None or getattr(layer, "lora_a", None) is None:
            return y
        if self.batch.padded is None:  # one slot, or slots of very unequal token counts: one pair per slot
            xs = x.index_select(0, order)                                                     # [N, in]
            delta = torch.cat([xs[start:end] @ layer.lora_a[slot] @ layer.lora_b[slot]
                               for slot, start, end in self.batch.segments])                  # [N, out]
            return y.index_add_(0, order, delta.to(y.dtype))
        # One batched pair for all slots: tokens gathered per slot (padded with a zero row), then scattered back.
        padded, slots = self.batch.padded, self.batch.slots                                   # [S, L], [S]
        x_ext = torch.cat([x, x.new_zeros(1, x.shape[1])])                                   # [T + 1, in]
        xs = x_ext[padded]                                                                    # [S, L, in]
        delta = torch.bmm(torch.bmm(xs, layer.lora_a[slots]), layer.lora_b[slots])          # [S, L, out]
        # NOTE: a padding row's delta is exactly zero (a zero input row), so it may land on any real row.
        return y.index_add_(0, self.batch.padded_out, delta.reshape(-1, delta.shape[-1]).to(y.dtype))
