"""Prompt lookup (n-gram) proposer: find the most recent earlier occurrence of the request's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min, over prompt and output so far) and propose the tokens
that followed it. Costs no model call; pays off where outputs copy their context (code edits, RAG answers,
summaries, repeated structure)."""
from __future__ import annotations

import numpy as np


class NgramProposer:
    name = "ngram"

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, batch, rows: np.ndarray, num_drafts: np.ndarray) -> list[list[int]]:
        return [self.propose_one(batch.token_ids[row, :batch.num_tokens[row]], int(k))
                for row, k in zip(rows, num_drafts)]

    def propose_one(self, tokens: np.ndarray, k: int) -> list[int]:
        """Vectorised over the context: candidates are the earlier positions holding the last token; their
        match length grows one column at a time (at most max_n array steps, never a loop per token)."""
        n = len(tokens)
        if k <= 0 or n < self.min_n + 1:
            return []
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # [C] earlier positions where a match could end
        if ends.size == 0:
            return []
        match = np.ones(ends.size, dtype=np.int64)       # [C] length of the match ending at each candidate
        alive = np.ones(ends.size, dtype=bool)
        for back in range(1, min(self.max_n, n - 1)):
            prev = ends - back
            alive &= prev >= 0
            alive[alive] = tokens[prev[alive]] == tokens[n - 1 - back]
            if not alive.any():
                break
            match += alive
        best = int(match.max())
        if best < self.min_n:
            return []
        end = int(ends[match == best][-1])  # the most recent occurrence of the longest match
        return tokens[end + 1:end + 1 + k].tolist()
