"""The fused (C++) expert path and int8 experts in the engine, on a tiny Qwen3-MoE checkpoint (8 experts, 2 per
token, a dense layer between sparse ones): under --quantization int8 every expert path gives the greedy tokens of
the unquantized engine on a checkpoint holding the dequantized weights (experts, dense linears, LM head), block
invariants after every step; the experts are held as int8 codes and their float weights freed. (The fused path
in float32 against transformers: tests/engine/test_new_architectures.py, impl "fused".)"""
from __future__ import annotations

import random

import pytest

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.layers import moe_fused
from kvserve.layers.quant import weight_bytes
from kvserve.layers.quant.int8 import Int8WeightOnlyMethod
from kvserve.sampling_params import SamplingParams
from tests.helpers.architectures import make_checkpoint
from tests.helpers.engine import run_to_completion
from tests.helpers.quant import dequantized_copy


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_moe"))
    return path, make_checkpoint(path, "qwen3_moe", seed=5)


def _engine(path: str, **kwargs) -> Engine:
    args = {"model": path, "num_gpu_blocks_override": 64, "block_size": 8, "max_num_batched_tokens": 32}
    return Engine(EngineArgs(**{**args, **kwargs}))


def _greedy(engine: Engine, n: int = 4) -> list[list[int]]:
    rng = random.Random(0)
    for i in range(n):  # mixed prompt lengths in 32-token steps: prefill chunks beside decodes
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randint(4, 40))]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    finished = run_to_completion(engine)  # block invariants after every step
    return [finished[str(i)].outputs[0].token_ids for i in range(n)]


def _experts(engine: Engine):
    return [layer.mlp.experts for layer in engine.core.executor.worker.runner.model.layers
            if hasattr(layer.mlp, "experts")]


@pytest.mark.parametrize("group", [32, -1])
def test_int8_experts_equal_the_dequantized_checkpoint(qwen3_moe, tmp_path, group, monkeypatch):
    path, hf_model = qwen3_moe
    extra = {"quantization_group_size": group} if group != 32 else {}
    ref = dequantized_copy(hf_model, lambda: Int8WeightOnlyMethod(group), expert_group=group)
    ref_path = str(tmp_path / "dequantized")
    ref.save_pretrained(ref_path)
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(path).save_pretrained(ref_path)
    want = _greedy(_engine(ref_path))
    calls = []
    fused = moe_fused.experts_fused
    monkeypatch.setattr(moe_fused, "experts_fused", lambda *a, **k: calls.append(1) or fused(*a, **k))
    for impl in ("fused", "sorted", "reference"):
        monkeypatch.setenv("KVSERVE_MOE_IMPL", impl)
        engine = _engine(path, quantization="int8", **extra)
        experts = _experts(engine)
        assert len(experts) == 2 and all(e.int8 is not None and e.w13.numel() == 0 and e.impl == impl
                                         for e in experts)
        calls.clear()
        assert _greedy(engine) == want, impl
        assert bool(calls) == (impl == "fused" and moe_fused.available())  # the C++ kernel ran, or did not
        float_bytes = sum(e.int8[0].q.numel() + e.int8[1].q.numel() for e in experts) * 4
        assert sum(weight_bytes(e) for e in experts) < float_bytes / 3  # codes and scales only
