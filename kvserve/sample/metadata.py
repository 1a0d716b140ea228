"""SamplingRow (one request's view at one step) and SamplingMetadata (the batch, as tensors)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.sampling_params import _GREEDY_EPS, SamplingParams


@dataclass
class SamplingRow:
    """One row of the logits batch: a request about to receive its next token.

    `generator` is set iff `params.seed is not None`; it is owned by the request and advanced in place
    by sampling, so a seeded request's tokens depend only on its seed and its own logits.
    `eos_token_ids` are masked together with `params.stop_token_ids` while
    `len(output_token_ids) < params.min_tokens`, whether or not `params.ignore_eos` is set.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class SparseLogits:
    """Sparse (row, token) entries of a [B, vocab] logits tensor, e.g. a logit bias or a mask."""

    row_idx: torch.Tensor  # [num_entries] int64
    token_ids: torch.Tensor  # [num_entries] int64
    values: torch.Tensor | None = None  # [num_entries] float32; None for a pure mask


@dataclass
class GrammarBitmask:
    """Structured outputs: the tokens each constrained logits row may take (xgrammar's bitmask layout)."""

    bitmask: torch.Tensor  # [B, ceil(vocab / 32)] int32; bit t % 32 of word t // 32 set = token t allowed
    row_idx: list[int]
    """The constrained rows; the other rows of `bitmask` are ignored."""

    def select(self, lo: int, hi: int) -> "GrammarBitmask | None":
        """The part for logits rows [lo, hi) (re-indexed from 0); None if none of them is constrained."""
        rows = [r - lo for r in self.row_idx if lo <= r < hi]
        return GrammarBitmask(self.bitmask[lo:hi], rows) if rows else None


@dataclass
class PenaltyTensors:
    """Inputs of repetition/frequency/presence penalties; built only when some row has a penalty.

    NOTE: token tensors are right-padded with `vocab_size`, a column the bin counts drop, and hold
    no tokens for rows that do not need them (a row without penalties has length 0), so long
    prompts of unpenalised requests cost nothing.
    """

    prompt_token_ids: torch.Tensor  # [B, max_prompt_len] int64; only rows with repetition_penalty != 1
    output_token_ids: torch.Tensor  # [B, max_output_len] int64
    repetition_penalties: torch.Tensor  # [B] float32; 1.0 = none
    frequency_penalties: torch.Tensor  # [B] float32; 0.0 = none
    presence_penalties: torch.Tensor  # [B] float32; 0.0 = none


@dataclass
class SamplingMetadata:
    """Per-step batched sampling state, built once per step by `build()`.

    Optional fields are None when no row needs them, which is how the sampler picks its fast paths.
    Top-k/top-p/min_p are left disabled on greedy rows: they cannot change an argmax.
    """

    vocab_size: int
    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows (never divided by 0)
    greedy_mask: torch.Tensor  # [B] bool
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int64 in [1, vocab]; vocab = disabled
    top_p: torch.Tensor | None  # [B] float32; 1.0 = disabled
    min_p: torch.Tensor | None  # [B] float32; 0.0 = disabled
    generators: dict[int, torch.Generator]
    """Row index -> the request's generator, for seeded random rows only."""
    penalties: PenaltyTensors | None
    logit_bias: SparseLogits | None
    min_tokens_mask: SparseLogits | None
    """(row, token) pairs set to -inf: EOS and stop tokens of rows still short of min_tokens."""
    num_logprobs: list[int | None]
    """Per row: params.logprobs (None = the row wants no logprobs)."""
    max_num_logprobs: int | None
    """Largest params.logprobs in the batch, capped at vocab_size; None if no row wants logprobs."""
    grammar: GrammarBitmask | None = None
    """Structured outputs: tokens outside a constrained row's grammar are set to -inf."""

    @property
    def num_rows(self) -> int:
        return len(self.num_logprobs)

    @property
    def needs_penalties(self) -> bool:
        return self.penalties is not None

    @property
    def needs_processing(self) -> bool:
        """Whether any logits processor (bias, min_tokens, penalties) changes the logits."""
        return (self.penalties is not None or self.logit_bias is not None
                or self.min_tokens_mask is not None or self.grammar is not None)

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device) -> "SamplingMetadata":
        """Batch `rows` (row i of the logits is rows[i]). Token ids in the rows were checked at admission."""
        params = [row.params for row in rows]
        dense = DenseSamplingParams(
            temperature=np.array([p.temperature for p in params], dtype=np.float32),
            top_k=np.array([p.effective_top_k for p in params], dtype=np.int64),
            top_p=np.array([p.top_p for p in params], dtype=np.float32),
            min_p=np.array([p.min_p for p in params], dtype=np.float32),
            num_logprobs=[p.logprobs for p in params])
        generators = {i: row.generator for i, row in enumerate(rows) if row.generator is not None}
        return cls.assemble(dense, generators, rows, vocab_size, device)

    @classmethod
    def assemble(cls, dense: "DenseSamplingParams", generators: dict[int, torch.Generator],
                 sparse_rows: list[SamplingRow] | None, vocab_size: int,
                 device: torch.device, grammar: GrammarBitmask | None = None) -> "SamplingMetadata":
        """From per-row arrays (the worker keeps them in its input batch) and, when some row needs a logits
        processor (penalties, logit_bias, min_tokens), every row's SamplingRow; None when none does."""
        greedy = dense.temperature < _GREEDY_EPS                                   # [B]
        random = ~greedy
        top_k = top_p = min_p = None
        if np.any(random & (dense.top_k > 0) & (dense.top_k < vocab_size)):
            k = np.where(greedy | (dense.top_k == 0), vocab_size, np.minimum(dense.top_k, vocab_size))
            top_k = torch.from_numpy(k.astype(np.int64)).to(device)
        if np.any(random & (dense.top_p < 1.0)):
            top_p = torch.from_numpy(np.where(greedy, 1.0, dense.top_p).astype(np.float32)).to(device)
        if np.any(random & (dense.min_p > 0.0)):
            min_p = torch.from_numpy(np.where(greedy, 0.0, dense.min_p).astype(np.float32)).to(device)
        wanted = [n for n in dense.num_logprobs if n is not None]
        rows = sparse_rows or []
        return cls(
            vocab_size=vocab_size,
            temperature=torch.from_numpy(np.where(greedy, 1.0, dense.temperature).astype(np.float32)).to(device),
            greedy_mask=torch.from_numpy(greedy).to(device),
            all_greedy=bool(greedy.all()),
            all_random=not bool(greedy.any()),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators={i: g for i, g in generators.items() if not greedy[i]},
            penalties=_build_penalties(rows, vocab_size, device) if rows else None,
            logit_bias=_build_logit_bias([row.params for row in rows], device) if rows else None,
            min_tokens_mask=_build_min_tokens_mask(rows, device) if rows else None,
            num_logprobs=list(dense.num_logprobs),
            max_num_logprobs=min(max(wanted), vocab_size) if wanted else None,
            grammar=grammar,
        )


@dataclass
class DenseSamplingParams:
    """The per-row sampling values every row has, as arrays (row i of the logits is index i)."""

    temperature: np.ndarray  # [B] float32; below _GREEDY_EPS = greedy
    top_k: np.ndarray        # [B] int64; 0 = disabled
    top_p: np.ndarray        # [B] float32; 1.0 = disabled
    min_p: np.ndarray        # [B] float32; 0.0 = disabled
    num_logprobs: list[int | None]


def _pad_token_lists(lists: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """Right-pad token lists into a [len(lists), max_len] int64 tensor without a per-row tensor op."""
    lengths = torch.tensor([len(ids) for ids in lists], dtype=torch.int64)  # [B]
    max_len = int(lengths.max()) if len(lists) else 0
    padded = torch.full((len(lists), max_len), pad_id, dtype=torch.int64)  # [B, max_len]
    flat = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64)  # [sum(lengths)]
    padded[torch.arange(max_len) < lengths.unsqueeze(1)] = flat
    return padded.to(device)


def _build_penalties(rows: list[SamplingRow], vocab_size: int,
                     device: torch.device) -> PenaltyTensors | None:
    if not any(row.params.has_penalties for row in rows):
        return None
    rep = [row.params.repetition_penalty for row in rows]
    return PenaltyTensors(
        prompt_token_ids=_pad_token_lists(
            [row.prompt_token_ids if r != 1.0 else [] for row, r in zip(rows, rep)], vocab_size, device),
        output_token_ids=_pad_token_lists(
            [row.output_token_ids if row.params.has_penalties else [] for row in rows], vocab_size, device),
        repetition_penalties=torch.tensor(rep, dtype=torch.float32, device=device),
        frequency_penalties=torch.tensor([row.params.frequency_penalty for row in rows],
                                         dtype=torch.float32, device=device),
        presence_penalties=torch.tensor([row.params.presence_penalty for row in rows],
                                        dtype=torch.float32, device=device),
    )


def _build_logit_bias(params: list[SamplingParams], device: torch.device) -> SparseLogits | None:
    row_idx, token_ids, values = [], [], []
    for i, p in enumerate(params):
        if p.logit_bias:
            row_idx.extend([i] * len(p.logit_bias))
            token_ids.extend(p.logit_bias)
            values.extend(float(v) for v in p.logit_bias.values())
    if not row_idx:
        return None
    return SparseLogits(row_idx=torch.tensor(row_idx, dtype=torch.int64, device=device),
                        token_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
                        values=torch.tensor(values, dtype=torch.float32, device=device))


def _build_min_tokens_mask(rows: list[SamplingRow], device: torch.device) -> SparseLogits | None:
    row_idx, token_ids = [], []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.params.min_tokens:
            stops = set(row.eos_token_ids) | set(row.params.stop_token_ids)
            row_idx.extend([i] * len(stops))
            token_ids.extend(stops)
    if not row_idx:
        return None
    return SparseLogits(row_idx=torch.tensor(row_idx, dtype=torch.int64, device=device),
                        token_ids=torch.tensor(token_ids, dtype=torch.int64, device=device))
