"""The quantized KV cache (--kv-cache-dtype int8 | fp8_e4m3) in the engine: logits against transformers within a
stated tolerance, the engine against its float32-cache self (greedy agreement reported, block invariants after
every step through chunked prefill, prefix hits and preemption), pool capacity, clear errors for bad values, and
the cache dtype in the start-up log, engine info, Prometheus and kv-calc. (The numbers and the kernels:
tests/unit/test_kv_quant_kernels.py.)"""
from __future__ import annotations

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.kv_cache.layout import KVCacheSpec
from kvserve.kv_cache.quant import resolve_kv_cache_dtype
from kvserve.sampling_params import SamplingParams
from tests.helpers.engine import run_last_after_prefix
from tests.helpers.oracles import assert_logits_match_hf, mixed_batch

QUANT_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


# --------------------------------------------------------------------------- the engine

# Logits of the tiny random model (fp32 weights) with a quantized cache vs transformers in fp32, on a mixed
# batch whose chunks and decodes read cached context: the largest absolute difference allowed, about twice
# the largest seen over two such batches. The logits span about +-3.4; the fp32 cache matches to 1e-4
# (test_model_equivalence.py).
LOGIT_ATOL = {"int8": 0.05, "fp8_e4m3": 0.2}


@pytest.mark.parametrize("kv_cache_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
def test_quantized_cache_logits_close_to_transformers(tiny_llama, kv_cache_dtype, backend):
    path, hf = tiny_llama
    engine = Engine(EngineArgs(model=path, num_gpu_blocks_override=64, attention_backend=backend,
                               kv_cache_dtype=kv_cache_dtype))
    assert_logits_match_hf(engine, hf, mixed_batch(seed=11), atol=LOGIT_ATOL[kv_cache_dtype], rtol=0)


def _prompts():
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 49152, (48,), generator=g).tolist()
    return [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 70, 130)] + \
        [shared + [7, 8, 9], shared + [10, 11]]   # the second of these hits the first's cached blocks


def _greedy_run(path, kv_cache_dtype, **kwargs):
    engine = Engine(EngineArgs(model=path, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=32,
                               speculative_config=None, **kwargs))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    prompts = _prompts()
    done = run_last_after_prefix(engine, prompts, params)
    return engine, [done[str(i)].outputs[0] for i in range(len(prompts))]


@pytest.mark.parametrize("kv_cache_dtype", QUANT_DTYPES)
def test_engine_quantized_cache_vs_float32_cache(tiny_llama, kv_cache_dtype):
    """Chunked prefill (32-token budget), a prefix-cache hit, and (second pair) preemption in a tiny pool;
    invariants after every step. First-token logprobs agree within the tolerance above; greedy tokens
    agree until a near-tie flips one (a random tiny model has many), reported, not required."""
    path, _ = tiny_llama
    results = {}
    for blocks in (64, 12):
        ref_engine, ref = _greedy_run(path, "auto", num_gpu_blocks_override=blocks)
        engine, got = _greedy_run(path, kv_cache_dtype, num_gpu_blocks_override=blocks)
        assert engine.scheduler.stats.num_prefix_hit_tokens >= 48
        assert (engine.scheduler.stats.num_preemptions > 0) == (blocks == 12)
        for a, b in zip(ref, got):
            lp_a, lp_b = a.logprobs[0][a.token_ids[0]], b.logprobs[0].get(a.token_ids[0])
            if lp_b is not None:
                assert abs(lp_a.logprob - lp_b.logprob) < LOGIT_ATOL[kv_cache_dtype] * 2
        same = sum(x == y for a, b in zip(ref, got) for x, y in zip(a.token_ids, b.token_ids))
        results[blocks] = same / sum(len(a.token_ids) for a in ref)
    print(f"greedy token agreement with the float32 cache ({kv_cache_dtype}): {results}")


# --------------------------------------------------------------------------- capacity


def test_pool_holds_about_four_times_the_tokens_of_float32(tiny_llama):
    path, _ = tiny_llama
    blocks = {}
    for dtype in ("auto", "int8", "fp8_e4m3"):
        engine = Engine(EngineArgs(model=path, kv_cache_dtype=dtype, kv_cache_memory="4MiB",
                                   speculative_config=None))
        spec = engine.core.kv_spec
        runner = engine.core.executor.worker.runner
        assert runner.kv_pool.num_bytes == spec.num_bytes <= 4 * 2**20   # scales counted, within budget
        blocks[dtype] = engine.block_pool.num_blocks
    # tiny model: 2 layers, 2 KV heads, head_dim 16, blocks of 16: per block, layer, head and K/V 16 x 16 x 4
    # bytes vs 16 x 16 + 2 (one bf16 scale per block)
    assert blocks["auto"] == 4 * 2**20 // (2 * 2 * 2 * 16 * 16 * 4)
    assert blocks["int8"] == blocks["fp8_e4m3"] == 4 * 2**20 // (2 * 2 * 2 * (16 * 16 + 2))
    assert runner.kv_pool.scales.dtype == torch.bfloat16
    assert runner.kv_pool.scales.shape == (2, blocks["int8"], 2, 2)          # [layers, blocks, K/V, heads]
    # SmolLM2-135M's shape (30 layers, 3 KV heads, head_dim 64): 2 scale bytes per 16 x 64 code bytes
    fp32 = KVCacheSpec(30, 1, 16, 3, 64, torch.float32)
    int8 = KVCacheSpec(30, 1, 16, 3, 64, torch.int8, torch.bfloat16)
    assert int8.bytes_per_block == 2 * 30 * 3 * (16 * 64 + 2) and int8.bytes_per_token == 11_542.5
    assert fp32.bytes_per_token == 46_080
    assert round(fp32.bytes_per_token / int8.bytes_per_token, 2) == 3.99


# --------------------------------------------------------------------------- bad values


def test_bad_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8, fp8_e4m3, got 'int4'"):
        EngineArgs(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype("fp8_e5m2", torch.float32)
    assert resolve_kv_cache_dtype("fp8", torch.float32) == torch.float8_e4m3fn  # vLLM's alias
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="needs scale_dtype"):
        KVCacheSpec(2, 4, 16, 2, 64, torch.int8)
    with pytest.raises(ValueError, match="takes no scale_dtype"):
        KVCacheSpec(2, 4, 16, 2, 64, torch.float32, torch.float32)


# --------------------------------------------------------------------------- reporting


def test_start_up_log_and_engine_info_name_the_cache_dtype(tiny_llama, caplog):
    path, _ = tiny_llama
    with caplog.at_level("INFO", logger="kvserve"):
        engine = Engine(EngineArgs(model=path, kv_cache_dtype="int8", kv_cache_memory="1MiB",
                                   speculative_config=None))
    assert engine.core.info.kv_cache_dtype == "int8"
    tokens = engine.core.kv_spec.num_tokens
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache ("))
    assert line.startswith(f"KV cache (int8): {tokens // 16} blocks x 16 tokens = {tokens} tokens")
    assert "(16 head_dim x 1 B + 2 B scale per block of 16; 3.97x the tokens of a float32 cache)" in line


def test_prometheus_shows_the_cache_dtype():
    from kvserve.server.metrics import ServerMetrics

    text = ServerMetrics("m", "fp8_e4m3").render().decode()
    assert 'kvserve:cache_config_info{cache_dtype="fp8_e4m3",model_name="m"} 1.0' in text


def test_kv_calc_counts_scales_and_shows_the_gain(capsys):
    import argparse
    import json

    from kvserve.cli import kv_calc
    from kvserve.kv_cache.quant import SCALE_DTYPE

    assert kv_calc.KV_SCALE_BYTES == torch.empty((), dtype=SCALE_DTYPE).element_size()
    parser = argparse.ArgumentParser()
    kv_calc.add_arguments(parser)
    shape = ["--num-layers", "30", "--num-kv-heads", "3", "--head-dim", "64", "--context", "8192",
             "--kv-dtype", "float32", "--memory", "2GiB"]
    for dtype in ("int8", "fp8_e4m3"):
        assert kv_calc.run(parser.parse_args([*shape, "--kv-cache-dtype", dtype, "--json"])) == 0
        report = json.loads(capsys.readouterr().out)
        # one 2-byte scale per block of 16 tokens: 2 x 30 x 3 x (64 + 2 / 16) bytes per token
        assert report["kv_dtype"] == dtype and report["kv_bytes_per_token"] == 11_542.5
        assert report["unquantized_kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
        assert report["max_tokens_in_memory"] == int(2 * 2**30 // 11_542.5)
        assert round(report["capacity_gain"], 2) == 3.99
    report = kv_calc._compute(parser.parse_args([*shape, "--kv-cache-dtype", "int8", "--block-size", "32"]))
    assert report["kv_bytes_per_token"] == 2 * 30 * 3 * (64 + 2 / 32)
    assert kv_calc.run(parser.parse_args([*shape, "--kv-cache-dtype", "int8"])) == 0
    out = capsys.readouterr().out
    assert "int8 (1 bytes) + a 2-byte scale per block of 16 tokens and KV head" in out
    assert "3.99x the tokens of a float32 cache" in out
    assert kv_calc.run(parser.parse_args([*shape, "--kv-cache-dtype", "int8", "--block-size", "0"])) == 2
    assert "--block-size must be a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args([*shape, "--kv-cache-dtype", "int4"])
