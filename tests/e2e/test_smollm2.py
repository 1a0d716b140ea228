"""The built-in SmolLM2-135M (GGUF) against transformers loading the same file: logits of a mixed batch, greedy
tokens batched with preemptions vs transformers one request at a time, a peft adapter, the Q4_1 blocks kept
(--quantization gguf) vs the dequantized default, n-gram speculation vs none on the real model, and
the GGUF loader's tensors vs transformers'."""
from __future__ import annotations

import contextlib
import copy
import logging
import os

import pytest
import torch

from kvserve import LLM, LoRARequest
from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.sampling_params import SamplingParams
from tests.helpers.engine import check_tables_cover_only_computed, run_requests
from tests.helpers.gguf import hf_gguf_config, hf_gguf_tensors
from tests.helpers.golden import count_identical_else_near_tie, run_engine, smollm2_requests
from tests.helpers.oracles import assert_logits_match_hf


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    """transformers' SmolLM2 from the built-in GGUF, float32 (loaded once for the module)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path),
                                                dtype=torch.float32).eval()


@pytest.mark.slow
def test_smollm2_gguf_logits_match_transformers(hf_smollm2):
    hf = hf_smollm2
    engine = Engine(EngineArgs(num_gpu_blocks_override=64))
    tok = engine.tokenizer
    prompt = tok.encode("The paged KV cache stores keys and values in fixed-size blocks, so that")
    code = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    batch = [(prompt, 0, len(prompt)), (prompt + [tok.encode(" the")[0]] * 30, len(prompt) + 29, 1),
             (code, 0, len(code))]
    assert_logits_match_hf(engine, hf, batch, atol=2e-4, rtol=1e-4)


@pytest.mark.slow
def test_smollm2_golden_batched_vs_transformers_alone(hf_smollm2):
    """SmolLM2 fp32 (dequantized GGUF): identical, or at the first difference each side's token is in the
    other's top-5 (near-ties resolve differently under batched vs single matmuls)."""
    hf = hf_smollm2
    engine = Engine(EngineArgs(num_gpu_blocks_override=48, max_num_batched_tokens=256, max_num_seqs=16))
    reqs = smollm2_requests(engine.tokenizer)
    finished = run_engine(engine, reqs, logprobs=5)
    assert engine.scheduler.stats.num_preemptions > 0
    identical = count_identical_else_near_tie(hf, reqs, finished)
    assert identical >= len(reqs) - 3


@pytest.mark.slow
def test_smollm2_adapter_matches_peft(hf_smollm2, tmp_path):
    """The built-in SmolLM2 (GGUF, dequantized) with a peft adapter: kvserve's greedy tokens, in one batch with
    the base model, equal transformers + peft's (or differ only at a near-tie: within each other's top-5)."""
    peft = pytest.importorskip("peft")
    base = copy.deepcopy(hf_smollm2)  # peft adapts in place
    torch.manual_seed(5)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                          init_lora_weights=False)
    model = peft.get_peft_model(base, cfg).eval()
    with torch.no_grad():  # peft's random B is tiny; make the adapter change the output
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    path = str(tmp_path / "smol-lora")
    model.save_pretrained(path)
    llm = LLM(enable_lora=True, max_lora_rank=8, num_gpu_blocks_override=64)
    tok = llm.engine.tokenizer
    prompts = ["The capital of France is", "def fibonacci(n):"]
    ids = [tok.encode(p) for p in prompts]
    lora = LoRARequest("smol", 1, path)
    outs = llm.generate(ids * 2,
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5),
                        lora_request=[None, None, lora, lora])
    changed = 0
    for k, out in enumerate(outs):
        with torch.inference_mode(), (model.disable_adapter() if k < 2 else contextlib.nullcontext()):
            want = model.generate(input_ids=torch.tensor([ids[k % 2]]), max_new_tokens=12, min_new_tokens=12,
                                  do_sample=False, pad_token_id=0)[0, len(ids[k % 2]):].tolist()
        got = out.outputs[0].token_ids
        if got != want:
            j = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            assert want[j] in out.outputs[0].logprobs[j], f"prompt {k}: transformers' token not in our top-5 at {j}"
        if k >= 2:
            changed += got != outs[k - 2].outputs[0].token_ids
    assert changed >= 1, "the adapter changed nothing: the test would not see a wrong adapter"


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


def test_greedy_smollm2_with_ngram_equals_no_speculation(smollm2_path):
    """The real model on text that repeats itself (where lookup pays): same tokens, drafts accepted."""
    engine = Engine(EngineArgs(num_gpu_blocks_override=64, max_num_batched_tokens=128,
                               speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                   "prompt_lookup_min": 1, "prompt_lookup_max": 3, "adaptive": True}))
    tok = engine.tokenizer
    lines = "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 3}" for i in range(8))
    prompts = [tok.encode(f"Repeat this code exactly:\n{lines}\n\nCopy:\n"), tok.encode("The capital of France is")]
    reqs = [(p, 48) for p in prompts]
    greedy = lambda i, m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)  # noqa: E731
    spec = run_requests(engine, reqs, greedy, check_tables_cover_only_computed)
    assert engine.scheduler.stats.num_spec_accepted_tokens >= 10
    plain = run_requests(Engine(EngineArgs(num_gpu_blocks_override=64, max_num_batched_tokens=128)), reqs, greedy,
                         check_tables_cover_only_computed)
    for rid in plain:
        assert spec[rid].outputs[0].token_ids == plain[rid].outputs[0].token_ids


def test_builtin_state_dict_equals_transformers(smollm2_path):
    """kvserve's GGUF loader on the built-in file: the tensors transformers loads, exactly (loader details:
    tests/engine/test_gguf_loader.py)."""
    from transformers import LlamaForCausalLM

    from kvserve.model_loader.gguf_loader import iter_gguf_tensors, load_gguf_config

    builtin_tensors = dict(iter_gguf_tensors(smollm2_path))
    expected = hf_gguf_tensors(smollm2_path, hf_gguf_config(smollm2_path))
    assert set(builtin_tensors) == set(expected)
    assert "lm_head.weight" not in builtin_tensors  # tied: the file has no output.weight
    for name, tensor in builtin_tensors.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == expected[name].shape, name
        assert torch.equal(tensor, expected[name]), name
    # Together with the tied LM head these are exactly the HF model's parameters.
    with torch.device("meta"):
        model = LlamaForCausalLM(load_gguf_config(smollm2_path))
    assert set(model.state_dict()) == set(builtin_tensors) | {"lm_head.weight"}
