"""Weight-only quantization (`--quantization int8 | int4 | gguf`, the int8 LM head): each format's quantize ->
dequantize round trip against its reference formula (GGUF blocks against the gguf package's own dequantization); every
quantized method's apply equals F.linear on its dequantized weight (1, 16 and 512 rows, with and without
the C++ kernels); an int8 engine run gives the greedy tokens of the same engine on a checkpoint holding the
dequantized weights, block invariants checked after every step; LoRA over an int8 base matches peft on the
dequantized base; the built-in SmolLM2 with its Q4_1 blocks kept agrees with the dequantized default; bad
combinations fail at start-up with a ValueError naming the problem."""
from __future__ import annotations

import copy
import logging
import random

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.engine import run_to_completion

from kvserve import LLM
from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.layers.linear import ReplicatedLinear
from kvserve.layers.linear_methods import OneDNNPackedMethod
from kvserve.layers.quant import kernels
from kvserve.layers.quant.gguf import GGUFMethod
from kvserve.layers.quant.gguf_blocks import GGUFWeight, q4_blocks, q8_0_blocks
from kvserve.layers.quant.int4 import Int4WeightOnlyMethod, quantize_int4
from kvserve.layers.quant.int8 import Int8WeightOnlyMethod, quantize_int8
from kvserve.sampling_params import SamplingParams

Q = gguf.GGMLQuantizationType
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(params=["kernel", "torch"])
def kernel_path(request, monkeypatch):
    """Run a test on the C++ kernels and on the PyTorch fallback (as where the extension does not build)."""
    if request.param == "torch":
        monkeypatch.setattr(kernels, "_module", lambda: None)
    elif not kernels.available():
        pytest.skip("the quantized-linear C++ extension does not build here")
    return request.param


# ---- round trips ---------------------------------------------------------------------------------------
def test_int8_round_trip_is_the_per_channel_symmetric_formula():
    torch.manual_seed(0)
    w = torch.randn(96, 160) * torch.rand(96, 1)                              # rows of different ranges
    q, scales = quantize_int8(w)
    ref_scales = w.abs().amax(dim=1, keepdim=True) / 127
    torch.testing.assert_close(scales, ref_scales, rtol=0, atol=0)
    assert torch.equal(q, torch.round(w / ref_scales).clamp(-127, 127).to(torch.int8))
    deq = kernels.int8_dequantize(q, scales, w.shape[1])
    assert torch.equal(deq, q.float() * ref_scales)
    assert bool(((w - deq).abs() <= ref_scales / 2 + 1e-7).all())


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int8_group_round_trip_is_the_group_symmetric_formula(group, kernel_path):
    torch.manual_seed(7)
    w = torch.randn(48, 256) * torch.rand(48, 256 // group).repeat_interleave(group, 1)  # groups of different ranges
    q, scales = quantize_int8(w, group)
    g = w.reshape(48, -1, group)
    ref_scales = g.abs().amax(-1) / 127
    torch.testing.assert_close(scales, ref_scales, rtol=0, atol=0)
    ref_q = torch.round(g / ref_scales[..., None]).clamp(-127, 127).reshape(48, 256)
    assert torch.equal(q.float(), ref_q)
    step = ref_scales.repeat_interleave(group, 1)
    ref = ref_q * step
    assert bool(((w - ref).abs() <= step / 2 + 1e-7).all())
    layer = _linear(w, Int8WeightOnlyMethod(group))
    torch.testing.assert_close(layer.method.dequantized_weight(layer), ref, rtol=0, atol=0)
    # Q8_0 is this format at group 32: requantizing Q8_0's own dequantized values finds its codes again
    if group == 32:
        blocks = gguf.quants.quantize(w.numpy(), Q.Q8_0)
        exact = torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q8_0).reshape(48, 256))
        q8, s8 = q8_0_blocks(GGUFWeight(blocks, Q.Q8_0, (48, 256)))
        q2, s2 = quantize_int8(exact, 32)
        assert torch.equal(q2, q8)
        torch.testing.assert_close(s2, s8, rtol=2e-7, atol=0)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_is_the_group_min_scale_formula(group, kernel_path):
    torch.manual_seed(1)
    w = torch.randn(48, 256)
    q, scales, mins = quantize_int4(w, group)
    g = w.reshape(48, -1, group)
    lo, hi = g.amin(-1), g.amax(-1)
    torch.testing.assert_close(mins, lo, rtol=0, atol=0)
    torch.testing.assert_close(scales, (hi - lo) / 15, rtol=0, atol=0)
    ref_q = torch.round((g - lo[..., None]) / scales[..., None]).clamp(0, 15).reshape(48, 256)
    assert torch.equal(q.float(), ref_q)
    ref = ref_q * scales.repeat_interleave(group, 1) + lo.repeat_interleave(group, 1)
    assert bool(((w - ref).abs() <= scales.repeat_interleave(group, 1) / 2 + 1e-6).all())
    layer = _linear(w, Int4WeightOnlyMethod(group))
    torch.testing.assert_close(layer.method.dequantized_weight(layer), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("ggml_type", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_gguf_blocks_repack_to_gguf_dequantize(ggml_type, kernel_path):
    torch.manual_seed(2)
    w = torch.randn(40, 192)
    weight = GGUFWeight(gguf.quants.quantize(w.numpy(), ggml_type), ggml_type, (40, 192))
    ref = torch.from_numpy(gguf.quants.dequantize(weight.blocks, ggml_type).reshape(40, 192))
    if ggml_type == Q.Q8_0:
        q, scales = q8_0_blocks(weight)
        got = kernels.int8_dequantize(q, scales, 32)
    else:
        q, scales, mins = q4_blocks(weight)
        got = kernels.int4_dequantize(q, scales, mins, 32)
    # Q4_0: d * (q - 8) in gguf versus q * d + (-8 d) here, one float32 rounding apart
    torch.testing.assert_close(got, ref, rtol=0, atol=0 if ggml_type != Q.Q4_0 else 1e-6)
    # row and block-aligned column slices (fused parts, row-parallel shards) select the same weights
    torch.testing.assert_close(weight.narrow(0, 8, 16).dequantize(), ref[8:24], rtol=0, atol=0)
    torch.testing.assert_close(weight.narrow(1, 64, 96).dequantize(), ref[:, 64:160], rtol=0, atol=0)
    with pytest.raises(ValueError, match="32-column blocks"):
        weight.narrow(1, 16, 32)


def test_builtin_q4_1_tensor_repacks_exactly(smollm2_path):
    reader = gguf.GGUFReader(smollm2_path)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert tensor.tensor_type == Q.Q4_1
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    weight = GGUFWeight(np.array(tensor.data).reshape(shape[0], -1), Q.Q4_1, shape)
    q, scales, mins = q4_blocks(weight)
    ref = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape))
    torch.testing.assert_close(kernels.int4_dequantize(q, scales, mins, 32), ref, rtol=0, atol=0)


# ---- apply vs F.linear on the dequantized weight ---------------------------------------------------------
def _linear(w: torch.Tensor, method, bias: torch.Tensor | None = None, loaded=None) -> ReplicatedLinear:
    layer = ReplicatedLinear(w.shape[1], w.shape[0], bias is not None, method)
    layer.weight_loader("weight", w if loaded is None else loaded)
    if bias is not None:
        layer.weight_loader("bias", bias)
    layer.process_weights_after_loading()
    return layer


def _methods():
    yield "int8 per-channel", Int8WeightOnlyMethod(), None
    for group in (32, 128):
        yield f"int8 g{group}", Int8WeightOnlyMethod(group), None
    for group in (32, 64, 128):
        yield f"int4 g{group}", Int4WeightOnlyMethod(group), None
    for t in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        yield f"gguf {t.name}", GGUFMethod(OneDNNPackedMethod()), t


@pytest.mark.parametrize("name", [name for name, _, _ in _methods()])
# 13: a full and a partial 8-row pass; 25: the panels (160 outputs: two full panels of 64 and a partial one);
# 100: the panels with x in three blocks of input rows (48, 48, 4); 512: the dense path. With 192 outputs (three
# whole tiles of 64) the tiles take every size from kernels' tile_rows (48) on, 512 included.
@pytest.mark.parametrize("rows", [1, 2, 13, 16, 25, 48, 100, 512])
@pytest.mark.parametrize("n", [160, 192])
@pytest.mark.parametrize("fixed_point", [False, True])
def test_quantized_apply_equals_f_linear_on_dequantized_weight(name, rows, n, fixed_point, kernel_path,
                                                               monkeypatch):
    if fixed_point and rows > 2:
        pytest.skip("fixed point only changes one or two rows")
    monkeypatch.setenv("KVSERVE_QUANT_FIXED_POINT", "1" if fixed_point else "0")
    _, method, ggml_type = next(m for m in _methods() if m[0] == name)
    torch.manual_seed(3)
    k = 384
    w, bias = torch.randn(n, k) * 0.05, torch.randn(n)
    loaded = None if ggml_type is None else GGUFWeight(gguf.quants.quantize(w.numpy(), ggml_type), ggml_type, (n, k))
    layer = _linear(w, method, bias, loaded)
    assert layer.weight.numel() == 0, "the full-precision weight is freed"
    deq = method.dequantized_weight(layer)
    if loaded is not None:
        torch.testing.assert_close(deq, loaded.dequantize(), rtol=0, atol=1e-6)
    else:
        # within half a step: int4's step is at most 2 max|w| / 15, int8's max|w| / 127
        assert (deq - w).abs().max() <= w.abs().max() / (15 if name.startswith("int4") else 254) * 1.001
    x = torch.randn(rows, k)
    y = layer(x)
    # with fixed point on (the default), at one or two rows the C++ kernel multiplies a 16-bit fixed-point copy
    # of x (kernels.py)
    x_used = _fixed_point(x) if fixed_point and rows <= kernels.fixed_point_rows() else x
    torch.testing.assert_close(y, F.linear(x_used, deq, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x.reshape(rows, 1, k)).reshape(rows, n), y, rtol=1e-5, atol=1e-5)


def _fixed_point(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel's fixed-point rows are: each run of 32 columns to int16 steps of max|run| / 32767."""
    runs = x.double().reshape(x.shape[0], -1, 32)
    step = runs.abs().amax(dim=-1, keepdim=True) / 32767
    return (torch.round(runs / step.clamp_min(1e-300)) * step).reshape(x.shape).float()


@pytest.mark.parametrize("name", ["int8 g32", "int4 g32"])
@pytest.mark.parametrize("rows", [1, 13, kernels.BF16_DENSE_ROWS + 3])
def test_bfloat16_activations_run_the_quantized_matmul(name, rows, kernel_path):
    """--dtype bfloat16 with --quantization: decode-sized rows through the kernel in float32 (not the dense
    path's per-call dequantization), prefill-sized ones through a bfloat16 matmul; bfloat16 out either way."""
    _, method, _ = next(m for m in _methods() if m[0] == name)
    torch.manual_seed(6)
    w = torch.randn(64, 256) * 0.05
    layer = _linear(w, method, None)
    x = torch.randn(rows, 256).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(x.float(), method.dequantized_weight(layer)),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("k", [256, 224])  # 224: an odd number of runs of 32 (the kernel pairs them)
def test_fixed_point_rows_are_within_their_rounding_bound(k, kernel_path, monkeypatch):
    """KVSERVE_QUANT_FIXED_POINT=1's only departure from float32: each input run of 32 columns rounded to 2^-16
    of its largest |x| (an outlier column coarsens only its own run), so |y - x W^T| <= sum_k |w_k| step_k / 2."""
    if kernels.fixed_point_rows() == 0:
        pytest.skip("no fixed-point rows on this path")
    monkeypatch.setenv("KVSERVE_QUANT_FIXED_POINT", "1")
    torch.manual_seed(5)
    n = 96
    w = torch.randn(n, k) * 0.05
    layer = _linear(w, Int8WeightOnlyMethod(32), None)
    deq = layer.method.dequantized_weight(layer)
    for rows in range(1, kernels.fixed_point_rows() + 1):
        x = torch.randn(rows, k)
        x[:, 7] = 50.0                                             # an outlier in the first run only
        exact = F.linear(x.double(), deq.double())
        step = x.reshape(rows, -1, 32).abs().amax(-1).double() / 32767            # [rows, runs]
        bound = (deq.double().abs().reshape(n, -1, 32).sum(-1) @ step.T).T / 2     # [rows, n]
        err = (layer(x).double() - exact).abs()
        assert (err <= bound + 1e-5).all()
        assert err.max() > 0, "rounded: not the float32 kernel"
        assert err[:, :].max() < 1e-3


@pytest.mark.parametrize("name", ["int8 g32", "int4 g32", "gguf Q8_0"])
def test_dense_path_in_row_chunks_through_one_shared_scratch(name, kernel_path, monkeypatch):
    """Prefill-sized inputs on a layer bigger than DENSE_CHUNK (the LM head) run in chunks of output rows,
    the last one partial, through the method's one scratch buffer, which layers of other shapes reuse."""
    _, method, ggml_type = next(m for m in _methods() if m[0] == name)
    monkeypatch.setattr(kernels, "DENSE_CHUNK", 64 * 384)
    monkeypatch.setattr(kernels, "DENSE_CHUNK_ROWS", 48)
    torch.manual_seed(4)
    layers = []
    for n, k in ((160, 384), (40, 256), (224, 384)):  # chunked, whole (fits), chunked again
        w, bias = torch.randn(n, k) * 0.05, torch.randn(n)
        loaded = None if ggml_type is None else GGUFWeight(gguf.quants.quantize(w.numpy(), ggml_type), ggml_type,
                                                           (n, k))
        layers.append((_linear(w, method, bias, loaded), bias, k))
    for _ in range(2):
        for layer, bias, k in layers:
            x = torch.randn(kernels.DENSE_ROWS + 5, k)
            torch.testing.assert_close(layer(x), F.linear(x, method.dequantized_weight(layer), bias),
                                       rtol=1e-5, atol=1e-5)


def test_gguf_layer_with_mixed_parts_falls_back_to_dense():
    """A fused layer whose parts are Q8_0 and Q4_1 (or a dequantized type) runs dense on the exact values."""
    from kvserve.layers.linear import MergedColumnParallelLinear

    torch.manual_seed(4)
    gate, up = torch.randn(64, 96), torch.randn(64, 96)
    layer = MergedColumnParallelLinear(96, [64, 64], False, GGUFMethod(OneDNNPackedMethod()))
    parts = [GGUFWeight(gguf.quants.quantize(w.numpy(), t), t, (64, 96)) for w, t in ((gate, Q.Q8_0), (up, Q.Q4_1))]
    for shard_id, part in enumerate(parts):
        layer.weight_loader("weight", part, shard_id)
    layer.process_weights_after_loading()
    assert layer.quant_format == "dense"
    ref = torch.cat([p.dequantize() for p in parts])
    torch.testing.assert_close(layer.weight, ref, rtol=0, atol=0)
    x = torch.randn(3, 96)
    torch.testing.assert_close(layer(x), F.linear(x, ref), rtol=1e-5, atol=1e-5)


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


def _dequantized_copy(hf_model, method_factory, head: bool = True):
    """The HF model with every decoder linear weight replaced by the weight its quantized method computes with,
    and (head) the LM head by its int8 group-32 weight; a tied model comes back untied, the embedding as it was."""
    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LINEAR_NAMES:
                method = method_factory()
                layer = _linear(module.weight.detach().clone(), method)
                module.weight.copy_(method.dequantized_weight(layer))
        if head:
            method = Int8WeightOnlyMethod(32)
            layer = _linear(model.lm_head.weight.detach().clone(), method)
            model.config.tie_word_embeddings = False
            model.lm_head.weight = torch.nn.Parameter(method.dequantized_weight(layer))
    return model


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
    ref_path = _save(_dequantized_copy(hf_model, factory, head), path, str(tmp_path / "dequantized"))
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
    ref_path = _save(_dequantized_copy(hf_model, lambda: Int8WeightOnlyMethod(32)), path, str(tmp_path / "ref"))
    assert _greedy(path, prompts, quantization="int8") == _greedy(ref_path, prompts)


def test_lora_over_an_int8_base_matches_peft_on_the_dequantized_base(tmp_path):
    peft = pytest.importorskip("peft")
    from kvserve import LoRARequest

    base_path = str(tmp_path / "base")
    base = make_tiny_checkpoint(base_path, "llama", seed=5)
    dequantized = _dequantized_copy(base, lambda: Int8WeightOnlyMethod(32))
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


SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village",
                   "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
                   "The three primary colors are"]


def _top1(llm: LLM) -> list[list[int]]:
    """Teacher-forced top-1 next token at every prompt position (prompt_logprobs)."""
    outs = llm.generate(SMOLLM2_PROMPTS, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    return [[next(t for t, lp in entry.items() if lp.rank == 1) for entry in out.prompt_logprobs[1:]]
            for out in outs]


def test_smollm2_gguf_blocks_agree_with_the_dequantized_default(caplog):
    default = _top1(LLM(kv_cache_memory="64MiB"))
    with caplog.at_level(logging.INFO, logger="kvserve"):
        kept = _top1(LLM(quantization="gguf", kv_cache_memory="64MiB"))
    assert any("quantization: gguf" in r.getMessage() and "held" in r.getMessage() for r in caplog.records)
    pairs = [(a, b) for x, y in zip(default, kept) for a, b in zip(x, y)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    # The same Q4_1 numbers: only summation order differs, so a flip needs a near-tie.
    assert agreement >= 0.97, f"top-1 agreement {agreement:.3f} over {len(pairs)} positions"


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


def test_fixed_point_rows_are_the_default_and_zero_turns_them_off(monkeypatch):
    monkeypatch.delenv("KVSERVE_QUANT_FIXED_POINT", raising=False)
    assert Int8WeightOnlyMethod(32).fixed_point
    monkeypatch.setenv("KVSERVE_QUANT_FIXED_POINT", "0")
    assert not Int8WeightOnlyMethod(32).fixed_point


def test_tiles_take_prefill_sized_float32_rows_where_they_fit():
    """From tile_rows on, float32 rows of a layer with whole tiles of output rows stay in the C++ kernel (the
    tiles), any number of them; a layer without whole tiles goes dense from DENSE_ROWS, as bfloat16 rows do from
    BF16_DENSE_ROWS."""
    m = kernels._module()
    if m is None or m.tile_rows() == 0:
        pytest.skip("no tiled kernel here (needs the C++ extension with AVX-512)")
    assert kernels.tiles_fit(192, 384) and not kernels.tiles_fit(160, 384) and not kernels.tiles_fit(192, 376)
    big = torch.randn(2 * kernels.DENSE_ROWS, 384)
    assert kernels._kernel_takes(m, big, 192) and not kernels._kernel_takes(m, big, 160)
    assert not kernels._kernel_takes(m, big.bfloat16(), 192)
