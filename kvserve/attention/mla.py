"""Multi-head Latent Attention (DeepSeek-V2/V3) over a paged latent KV cache.

The cache holds ONE vector per token per layer: the normalised latent c_kv [kv_lora_rank] followed by the
roped shared key k_pe [qk_rope_head_dim] (e.g. 512 + 64 where multi-head attention would hold 2 x 128 heads x
192), in the same blocks and block tables as any cache: a layer's tensor is [num_blocks, block_size, latent].
Each head's key and value are linear in c_kv (kv_b_proj = [W_UK_h; W_UV_h] per head h), so:

- prefill decompresses: K_h = [W_UK_h c ; k_pe], V_h = W_UV_h c for the chunk's keys (its context gathered
  from the cache), then causal attention as any prefill (attention/prefill.py's tiles);
- decode absorbs W_UK into the query and W_UV into the output (DeepSeek-V2 paper, section 2.1.3; vLLM's MLA
  backends do the same): q_h' = [W_UK_h^T q_nope_h ; q_pe_h] against the cached vectors, the values being their
  first kv_lora_rank entries, one shared "KV head" for every query head (multi-query attention), and the
  output o_h = W_UV_h (sum_t p_t c_t). No per-head K/V is ever built for the context of a decode.

`MLABackend` is the attention backend of an MLA model whatever --attention-backend names (the worker picks it
per model): it lays the cache out and builds the step's metadata (the reference backend's gather indices and
query tiles); the MLA layer (models/deepseek.py) calls `mla_decode` / `mla_prefill` with its own projections.
Sliding windows and soft caps do not apply to MLA.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.attention.prefill import PrefillChunk, chunk_attention, gather, sdpa
from kvserve.attention.torch_ref import TorchRefBackend, TorchRefMetadata


class MLABackend:
    name = "mla"
    supports_cuda_graphs = False
    """The decode path reads its metadata's Python lists; not captured."""

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """head_dim: the latent width (kv_lora_rank + qk_rope_head_dim); one "KV head"."""
        if num_kv_heads != 1:
            raise ValueError(f"an MLA cache holds one latent vector per token, not {num_kv_heads} KV heads")
        return (num_blocks, block_size, head_dim)

    def kv_cache_scale_shape(self, num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...]:
        raise ValueError("the MLA latent KV cache is not quantized: use --kv-cache-dtype auto")

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchRefMetadata:
        return TorchRefBackend().build_metadata(common)

    def forward(self, *args, **kwargs):
        raise NotImplementedError("an MLA layer attends through mla_decode / mla_prefill, not forward(q, k, v)")


def write_latent(kv_cache: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """Write latent [T, W] at `slots` [T] of one layer's cache [blocks, block_size, W]; returns it as [slots, W]."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    flat.index_copy_(0, slots, latent.to(flat.dtype))
    return flat


def mla_decode(q: torch.Tensor, flat: torch.Tensor, meta: TorchRefMetadata, scale: float,
               kv_lora_rank: int) -> torch.Tensor:
    """Absorbed decode. q [Bd, H, W] (W_UK^T q_nope ++ q_pe, W = kv_lora_rank + rope dims), one row per decode
    -> the attention-weighted latent [Bd, H, kv_lora_rank] (W_UV still to apply)."""
    kv = gather(flat, meta.decode_gather_idx, q.dtype)                       # [Bd, Lmax, W]
    keys = kv.unsqueeze(1)                                                   # [Bd, 1, Lmax, W]
    # NOTE: the heads are SDPA's query "sequence" over the one latent KV head (as torch_ref's GQA decode)
    o = sdpa(q.unsqueeze(1), keys, keys[..., :kv_lora_rank], meta.decode_mask, scale)  # [Bd, 1, H, L]
    return o.squeeze(1)


Expand = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""latent [S, W] -> (per-head keys [S, H, Dqk], values [S, H, Dv]): the layer's decompression."""


def mla_prefill(q: torch.Tensor, latent: torch.Tensor, flat: torch.Tensor, prefills: list[PrefillChunk],
                out: torch.Tensor, scale: float, expand: Expand) -> None:
    """Prefill chunks by decompression. q [T, H, Dqk] (q_nope ++ q_pe), latent [T, W] the step's own vectors
    (already written to the cache `flat`); each chunk's output rows go into out [T, H, Dv]."""
    for p in prefills:
        rows = slice(p.q_start, p.q_start + p.q_len)
        keys = latent[rows] if p.gather_idx is None else gather(flat, p.gather_idx, q.dtype)  # [S, W]
        ks, vs = expand(keys)
        chunk_attention(p, q[rows], ks, vs, out, scale)
