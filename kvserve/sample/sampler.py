"""Sampler: logits [B, vocab] -> one token per row (+ logprobs), following vLLM v1's sampler.

Order: logit_bias -> min_tokens -> penalties -> grammar -> (greedy: argmax) | (random: temperature -> top_k
-> top_p -> min_p -> exponential race).

Logprobs (vLLM's `--logprobs-mode`): `raw_*` describe the model's own logits, before any of that;
`processed_*` the values the token was chosen from: after the processors, and for a sampled row after
temperature and top_k/top_p/min_p too (masked tokens -inf). `*_logprobs` are log-softmaxed, `*_logits` not.
Only the processed modes promise that a greedy row's token is their top-1 (a repetition penalty moves
the argmax). Nothing is computed for a batch in which no row asked for logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.sample.metadata import SamplingMetadata

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# NOTE: vLLM's default is raw_logprobs; ours is processed (docs/features/sampling-defaults.md): the built-in
# model's default repetition penalty would otherwise report, at temperature 0, a top-1 it did not choose.
DEFAULT_LOGPROBS_MODE = "processed_logprobs"


@dataclass
class RowLogprobs:
    """Logprobs of one row: the sampled token first, then the top-k alternatives by descending logprob."""

    token_ids: list[int]
    logprobs: list[float]
    """Logprobs or logits, as the sampler's logprobs mode says."""
    ranks: list[int]
    """Rank of each token in the reported distribution (1 = most likely)."""


@dataclass
class SamplerOutput:
    """One sampled token per row, plus logprobs for the rows that asked for them."""

    sampled_token_ids: list[int]  # [B]
    logprobs: list[RowLogprobs | None]  # [B]; None where params.logprobs is None


class Sampler:
    """Stateless sampler; every random draw comes from a row's generator or the default one.

    Reproducibility contract: a seeded row's token depends only on its generator's state and its own
    logits row, never on the other rows of the batch.
    """

    def __init__(self, logprobs_mode: str = DEFAULT_LOGPROBS_MODE):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` [B, vocab] (not modified); advances seeded generators."""
        logits = logits.float()
        wanted = meta.max_num_logprobs is not None
        raw = self.logprobs_mode.startswith("raw")
        reported = logits if wanted and raw else None  # NOTE: what follows works on copies of `logits`
        logits = self.apply_processors(logits, meta)
        if meta.all_greedy:
            sampled, processed = logits.argmax(dim=-1), logits  # [B]
        else:
            sampled, processed = _random_sample(logits, meta, keep_logits=wanted and not raw)  # [B]
            if not meta.all_random:
                sampled = torch.where(meta.greedy_mask, logits.argmax(dim=-1), sampled)
        token_ids = sampled.tolist()
        if not wanted:
            return SamplerOutput(token_ids, [None] * len(token_ids))
        reported = processed if reported is None else reported
        if self.logprobs_mode.endswith("_logprobs"):
            reported = reported.log_softmax(dim=-1)
        return SamplerOutput(token_ids, _gather_logprobs(reported, sampled, meta))

    @staticmethod
    def apply_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Apply logit_bias, then min_tokens, then penalties, then the grammar bitmask (structured outputs);
        these precede greedy and random choice.

        Returns `logits` itself when no row needs a processor, else a new [B, vocab] tensor.
        """
        if not meta.needs_processing:
            return logits
        logits = logits.clone()
        if meta.logit_bias is not None:
            bias = meta.logit_bias
            logits.index_put_((bias.row_idx, bias.token_ids), bias.values, accumulate=True)
        if meta.min_tokens_mask is not None:
            mask = meta.min_tokens_mask
            logits[mask.row_idx, mask.token_ids] = float("-inf")
        if meta.penalties is not None:
            logits = _apply_penalties(logits, meta)
        if meta.grammar is not None:
            _apply_grammar(logits, meta.grammar)
        return logits


def _apply_grammar(logits: torch.Tensor, grammar) -> None:
    """-inf outside each constrained row's grammar, in place: one call over the batch (xgrammar's kernel)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, grammar.bitmask.to(logits.device), vocab_size=logits.shape[1],
                                    indices=grammar.row_idx)


def _apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (CTRL/HF), presence and frequency penalties, touching only the tokens each row has seen:
    gathers and scatters over the rows' token lists instead of [B, vocab] count tensors, so a decode step
    costs O(prompt + output tokens), not several passes over the vocabulary. The token lists are padded with
    `vocab_size`, a column appended here and dropped at the end."""
    pen = meta.penalties
    rows, vocab_size = logits.shape
    ext = torch.cat([logits, logits.new_zeros(rows, 1)], dim=1)                       # [B, vocab + 1]
    seen = torch.cat([pen.prompt_token_ids, pen.output_token_ids], dim=1)             # [B, P + O]
    values = ext.gather(1, seen)
    rep = pen.repetition_penalties.unsqueeze(1)
    # NOTE: scatter_ with repeated ids is safe here: every copy of an id writes the same value, computed
    # from the logit before any write (a token seen twice is penalised once).
    ext.scatter_(1, seen, torch.where(values > 0, values / rep, values * rep))
    out = pen.output_token_ids
    ext.scatter_(1, out, ext.gather(1, out) - pen.presence_penalties.unsqueeze(1))   # once per distinct token
    ext.scatter_add_(1, out, (-pen.frequency_penalties).unsqueeze(1).expand(out.shape).contiguous())  # per use
    return ext[:, :vocab_size].contiguous()


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Mask all but the top_k largest logits per row with one topk, no full sort (ties are kept)."""
    disabled = top_k == logits.shape[1]  # [B]
    k = top_k.masked_fill(disabled, 1)
    top_values = logits.topk(int(k.max()), dim=-1).values  # [B, max_k]
    threshold = top_values.gather(1, (k - 1).unsqueeze(1))  # [B, 1]
    threshold.masked_fill_(disabled.unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < threshold, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside top_k, then outside the top_p nucleus; may modify `logits` in place."""
    if top_p is None:
        return logits if top_k is None else _apply_top_k_only(logits, top_k)
    sorted_logits, sorted_idx = logits.sort(dim=-1)  # [B, vocab] ascending
    if top_k is not None:
        threshold = sorted_logits.gather(1, (logits.shape[1] - top_k).unsqueeze(1))  # [B, 1]
        sorted_logits.masked_fill_(sorted_logits < threshold, float("-inf"))
    # Ascending cumulative mass: a token is dropped iff all tokens at least as unlikely as it
    # (itself included) carry <= 1 - top_p, i.e. the more likely tokens already reach top_p.
    cum_probs = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)  # [B, vocab]
    drop = cum_probs <= 1.0 - top_p.unsqueeze(1)
    drop[:, -1] = False  # the top token always survives
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, sorted_idx, sorted_logits)


def _random_sample(logits: torch.Tensor, meta: SamplingMetadata,
                   keep_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature, top_k, top_p, min_p, then sample by an exponential race: ([B] int64, the logits the
    tokens were drawn from, -inf where masked, if `keep_logits`, else None). Greedy rows' logits stay as
    given (temperature 1, no masks)."""
    logits = logits / meta.temperature.unsqueeze(1)  # [B, vocab]; a copy, so `logits` stays intact
    logits = _apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    probs = logits.softmax(dim=-1)  # [B, vocab]
    if meta.min_p is not None:
        threshold = meta.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
        below = probs < threshold
        probs.masked_fill_(below, 0.0)
        if keep_logits:
            logits.masked_fill_(below, float("-inf"))
    # argmax(p / q), q ~ Exp(1), picks token i with probability p_i / sum(p): no renormalising needed.
    noise = torch.empty_like(probs)  # [B, vocab]
    if len(meta.generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in meta.generators.items():
        # NOTE: a row-sized draw from the row's own generator, so batch mates cannot shift its stream.
        noise[row] = torch.empty(probs.shape[1], device=probs.device).exponential_(generator=generator)
    # A zero draw would make 0/0 = NaN, which argmax prefers over every number.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1), logits if keep_logits else None


def _gather_logprobs(values: torch.Tensor, sampled: torch.Tensor, meta: SamplingMetadata) -> list[RowLogprobs | None]:
    """Sampled token's value and rank plus the top max_num_logprobs alternatives in `values` [B, vocab]
    (logprobs or logits), cut per row."""
    top_logprobs, top_ids = values.topk(meta.max_num_logprobs, dim=-1)  # [B, max_num_logprobs]
    sampled_logprobs = values.gather(1, sampled.unsqueeze(1))  # [B, 1]
    sampled_ranks = (values >= sampled_logprobs).sum(dim=-1)  # [B]
    top_logprobs, top_ids = top_logprobs.tolist(), top_ids.tolist()
    sampled_logprobs, sampled_ranks = sampled_logprobs.squeeze(1).tolist(), sampled_ranks.tolist()
    sampled_ids = sampled.tolist()
    out: list[RowLogprobs | None] = []
    for row, num in enumerate(meta.num_logprobs):
        if num is None:
            out.append(None)
            continue
        num = min(num, meta.max_num_logprobs)
        out.append(RowLogprobs(token_ids=[sampled_ids[row]] + top_ids[row][:num],
                               logprobs=[sampled_logprobs[row]] + top_logprobs[row][:num],
                               ranks=[sampled_ranks[row]] + list(range(1, num + 1))))
    return out
