"""--dtype bfloat16 on the CPU: the paged decode kernel on a bf16 cache against a dense reference, the fused
layer ops in bf16 against float32 math rounded once, logits against transformers (ours no further from the
float32 model than transformers' own bf16 is) in a mixed batch of fresh prefills, chunks over cached context
and decodes, the engine through chunked prefill, a prefix hit and preemption with invariants after every
step, and what happens on a CPU without native bf16 (monkeypatched capability check)."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.attention.cpu_kernels import load_paged_attention
from kvserve.attention.cpu_paged import CPUPagedBackend
from kvserve.attention.torch_ref import TorchRefBackend
from kvserve.config import EngineArgs
from kvserve.config.model import resolve_dtype
from kvserve.engine.engine import Engine
from kvserve.layers.linear_methods import DenseMethod, OneDNNPackedMethod, default_method
from kvserve.models.layer_ops import LayerOps, load_fused_layer_ops
from kvserve.sampling_params import SamplingParams
from kvserve.utils import cpu_features
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.engine import ATTENTION_BACKENDS, run_last_after_prefix
from tests.helpers.paged_cache import scatter_sequences
from tests.helpers.oracles import dense_decode, hf_logits, mixed_batch, paged_logits

CPU = torch.device("cpu")
needs_bf16 = pytest.mark.skipif(not cpu_features.native_bf16(), reason="this CPU has no AVX512_BF16 / AMX")


def _kernel_or_skip():
    kernel = load_paged_attention()
    if kernel is None:
        pytest.skip("no C++ toolchain to build the paged decode kernel")
    return kernel


# --------------------------------------------------------------------------- the decode kernel


def test_kernel_reads_every_bf16_value_exactly():
    """A one-token context's output is its V row: every finite bf16 bit pattern comes back as its float."""
    kernel = _kernel_or_skip()
    codes = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    codes = codes[codes.float().isfinite()]
    d = 64
    rows = -(-codes.numel() // d)
    v = torch.zeros(rows * d, dtype=torch.bfloat16)
    v[:codes.numel()] = codes
    cache = torch.zeros(rows, 1, 2, 1, d, dtype=torch.bfloat16)    # one block of one slot per sequence
    cache[:, 0, 1, 0] = v.view(rows, d)
    out = kernel.paged_decode_attention(torch.randn(rows, 1, d), cache, torch.arange(rows)[:, None],
                                        torch.ones(rows, dtype=torch.int64), 0.125)
    torch.testing.assert_close(out[:, 0], v.float().view(rows, d), atol=0, rtol=0)


def _bf16_case(block_size, num_heads, num_kv_heads, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 40
    cache = torch.randn(num_blocks, block_size, 2, num_kv_heads, head_dim, generator=g).to(torch.bfloat16)
    flat = cache.view(-1, 2, num_kv_heads, head_dim).float()
    q, table, seq_lens, tables, ks, vs = scatter_sequences(flat, num_blocks, block_size, num_heads, head_dim, g)
    return q, cache, table, seq_lens, tables, ks, vs


@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_dim",
                         [(16, 9, 3, 64), (32, 8, 1, 64), (16, 4, 4, 128), (16, 9, 3, 80)])
def test_kernel_on_bf16_cache_matches_dense(block_size, num_heads, num_kv_heads, head_dim):
    kernel = _kernel_or_skip()
    q, cache, table, seq_lens, _, ks, vs = _bf16_case(block_size, num_heads, num_kv_heads, head_dim,
                                                      seed=block_size + head_dim)
    scale = head_dim ** -0.5
    out = kernel.paged_decode_attention(q, cache, table, torch.tensor(seq_lens), scale)
    torch.testing.assert_close(out, dense_decode(q, ks, vs, scale), atol=1e-5, rtol=1e-5)
    queries = [1, 1, 3, 2, 4]   # draft verification rows on a bf16 cache equal each row decoded alone
    q = torch.randn(sum(queries), num_heads, head_dim)
    starts = torch.tensor([0] + torch.tensor(queries).cumsum(0).tolist())
    grouped = kernel.paged_decode_attention(q, cache, table, torch.tensor(seq_lens), scale, starts)
    rows = torch.repeat_interleave(torch.arange(len(queries)), torch.tensor(queries))
    own = torch.tensor([n - (k - 1 - j) for n, k in zip(seq_lens, queries) for j in range(k)])
    alone = kernel.paged_decode_attention(q, cache, table[rows].contiguous(), own, scale)
    torch.testing.assert_close(grouped, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_kernel", [False, True])
def test_backend_decode_on_bf16_cache(use_kernel):
    """forward() with bf16 q/k/v writes the token's K/V into the bf16 cache and attends over it; both backends
    equal the dense float32 reference on the cache's values to bf16 output precision."""
    backend = CPUPagedBackend(_kernel_or_skip()) if use_kernel else TorchRefBackend()
    bs, hq, hkv, d = 16, 9, 3, 64
    q, cache, table, seq_lens, tables, _, _ = _bf16_case(bs, hq, hkv, d, seed=3)
    q = q.to(torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    k_new, v_new = (torch.randn(len(seq_lens), hkv, d, generator=g).to(torch.bfloat16) for _ in range(2))
    slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, seq_lens)])
    common = CommonAttentionMetadata(
        query_start_loc=torch.arange(len(seq_lens) + 1), seq_lens=torch.tensor(seq_lens), block_table=table,
        slot_mapping=slots, num_decodes=len(seq_lens), num_decode_tokens=len(seq_lens), block_size=bs,
        query_lens_cpu=[1] * len(seq_lens), seq_lens_cpu=seq_lens)
    out = backend.forward(q, k_new, v_new, cache, backend.build_metadata(common), d ** -0.5)
    assert out.dtype == torch.bfloat16
    flat = cache.view(-1, 2, hkv, d)
    assert torch.equal(flat[slots, 0], k_new) and torch.equal(flat[slots, 1], v_new)
    ks, vs = [], []
    for t, n in zip(tables, seq_lens):
        s = torch.tensor([t[p // bs] * bs + p % bs for p in range(n)])
        ks.append(flat[s, 0].float())
        vs.append(flat[s, 1].float())
    ref = dense_decode(q.float(), ks, vs, d ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)


# --------------------------------------------------------------------------- the fused layer ops


def _fused_or_skip():
    fused = load_fused_layer_ops()
    if fused is None:
        pytest.skip("the C++ extension does not build here")
    return fused


def _bf16_close(got, want_fp32):
    """Computed in float and rounded once: within one bf16 rounding of the float32 result."""
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want_fp32, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 300])
def test_fused_ops_in_bf16(rows):
    fused = _fused_or_skip()
    torch.manual_seed(rows)
    x, res, w = (torch.randn(rows, 96).bfloat16(), torch.randn(rows, 96).bfloat16(), torch.randn(96).bfloat16())
    got_x, got_res = fused.add_rms_norm(x.clone(), res.clone(), w, 1e-5)
    assert torch.equal(got_res, x + res)            # the residual stream stored in bf16, as transformers does
    want_x, _ = LayerOps.add_rms_norm(got_res.float(), None, w.float(), 1e-5)
    _bf16_close(got_x, want_x)

    heads, kv_heads, d = 4, 2, 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d).bfloat16()
    angles = torch.randn(rows, d // 2).repeat(1, 2)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    got = fused.rope_qk(qkv.clone(), cos, sin, heads + kv_heads, d)
    _bf16_close(got, LayerOps.rope_qk(qkv.float(), cos.float(), sin.float(), heads + kv_heads, d))

    gate_up = torch.randn(rows, 2 * 40 + 8).bfloat16()[:, :80]   # a row-strided view
    _bf16_close(fused.silu_and_mul(gate_up), LayerOps.silu_and_mul(gate_up.float()))


def test_fused_ops_refuse_mixed_dtypes():
    fused = _fused_or_skip()
    x = torch.randn(3, 8).bfloat16()
    with pytest.raises(RuntimeError, match="one dtype"):
        fused.add_rms_norm(x, x.clone(), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        fused.silu_and_mul(torch.randn(3, 8, dtype=torch.float64))


# --------------------------------------------------------------------------- the model vs transformers


@needs_bf16
@pytest.mark.parametrize("arch, backend", [("llama", b) for b in ATTENTION_BACKENDS] + [("qwen3", "cpu_paged")])
def test_bf16_logits_as_close_to_float32_as_transformers_bf16(tmp_path, tiny_llama, arch, backend):
    """Every row of a mixed batch (fresh prefills, chunks over cached context, decodes through the bf16 cache):
    our bf16 logits differ from transformers' float32 logits by no more than 1.5x what transformers' own bf16
    model does (measured ~0.8-1.3x), and from transformers' bf16 logits by a few bf16 steps (logits span
    about +-3.4, where a bf16 step is 1/64)."""
    path, hf = tiny_llama if arch == "llama" else (str(tmp_path), make_tiny_checkpoint(str(tmp_path), arch))
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    engine = Engine(EngineArgs(model=path, num_gpu_blocks_override=64, attention_backend=backend,
                               dtype="bfloat16"))
    runner = engine.core.executor.worker.runner
    assert runner.kv_caches[0].dtype == torch.bfloat16
    assert runner.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    batch = mixed_batch(seed=5)
    ours_err = hf_err = 0.0
    for (tokens, ctx, q), got in zip(batch, paged_logits(engine, batch)):
        ref = hf_logits(hf, tokens[:ctx + q])[ctx:ctx + q]
        ref_bf16 = hf_logits(hf_bf16, tokens[:ctx + q])[ctx:ctx + q]
        ours_err = max(ours_err, (got - ref).abs().max().item())
        hf_err = max(hf_err, (ref_bf16 - ref).abs().max().item())
        torch.testing.assert_close(got, ref_bf16, atol=0.1, rtol=0)
    assert 0 < ours_err <= 1.5 * hf_err, (ours_err, hf_err)
    engine.scheduler.check_invariants()
    assert engine.block_pool.counts()["in_use"] == 0


def _prompts():
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 49152, (48,), generator=g).tolist()
    return [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 70, 130)] + \
        [shared + [7, 8, 9], shared + [10, 11]]   # the second of these hits the first's cached blocks


@needs_bf16
@pytest.mark.parametrize("blocks", [64, 12])
def test_engine_bf16_greedy_follows_transformers_bf16(tiny_llama, blocks):
    """Chunked prefill (32-token budget), a prefix-cache hit, and (12 blocks) preemption, invariants after
    every step. Each greedy token is transformers' bf16 argmax at that position, or within 0.05 of it (two
    bf16 implementations resolve near-ties differently)."""
    path, hf = tiny_llama
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    engine = Engine(EngineArgs(model=path, dtype="bfloat16", max_num_batched_tokens=32, speculative_config=None,
                               num_gpu_blocks_override=blocks))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = _prompts()
    done = run_last_after_prefix(engine, prompts, params)
    assert engine.scheduler.stats.num_prefix_hit_tokens >= 48
    assert (engine.scheduler.stats.num_preemptions > 0) == (blocks == 12)
    for i, prompt in enumerate(prompts):
        tokens = done[str(i)].outputs[0].token_ids
        assert len(tokens) == 16
        logits = hf_logits(hf_bf16, prompt + tokens)[len(prompt) - 1:-1]          # [16, vocab]
        chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (chosen >= logits.max(dim=1).values - 0.05).all(), f"request {i}"


# --------------------------------------------------------------------------- CPUs without native bf16


def test_bf16_without_native_support_warns_and_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(cpu_features, "native_bf16", lambda: False)
    with caplog.at_level(logging.WARNING, logger="kvserve.config.model"):
        assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert "without AVX512_BF16" in caplog.text and "--dtype float32" in caplog.text
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("auto", CPU, torch.bfloat16) == torch.float32  # no native bf16: fp32 is faster
    assert isinstance(default_method(CPU, torch.bfloat16), DenseMethod)   # oneDNN has no bf16 kernel there
    assert isinstance(default_method(CPU, torch.float32), (OneDNNPackedMethod, DenseMethod))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvserve.config.model"):
        assert resolve_dtype("float32", CPU) == torch.float32
    assert not caplog.text


def test_bf16_with_native_support_uses_onednn(monkeypatch, caplog):
    if not OneDNNPackedMethod.available():
        pytest.skip("torch built without oneDNN")
    monkeypatch.setattr(cpu_features, "native_bf16", lambda: True)
    with caplog.at_level(logging.WARNING, logger="kvserve.config.model"):
        assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert not caplog.text
    assert isinstance(default_method(CPU, torch.bfloat16), OneDNNPackedMethod)
    # auto follows the checkpoint: bf16/fp16 weights run in bf16 here, fp32 ones (and GGUF files) in fp32
    assert resolve_dtype("auto", CPU, torch.bfloat16) == torch.bfloat16
    assert resolve_dtype("auto", CPU, torch.float16) == torch.bfloat16
    assert resolve_dtype("auto", CPU, torch.float32) == torch.float32
    assert resolve_dtype("auto", CPU, None) == torch.float32


# --------------------------------------------------------------------------- bench quality --dtype


@needs_bf16
def test_bench_quality_compares_bf16_with_a_float32_reference(tiny_llama, tmp_path, capsys):
    import argparse
    import json

    from kvserve.bench.quality import add_arguments, run, settings

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join('{"id": "%d", "prompt_token_ids": %s, "max_tokens": 1}\n' % (i, list(range(5 + i, 40 + i)))
                            for i in range(2)))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", tiny_llama[0], "--workload", str(path), "--quantization", "",
                              "--dtype", "bfloat16", "--top-k", "8", "--chunk", "16",
                              "--num-gpu-blocks-override", "64", "--json"])
    assert settings(args) == [("reference", {}), ("--dtype bfloat16", {"dtype": "bfloat16"})]
    assert run(args) == 0
    out = capsys.readouterr().out
    rows = json.loads(out[out.index("[\n"):])  # after the table: the --json dump
    assert [r["setting"] for r in rows] == ["reference", "--dtype bfloat16"]
    assert rows[0]["top1_agreement"] == 1.0
    # bf16 is not the float32 reference (it would agree everywhere with KL 0), yet close to it
    assert rows[1]["mean_kl"] > 0 and rows[1]["top1_agreement"] > 0.8


def test_auto_dtype_follows_the_checkpoint(tiny_llama, tmp_path, monkeypatch):
    import json
    import shutil

    from kvserve.config.model import ModelConfig

    monkeypatch.setattr(cpu_features, "native_bf16", lambda: True)
    path, _ = tiny_llama
    assert ModelConfig.resolve(path, "auto", CPU, None, 20).dtype == torch.float32   # saved in fp32
    half = tmp_path / "bf16"
    shutil.copytree(path, half)
    cfg = json.loads((half / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (half / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.resolve(str(half), "auto", CPU, None, 20).dtype == torch.bfloat16
    assert ModelConfig.resolve(str(half), "float32", CPU, None, 20).dtype == torch.float32
    assert ModelConfig.resolve(None, "auto", CPU, None, 20).dtype == torch.float32   # the built-in GGUF
