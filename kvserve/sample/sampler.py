"""Sampler: logits [B, vocab] -> one token per row (+ logprobs), following vLLM v1's sampler.

Order: raw logprobs -> logit_bias -> min_tokens -> penalties -> (greedy: argmax) | (random: temperature
-> top_k -> top_p -> min_p -> exponential race).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.sample.metadata import SamplingMetadata


@dataclass
class RowLogprobs:
    """Logprobs of one row: the sampled token first, then the top-k alternatives by descending logprob."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    """Rank of each token in the raw distribution (1 = most likely)."""


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

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` [B, vocab] (not modified); advances seeded generators."""
        logits = logits.float()
        # NOTE: logprobs describe the model's own distribution (vLLM's default "raw_logprobs").
        raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        logits = self.apply_processors(logits, meta)
        if meta.all_greedy:
            sampled = logits.argmax(dim=-1)  # [B]
        else:
            sampled = _random_sample(logits, meta)  # [B]
            if not meta.all_random:
                sampled = torch.where(meta.greedy_mask, logits.argmax(dim=-1), sampled)
        token_ids = sampled.tolist()
        if raw_logprobs is None:
            return SamplerOutput(token_ids, [None] * len(token_ids))
        return SamplerOutput(token_ids, _gather_logprobs(raw_logprobs, sampled, meta))

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


def _random_sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, top_k, top_p, min_p, then sample by an exponential race; returns [B] int64."""
    logits = logits / meta.temperature.unsqueeze(1)  # [B, vocab]; a copy, so `logits` stays intact
    logits = _apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    probs = logits.softmax(dim=-1)  # [B, vocab]
    if meta.min_p is not None:
        threshold = meta.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
        probs.masked_fill_(probs < threshold, 0.0)
    # argmax(p / q), q ~ Exp(1), picks token i with probability p_i / sum(p): no renormalising needed.
    noise = torch.empty_like(probs)  # [B, vocab]
    if len(meta.generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in meta.generators.items():
        # NOTE: a row-sized draw from the row's own generator, so batch mates cannot shift its stream.
        noise[row] = torch.empty(probs.shape[1], device=probs.device).exponential_(generator=generator)
    # A zero draw would make 0/0 = NaN, which argmax prefers over every number.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)


def _gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor,
                     meta: SamplingMetadata) -> list[RowLogprobs | None]:
    """Sampled token's logprob and rank plus the top max_num_logprobs alternatives, cut per row."""
    top_logprobs, top_ids = raw_logprobs.topk(meta.max_num_logprobs, dim=-1)  # [B, max_num_logprobs]
    sampled_logprobs = raw_logprobs.gather(1, sampled.unsqueeze(1))  # [B, 1]
    sampled_ranks = (raw_logprobs >= sampled_logprobs).sum(dim=-1)  # [B]
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
