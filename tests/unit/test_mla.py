"""attention/mla.py and the MLA layer alone: the absorbed decode (W_UK folded into the query, W_UV into the
output, multi-query attention over the cached latents) equals decompressed multi-head attention over the same
cache; decodes and prefill chunks of one step through the paged latent cache; the latent KVCacheSpec."""
from __future__ import annotations

import pytest
import torch

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.attention.mla import MLABackend, mla_decode, write_latent
from kvserve.kv_cache.layout import KVCacheSpec
from kvserve.layers.linear_methods import DenseMethod
from kvserve.layers.parallel import ShardContext
from kvserve.models.deepseek import MLAttention, apply_rope
from tests.helpers.architectures import tiny_config
from tests.helpers.oracles import dense_decode

BS = 4


def _layer(arch: str, seed: int) -> MLAttention:
    layer = MLAttention(tiny_config(arch), DenseMethod(), ShardContext())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 1.0))
    return layer


def _metadata(query_lens: list[int], seq_lens: list[int], num_blocks: int = 64) -> CommonAttentionMetadata:
    """Requests given by query and sequence lengths (decodes first), blocks handed out in a shuffled order."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7))
    tables, start = [], 0
    width = max(-(-s // BS) for s in seq_lens)
    for s in seq_lens:
        n = -(-s // BS)
        tables.append(torch.cat((perm[start:start + n], torch.zeros(width - n, dtype=torch.long))))
        start += n
    table = torch.stack(tables)
    slots = torch.cat([table[i, torch.arange(s - q, s) // BS] * BS + torch.arange(s - q, s) % BS
                       for i, (q, s) in enumerate(zip(query_lens, seq_lens))])
    nd = sum(1 for q in query_lens if q == 1)
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]),
        seq_lens=torch.tensor(seq_lens), block_table=table, slot_mapping=slots, num_decodes=nd,
        num_decode_tokens=nd, block_size=BS, query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_absorbed_decode_equals_decompressed_attention(arch):
    layer = _layer(arch, seed=0)
    seq_lens = [1, 5, 17, 33]
    common = _metadata([1] * len(seq_lens), seq_lens)
    meta = MLABackend().build_metadata(common)
    g = torch.Generator().manual_seed(1)
    cache = torch.zeros(64, BS, layer.latent_dim)
    flat = cache.view(-1, layer.latent_dim)
    latents = [torch.randn(s, layer.latent_dim, generator=g) for s in seq_lens]
    for i, lat in enumerate(latents):  # every position of every request, through its block table
        pos = torch.arange(seq_lens[i])
        write_latent(cache, common.block_table[i, pos // BS] * BS + pos % BS, lat)
    q_nope = torch.randn(len(seq_lens), layer.num_heads, layer.nope, generator=g)
    q_pe = torch.randn(len(seq_lens), layer.num_heads, layer.rope_dim, generator=g)
    w_uk, w_uv = layer._w_uk_uv()
    absorbed = mla_decode(torch.cat((torch.einsum("thn,hnl->thl", q_nope, w_uk), q_pe), dim=-1), flat, meta,
                          layer.scale, layer.kv_lora_rank)
    got = torch.einsum("thl,hvl->thv", absorbed, w_uv)
    expanded = [layer.expand(lat) for lat in latents]       # per-head K [L, H, nope + R], V [L, H, v]
    q = torch.cat((q_nope, q_pe), dim=-1)
    # NOTE: dense_decode takes one D for q, k and v: V zero-padded to the key width, cut after
    pad = q.shape[-1] - layer.v_dim
    want = dense_decode(q, [k for k, _ in expanded], [torch.nn.functional.pad(v, (0, pad)) for _, v in expanded],
                        layer.scale)[..., :layer.v_dim]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_decodes_and_prefill_chunks_in_one_step_equal_each_alone():
    """A mixed step (two decodes, a first chunk, a chunk over cached context) gives each request the output it
    gets as the only request of a step (absorbed and decompressed paths meet in one `out`)."""
    layer = _layer("deepseek_v3", seed=2)
    hidden = tiny_config("deepseek_v3").hidden_size
    query_lens, seq_lens = [1, 1, 9, 6], [12, 3, 9, 14]
    g = torch.Generator().manual_seed(3)
    x_all = [torch.randn(s, hidden, generator=g) for s in seq_lens]
    cos_sin = _rope(layer, max(seq_lens))

    def run(reqs: list[int]) -> list[torch.Tensor]:
        """Prefill the contexts of `reqs`, then their query tokens in one step; their outputs."""
        cache = torch.zeros(64, BS, layer.latent_dim)
        ctx = [seq_lens[i] - query_lens[i] for i in reqs]
        with_ctx = [(i, c) for i, c in zip(reqs, ctx) if c]
        if with_ctx:
            _step(layer, cache, [x_all[i][:c] for i, c in with_ctx], [c for _, c in with_ctx], [c for _, c in with_ctx],
                  cos_sin, [i for i, _ in with_ctx])
        out = _step(layer, cache, [x_all[i][c:] for i, c in zip(reqs, ctx)], [query_lens[i] for i in reqs],
                    [seq_lens[i] for i in reqs], cos_sin, reqs)
        return list(out.split([query_lens[i] for i in reqs]))

    together = run([0, 1, 2, 3])
    for i in range(4):
        torch.testing.assert_close(together[i], run([i])[0], atol=1e-5, rtol=1e-5)


def _rope(layer: MLAttention, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, layer.rope_dim, 2).float() / layer.rope_dim))
    freqs = torch.outer(torch.arange(n).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _step(layer, cache, xs, query_lens, seq_lens, cos_sin, req_ids):
    """One forward of `layer` over requests (request id r owns blocks [8r, 8r + 8), so runs agree on slots)."""
    width = 8
    table = torch.stack([torch.arange(8 * r, 8 * r + width) for r in req_ids])
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    rows = torch.cat([torch.full((q,), i) for i, q in enumerate(query_lens)])
    slots = table[rows, positions // BS] * BS + positions % BS
    nd = sum(1 for q in query_lens if q == 1)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]),
        seq_lens=torch.tensor(seq_lens), block_table=table, slot_mapping=slots, num_decodes=nd,
        num_decode_tokens=nd, block_size=BS, query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))
    cos, sin = (t[positions] for t in cos_sin)
    from kvserve.models.layer_ops import LayerOps
    with torch.no_grad():
        return layer.forward(torch.cat(xs), (cos, sin), cache, MLABackend().build_metadata(common), LayerOps())


def test_interleaved_rope_is_transformers_pairs_reordered():
    """Our interleaved RoPE = transformers V2's complex-pair rotation, its output de-interleaved (V3's layout)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 3, 8, generator=g)
    angles = torch.randn(5, 4, generator=g)
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)
    pairs = torch.view_as_complex(x.reshape(5, 3, 4, 2)) * torch.polar(torch.ones_like(angles), angles)[:, None]
    want = torch.view_as_real(pairs).reshape(5, 3, 8)
    got = apply_rope(x, cos, sin, interleaved=True)
    torch.testing.assert_close(got, torch.cat((want[..., 0::2], want[..., 1::2]), -1))


def test_latent_spec_sizes_one_vector_per_token():
    spec = KVCacheSpec(3, 10, 16, 1, 48, torch.bfloat16, latent=True)
    assert spec.bytes_per_token == 3 * 48 * 2 and spec.num_bytes == 10 * 16 * 3 * 48 * 2
    assert MLABackend().kv_cache_shape(10, 16, 1, 48) == (10, 16, 48)
    with pytest.raises(ValueError, match="one unquantized vector per token"):
        KVCacheSpec(3, 10, 16, 2, 48, torch.bfloat16, latent=True)
    with pytest.raises(ValueError, match="not quantized"):
        MLABackend().kv_cache_scale_shape(10, 16, 1)
