"""Golden on the GPU: kvserve on CUDA (triton_paged attention, CUDA graphs for decodes) gives the greedy tokens
of `transformers.generate` run on each request alone on the same GPU, for a tiny random Llama (exactly, in
float32) and SmolLM2 (the built-in GGUF, dequantized: identical or a near-tie, as tests/e2e/test_smollm2.py
allows). Skipped without CUDA; scripts/gpu_check.sh runs them."""
from __future__ import annotations

import os
import random

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from tests.helpers.engine import check_engine_invariants
from tests.helpers.golden import count_identical_else_near_tie, run_engine, smollm2_requests
from tests.helpers.oracles import assert_matches_hf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

_VOCAB = 1024


def _tiny_llama(path: str):
    """A random Llama with head_dim 64 and GQA 2, plus a word-level tokenizer made on the spot (the GPU
    machine may have no built-in model to borrow one from)."""
    import transformers as tf
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # widen the small random init so logits are far from ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(_VOCAB)}
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                     eos_token="t2", bos_token="t1")
    tok.save_pretrained(path)
    return model.cuda()


@pytest.mark.parametrize("block_size", [16, 32])
def test_tiny_llama_golden_on_gpu(tmp_path, block_size):
    hf = _tiny_llama(str(tmp_path))
    rng = random.Random(block_size)
    reqs = [([rng.randrange(3, _VOCAB) for _ in range(n)], rng.randint(8, 40))
            for n in [1, 2, 15, 16, 17, 33, 300] + [rng.randint(1, 400) for _ in range(9)]]
    # a pool far below the demand: chunked prefill (128-token budget) and preemption, as on CPU
    engine = Engine(EngineArgs(model=str(tmp_path), device="cuda", dtype="float32", block_size=block_size,
                               num_gpu_blocks_override=1200 // block_size, max_num_batched_tokens=128,
                               max_num_seqs=16, speculative_config=None))
    runner = engine.core.executor.worker.runner
    assert engine.core.executor.worker.backend.name == "triton_paged"
    assert_matches_hf(None, reqs, hf, engine=engine)
    check_engine_invariants(engine)
    assert engine.scheduler.stats.num_preemptions > 0
    assert runner.cuda_graphs is not None and runner.cuda_graphs.num_replays > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_golden_on_gpu(dtype):
    try:
        from kvserve.model_loader.gguf_loader import builtin_model_path
        path = builtin_model_path()
        import gguf  # noqa: F401  (transformers' GGUF loader needs it too)
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"no built-in SmolLM2 here: {e}")
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch_dtype).eval().cuda()
    engine = Engine(EngineArgs(device="cuda", dtype=dtype, max_num_batched_tokens=256, max_num_seqs=16,
                               num_gpu_blocks_override=512))
    reqs = smollm2_requests(engine.tokenizer)
    finished = run_engine(engine, reqs, logprobs=5)
    identical = count_identical_else_near_tie(hf, reqs, finished)
    # bf16 rounds differently in every matmul order: near-ties flip more often than in fp32
    assert identical >= (len(reqs) * 3) // 4 if dtype == "float32" else identical >= len(reqs) // 2
