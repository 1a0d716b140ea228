"""Weight-only quantization in the engine: an int8/int4 engine run gives the greedy tokens of the same engine
on a checkpoint holding the dequantized weights, block invariants checked after every step; the int8 head of a
tied model; LoRA over an int8 base matches peft on the dequantized base; the built-in SmolLM2 with its Q4_1
blocks kept agrees with the dequantized default; bad combinations fail at start-up with a ValueError naming the
problem. (The formats' numbers: tests/unit/test_quantization_kernels.py.)"""
from __future__ import annotations

import copy
import random

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.layers.quant import kernels
from kvserve.layers.quant.int4 import Int4WeightOnlyMethod
from kvserve.layers.quant.int8 import Int8WeightOnlyMethod
from kvserve.sampling_params import SamplingParams
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.engine import run_to_completion
from tests.helpers.quant import dequantized_copy


# ---- the engine ------------------------------------------------------------------------------------------
def _prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(4, 40))] for _ in range(n)]


def _greedy(path: str, prompts, max_tokens: int = 12, **kwargs) -> list[list[int]]:
    args = {"model": path, "num_gpu_blocks_override": 64, "block_size": 8, "max_num_batched_tokens": 32}
    args.update(kwargs)
    engine = Engine(EngineArgs(**args))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    finished = run_to_completion(engine)  # block invariants after every step
    return [finished[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def _save(model, src_path: str, dst_path: str) -> str:
    from transformers import AutoTokenizer

    model.save_pretrained(dst_path)
    AutoTokenizer.from_pretrained(src_path).save_pretrained(dst_path)
    return dst_path


@pytest.mark.parametrize("quantization,factory,extra", [
    ("int8", lambda: Int8WeightOnlyMethod(32), {}),
    ("int8", Int8WeightOnlyMethod, {"quantization_group_size": -1, "quantize_lm_head": False}),
    ("int4", lambda: Int4WeightOnlyMethod(32), {"quantization_group_size": 32}),
    # all four prompts in one step of >= 48 rows: the tiles (the tiny layers' outputs are whole tiles of 64)
    ("int8", lambda: Int8WeightOnlyMethod(32), {"max_num_batched_tokens": 256}),
    ("int4", lambda: Int4WeightOnlyMethod(32), {"quantization_group_size": 32, "max_num_batched_tokens": 256}),
])
def test_quantized_engine_equals_the_dequantized_checkpoint(tiny_llama, tmp_path, quantization, factory, extra):
    path, hf_model = tiny_llama
    prompts = _prompts()
    quantized = _greedy(path, prompts, quantization=quantization, **extra)
    head = extra.get("quantize_lm_head", True)
    ref_path = _save(dequantized_copy(hf_model, factory, head), path, str(tmp_path / "dequantized"))
    assert quantized == _greedy(ref_path, prompts)


def test_quantized_engine_fits_its_step_cost_with_the_kernels_knee(tmp_path):
    """Under --quantization the scheduler's step-cost model gets the kernels' knee (scheduler/step_cost.py:
    a row costs more up to kernels.small_rows()); an unquantized model's has none."""
    path = str(tmp_path / "tiny")
    make_tiny_checkpoint(path, "llama", seed=9)
    for quantization, knee in ((None, 0), ("int8", kernels.small_rows())):
        engine = Engine(EngineArgs(model=path, quantization=quantization, num_gpu_blocks_override=8))
        cost = engine.core.scheduler.step_cost
        assert cost.knee_rows == knee and len(cost.coefficients) == (6 if knee else 5)
        del engine


def test_int8_head_of_a_tied_model_keeps_the_embedding_full_precision(tmp_path):
    path = str(tmp_path / "tied")
    hf_model = make_tiny_checkpoint(path, "llama", tie=True, seed=8)
    engine = Engine(EngineArgs(model=path, quantization="int8", num_gpu_blocks_override=8))
    model = engine.core.executor.worker.model
    assert model.lm_head.qweight.dtype == torch.int8 and model.lm_head.weight.numel() == 0
    torch.testing.assert_close(model.embed_tokens.weight, hf_model.model.embed_tokens.weight, rtol=0, atol=0)
    del engine
    prompts = _prompts(3, seed=2)
    ref_path = _save(dequantized_copy(hf_model, lambda: Int8WeightOnlyMethod(32)), path, str(tmp_path / "ref"))
    assert _greedy(path, prompts, quantization="int8") == _greedy(ref_path, prompts)


def test_lora_over_an_int8_base_matches_peft_on_the_dequantized_base(tmp_path):
    peft = pytest.importorskip("peft")
    from kvserve import LoRARequest

    base_path = str(tmp_path / "base")
    base = make_tiny_checkpoint(base_path, "llama", seed=5)
    dequantized = dequantized_copy(base, lambda: Int8WeightOnlyMethod(32))
    torch.manual_seed(6)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                          init_lora_weights=False)
    adapted = peft.get_peft_model(copy.deepcopy(dequantized), cfg).eval()  # peft adapts in place
    adapted.save_pretrained(str(tmp_path / "adapter"))
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    prompts = _prompts(3, seed=1)
    engine = Engine(EngineArgs(model=base_path, quantization="int8", enable_lora=True, num_gpu_blocks_override=64,
                               block_size=8, max_num_batched_tokens=32))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"l{i}", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           lora_request=lora)
        engine.add_request(f"b{i}", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finished = run_to_completion(engine)
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            for key, model in ((f"l{i}", adapted), (f"b{i}", dequantized)):
                out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                                     do_sample=False, pad_token_id=0)
                assert finished[key].outputs[0].token_ids == out[0, len(prompt):].tolist(), key


# ---- bad combinations ----------------------------------------------------------------------------------
def test_int4_group_that_does_not_divide_a_layer_names_it(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match=r"group size 128 does not divide the input size 64 of layer "
                                         r"layers\.0\.self_attn\.qkv_proj"):
        Engine(EngineArgs(model=path, quantization="int4", num_gpu_blocks_override=8))


def test_int8_group_that_does_not_divide_a_layer_names_it(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match=r"--quantization int8: group size 128 does not divide the input size 64 "
                                         r"of layer layers\.0\.self_attn\.qkv_proj.*or -1"):
        Engine(EngineArgs(model=path, quantization="int8", quantization_group_size=128, num_gpu_blocks_override=8))


def test_bad_quantization_flags_are_value_errors(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="unknown quantization 'fp3'"):
        EngineArgs(model=path, quantization="fp3")
    with pytest.raises(ValueError, match="quantization_group_size must be one of"):
        EngineArgs(model=path, quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match="quantization_group_size must be one of"):
        EngineArgs(model=path, quantization="int8", quantization_group_size=16)
    with pytest.raises(ValueError, match=r"-1 \(one scale per output channel\) is for int8 only"):
        EngineArgs(model=path, quantization="int4", quantization_group_size=-1)
    with pytest.raises(ValueError, match="int8 group size must be one of"):
        Int8WeightOnlyMethod(48)
    with pytest.raises(ValueError, match="--quantization gguf keeps a GGUF file's quantized blocks"):
        EngineArgs(model=path, quantization="gguf").create_engine_config()
    with pytest.raises(ValueError, match="int4 group size must be one of"):
        Int4WeightOnlyMethod(16)
