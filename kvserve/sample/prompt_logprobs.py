"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): each prompt token's logprob under the model given
the tokens before it, its rank, and the top-k alternatives, from the hidden states of the very forward pass
that computes the prompt (no second pass).

Position j's logits predict token j + 1. A step that computes prompt positions [s, e) of a P-token prompt
therefore describes prompt tokens s + 1 .. min(e, P - 1): a chunk that stops short of the prompt's end
describes the next chunk's first token too (it is known: it is a prompt token). The logits at position
P - 1 predict the first output token, which is the sampler's. The first prompt token has no entry.

These are always of the raw model distribution (as vLLM's, whatever `--logprobs-mode` says for sampled
tokens): log_softmax of the logits, before any logits processor, temperature or top-k/top-p.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# LM-head rows per matmul: bounds the [rows, vocab] float32 logits of a long prompt chunk (a 49k vocabulary:
# 256 rows = 48 MiB), whatever max_num_batched_tokens is.
_ROWS_PER_SLICE = 256


@dataclass(slots=True)
class PromptLogprobsChunk:
    """One step's prompt logprobs of one request: its prompt tokens [start, start + len). Numpy arrays, so
    the per-step delta to the front end pickles to a few bytes per number."""

    start: int
    """Index in the prompt of the first token described (>= 1: the first prompt token has no entry)."""
    token_ids: np.ndarray  # [M, 1 + k] int32: the prompt token, then the top k by descending logprob
    logprobs: np.ndarray   # [M, 1 + k] float32: their logprobs
    ranks: np.ndarray      # [M] int32: the prompt token's rank (1 = most likely; ties rank it lower)

    def __len__(self) -> int:
        return self.token_ids.shape[0]


def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                            target_ids: torch.Tensor, num_top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """hidden [M, hidden_size]: the states at the positions before each target; target_ids [M] int64: the
    prompt tokens they predict. Returns token_ids [M, 1 + num_top] int32 (the target first), logprobs
    [M, 1 + num_top] float32 and the targets' ranks [M] int32, on the CPU."""
    ids, lps, ranks = [], [], []
    for lo in range(0, hidden.shape[0], _ROWS_PER_SLICE):
        hi = lo + _ROWS_PER_SLICE
        logprobs = compute_logits(hidden[lo:hi]).float().log_softmax(dim=-1)     # [m, vocab]
        target = target_ids[lo:hi].unsqueeze(1)                                     # [m, 1]
        target_lp = logprobs.gather(1, target)                                      # [m, 1]
        # the same rank rule as the sampler's logprobs: tokens at least as likely as the target, itself included
        ranks.append((logprobs >= target_lp).sum(dim=-1))                           # [m]
        k = min(num_top, logprobs.shape[1])
        if k:
            top_lp, top_ids = logprobs.topk(k, dim=-1)                              # [m, k]
            ids.append(torch.cat((target, top_ids), dim=1))
            lps.append(torch.cat((target_lp, top_lp), dim=1))
        else:
            ids.append(target)
            lps.append(target_lp)
    return (torch.cat(ids).to(torch.int32).cpu().numpy(), torch.cat(lps).cpu().numpy(),
            torch.cat(ranks).to(torch.int32).cpu().numpy())
