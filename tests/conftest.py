"""Shared fixtures: tiny random-weight checkpoints written by `transformers`, loaded through our real loader.

They use the built-in model's tokenizer (SmolLM2, 49,152 tokens) so text paths are realistic; the weights
are random and tiny, so a golden run costs milliseconds per step.
"""
from __future__ import annotations

import os

import pytest
import torch

# NOTE: without CUDA, Triton kernels can only run through Triton's interpreter, which triton reads when it is
# first imported (its own library functions are decorated then): set here, before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
# Golden and equivalence tests run on each CPU attention backend: the reference and the C++ kernel one.
ATTENTION_BACKENDS = ("cpu_paged", "torch_ref")

# Server fixtures and OpenAI's schemas (tests/helpers/server.py).
pytest_plugins = ["helpers.server"]


def pytest_addoption(parser):
    parser.addoption("--fuzz-examples", type=int, default=15,
                     help="hypothesis examples per fuzzed endpoint (tests/test_fuzz.py); more finds more")


def _tiny_config(arch: str, tie: bool):
    import transformers as tf

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    if arch == "llama":
        return tf.LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 256})
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=None)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32)
    raise ValueError(arch)


def make_tiny_checkpoint(path: str, arch: str = "llama", tie: bool = False, seed: int = 0):
    """Write a random tiny checkpoint + the SmolLM2 tokenizer to `path`; returns the HF model (oracle)."""
    import transformers as tf

    from kvserve.models.gguf_loader import builtin_model_path, load_gguf_tokenizer

    torch.manual_seed(seed)
    cfg = _tiny_config(arch, tie)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random init is small; widen it so logits are far from ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    load_gguf_tokenizer(builtin_model_path()).save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(path, HF model) of a tiny Llama with untied embeddings."""
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    return path, make_tiny_checkpoint(path, "llama")


@pytest.fixture(scope="session")
def smollm2_path():
    from kvserve.models.gguf_loader import builtin_model_path

    return builtin_model_path()


def check_engine_invariants(engine) -> None:
    """Block accounting after a step: see Scheduler.check_invariants."""
    engine.scheduler.check_invariants()


def step_until_idle(engine, check_every_step: bool = True, after_step=None) -> dict:
    """Step the engine until idle, asserting block invariants after every step (and `after_step(engine)`,
    if given); returns the final outputs by request id. No block may stay in use at the end."""
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if check_every_step:
            check_engine_invariants(engine)
        if after_step is not None:
            after_step(engine)
        steps += 1
        assert steps < 100_000
    counts = engine.block_pool.counts()
    assert counts["in_use"] == 0, f"blocks still in use after all requests finished: {counts}"
    return finished


def run_to_completion(engine, check_every_step: bool = True) -> dict:
    """step_until_idle, then the prefix cache emptied: every block must be free again."""
    finished = step_until_idle(engine, check_every_step)
    engine.scheduler.kv.reset_prefix_cache()
    assert engine.block_pool.counts()["free"] == engine.block_pool.num_blocks
    return finished


def run_last_after_prefix(engine, prompts: list, params) -> dict:
    """All prompts but the last to completion, then the last (whose prefix the others left in the prefix
    cache, so it is a cache hit), then the cache emptied; invariants after every step. Outputs by index."""
    for i, prompt in enumerate(prompts[:-1]):
        engine.add_request(str(i), prompt, params)
    done = step_until_idle(engine)
    engine.add_request(str(len(prompts) - 1), prompts[-1], params)
    done |= run_to_completion(engine)
    return done


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
