"""--dtype bfloat16 on the CPU: logits against transformers (ours no further from the float32 model than
transformers' own bf16 is) in a mixed batch of fresh prefills, chunks over cached context and decodes, the engine
through chunked prefill, a prefix hit and preemption with invariants after every step, and what happens on a CPU
without native bf16 (monkeypatched capability check): bf16 weights multiplied in float32 by the quantized-linear
kernel's AVX2 build, the logits again against transformers' bf16 model. (The kernels: tests/unit/test_bf16_kernels.py.)"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.config.model import resolve_dtype
from kvserve.engine.engine import Engine
from kvserve.layers.linear_methods import DenseMethod, OneDNNPackedMethod, default_method
from kvserve.layers.quant import kernels
from kvserve.layers.quant.bf16 import Bf16WidenMethod
from kvserve.sampling_params import SamplingParams
from kvserve.utils import cpu_features, cpu_isa
from tests.helpers.engine import ATTENTION_BACKENDS, run_last_after_prefix
from tests.helpers.oracles import hf_logits, mixed_batch, paged_logits
from tests.helpers.quant import quant_kernels_for

CPU = torch.device("cpu")
needs_bf16 = pytest.mark.skipif(not cpu_features.native_bf16(), reason="this CPU has no AVX512_BF16 / AMX")


# --------------------------------------------------------------------------- the model vs transformers


@needs_bf16
@pytest.mark.parametrize("arch, backend", [("llama", b) for b in ATTENTION_BACKENDS] + [("qwen3", "cpu_paged")])
def test_bf16_logits_as_close_to_float32_as_transformers_bf16(tiny_checkpoint, arch, backend):
    """Every row of a mixed batch (fresh prefills, chunks over cached context, decodes through the bf16 cache):
    our bf16 logits differ from transformers' float32 logits by no more than 1.5x what transformers' own bf16
    model does (measured ~0.8-1.3x), and from transformers' bf16 logits by a few bf16 steps (logits span
    about +-3.4, where a bf16 step is 1/64)."""
    path, hf = tiny_checkpoint(arch)
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


def test_bf16_without_native_support_warns_and_keeps_bf16_weights(monkeypatch, caplog):
    monkeypatch.setattr(cpu_features, "native_bf16", lambda: False)
    with caplog.at_level(logging.WARNING, logger="kvserve.config.model"):
        assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert "without AVX512_BF16" in caplog.text and "multiply them in float32" in caplog.text
    assert "--dtype float32" in caplog.text
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("auto", CPU, torch.bfloat16) == torch.float32  # no native bf16: fp32 is faster
    # oneDNN has no bf16 kernel there: bf16 weights, float32 products (ours)
    assert isinstance(default_method(CPU, torch.bfloat16), Bf16WidenMethod)
    assert isinstance(default_method(torch.device("meta"), torch.bfloat16), DenseMethod)
    assert isinstance(default_method(CPU, torch.float32), (OneDNNPackedMethod, DenseMethod))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvserve.config.model"):
        assert resolve_dtype("float32", CPU) == torch.float32
    assert not caplog.text


def test_bf16_model_without_native_bf16_follows_transformers_bf16(tiny_checkpoint, monkeypatch):
    """No native bf16 and the AVX2 kernels (the scalar ones on a CPU without AVX2): every linear layer and the LM
    head run Bf16WidenMethod on their bf16 weights, and a mixed batch's logits (fresh prefills, chunks, decodes)
    are within a few bf16 steps of transformers' bf16 model, as the native path's are."""
    monkeypatch.setattr(cpu_features, "native_bf16", lambda: False)
    isa = "avx2" if "avx2" in cpu_isa.supported_isas() else "scalar"
    module = quant_kernels_for(isa, monkeypatch)
    if module is None:
        pytest.skip("the quantized-linear C++ extension does not build here")
    calls = []
    monkeypatch.setattr(kernels, "_module", lambda: _Recording(module, calls))
    try:
        path, hf = tiny_checkpoint("llama")
        hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
        engine = Engine(EngineArgs(model=path, num_gpu_blocks_override=64, dtype="bfloat16"))
        model = engine.core.executor.worker.runner.model
        for layer in (model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.down_proj, model.lm_head):
            assert isinstance(layer.method, Bf16WidenMethod) and layer.weight.dtype == torch.bfloat16
        batch = mixed_batch(seed=5)
        for (tokens, ctx, q), got in zip(batch, paged_logits(engine, batch)):
            ref_bf16 = hf_logits(hf_bf16, tokens[:ctx + q])[ctx:ctx + q]
            torch.testing.assert_close(got, ref_bf16, atol=0.1, rtol=0)
        assert calls and module.isa() == isa
        engine.scheduler.check_invariants()
        assert engine.block_pool.counts()["in_use"] == 0
    finally:
        kernels.tiles_fit.cache_clear()


class _Recording:
    """The kernel module, counting its bf16_linear calls (the model's matmuls reach the C++ kernel)."""

    def __init__(self, module, calls: list):
        self._module, self._calls = module, calls

    def __getattr__(self, name: str):
        if name == "bf16_linear":
            self._calls.append(name)
        return getattr(self._module, name)


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
