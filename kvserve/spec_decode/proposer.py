"""The proposer seam: what the worker calls after each step for the requests the scheduler wants drafts for.

A new method (suffix decoding, an EAGLE or Medusa head) is one more class with this shape, built in
`Worker.load_model` from the speculative config.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Proposer(Protocol):
    name: str

    def propose(self, batch: Any, rows: np.ndarray, num_drafts: np.ndarray) -> list[list[int]]:
        """Up to num_drafts[i] tokens to follow the request in batch row rows[i]. Its tokens so far (prompt
        and output, the one just sampled included) are batch.token_ids[row, :batch.num_tokens[row]].
        Fewer (or none) is allowed. batch: the worker's InputBatch (worker/input_batch.py; spec_decode sits
        below the worker, so it is not imported here)."""
        ...
