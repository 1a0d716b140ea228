"""Draft-model proposer: a small checkpoint with the target's vocabulary drafts K tokens greedily.

Its KV cache is its own pool indexed by the target's block ids (one block id holds both models' K/V, so
blocks are sized, allocated, shared and freed once, for both). Each round, for the requests asked:
pass 1 runs the draft over the tokens it has not seen since its last round (those accepted since, and the
token just sampled) and drafts one token; each further pass drafts one more, for all requests still
drafting, in one batch. The scheduler allocates slots for those look-ahead positions.

Greedy drafts are one-hot proposals: the target's verification is then exact for every sampling setting
(sample/rejection_sampler.py), as in vLLM v1.
"""
from __future__ import annotations

import numpy as np
import torch

from kvserve.attention.backend import AttentionBackend, CommonAttentionMetadata
from kvserve.kv_cache.layout import slot_mapping
from kvserve.models.llama import LlamaForCausalLM


class DraftModelProposer:
    name = "draft_model"

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, kv_caches: list, block_size: int,
                 device: torch.device):
        """kv_caches: the draft's own KV pool, per layer (the worker allocates it: worker/kv_pool.py)."""
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.kv_caches = kv_caches

    @torch.inference_mode()
    def propose(self, batch, rows: np.ndarray, num_drafts: np.ndarray) -> list[list[int]]:
        states = [batch.states[r] for r in rows]
        ends = batch.num_tokens[rows]                                                   # [B] tokens so far
        # NOTE: the draft's K/V is trusted only below the target's verified tokens (ends - 1): blocks past
        # those may have been returned after a rejection, taking the draft's entries with them.
        starts = np.minimum(np.array([s.num_draft_computed for s in states], dtype=np.int64), ends - 1)
        drafts = [[t] for t in self._step(batch, rows, starts, ends - starts)]
        for state, end in zip(states, ends):
            state.num_draft_computed = int(end) - 1
        for j in range(1, int(num_drafts.max())):
            active = np.flatnonzero(num_drafts > j)
            pos = ends[active] - 1 + j                                                  # where draft j sits
            batch.token_ids[rows[active], pos] = [drafts[i][-1] for i in active]        # scratch past the end
            for i, token in zip(active, self._step(batch, rows[active], pos, np.ones(len(active), np.int64))):
                drafts[i].append(token)
        return [d[:int(k)] for d, k in zip(drafts, num_drafts)]

    def _step(self, batch, rows: np.ndarray, starts: np.ndarray, q_lens: np.ndarray) -> list[int]:
        """One draft forward over tokens [starts, starts + q_lens) of each row; the greedy next token of each."""
        order = np.argsort(q_lens != 1, kind="stable")  # decodes first (the backends' contract)
        rows, starts, q_lens = rows[order], starts[order], q_lens[order]
        cu = np.cumsum(q_lens)
        req_idx = np.repeat(np.arange(len(rows)), q_lens)                                       # [T]
        positions = starts[req_idx] + np.arange(int(cu[-1])) - (cu - q_lens)[req_idx]           # [T]
        token_rows = rows[req_idx]
        seq_lens = starts + q_lens
        num_decodes = int(np.count_nonzero(q_lens == 1))
        dev, bs = self.device, self.block_size
        max_blocks = int(-(-seq_lens.max() // bs))
        meta = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(np.concatenate(([0], cu))).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            block_table=torch.from_numpy(np.ascontiguousarray(batch.block_table[rows, :max_blocks])).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping(batch.block_table, token_rows, positions, bs)).to(dev),
            num_decodes=num_decodes, num_decode_tokens=num_decodes, block_size=bs,
            query_lens_cpu=q_lens.tolist(), seq_lens_cpu=seq_lens.tolist())
        input_ids = torch.from_numpy(batch.token_ids[token_rows, positions]).to(dev)
        hidden = self.model(input_ids, torch.from_numpy(positions).to(dev), self.kv_caches,
                            self.backend.build_metadata(meta))
        next_tokens = self.model.compute_logits(hidden[torch.from_numpy(cu - 1).to(dev)]).argmax(dim=-1).tolist()
        out = [0] * len(order)
        for i, token in zip(order, next_tokens):
            out[i] = token
        return out
