"""The greedy-vs-transformers oracle shared by the CPU and GPU golden tests (tests/engine/test_golden.py,
tests/e2e/test_gpu_golden.py): the engine run, the SmolLM2 request set and the
near-tie rule for a token that differs."""
from __future__ import annotations

import os
import random

import torch

from kvserve.sampling_params import SamplingParams
from tests.helpers.engine import run_to_completion
from tests.helpers.oracles import hf_greedy


def run_engine(engine, reqs, logprobs: int | None = None) -> dict:
    """(prompt, max_tokens) pairs run greedily to completion, invariants after every step; outputs by index."""
    for i, (prompt, max_tokens) in enumerate(reqs):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                          logprobs=logprobs))
    return run_to_completion(engine)


def smollm2_requests(tokenizer) -> list[tuple[list[int], int]]:
    """16 real-text prompts of 1 to 600 tokens (slices of torch's nn/functional.py), 4-16 output tokens each."""
    text = open(os.path.join(os.path.dirname(torch.__file__), "nn", "functional.py")).read()
    ids = tokenizer.encode(text[:40000])
    rng = random.Random(3)
    reqs = []
    for n in [1, 5, 40, 130, 600] + [rng.randint(2, 600) for _ in range(11)]:
        start = rng.randrange(0, len(ids) - n)
        reqs.append((ids[start:start + n], rng.randint(4, 16)))
    return reqs


def count_identical_else_near_tie(hf, reqs, finished: dict, top: int = 5) -> int:
    """How many requests' tokens equal transformers' greedy ones; at the first difference of any other, each
    side's token must be in the other's top-`top` (a near-tie resolved differently, not a wrong token)."""
    identical = 0
    for i, (prompt, max_tokens) in enumerate(reqs):
        out = finished[str(i)].outputs[0]
        want, want_top = hf_greedy(hf, prompt, max_tokens, top=top)
        if out.token_ids == want:
            identical += 1
            continue
        k = next(j for j, (a, b) in enumerate(zip(out.token_ids, want)) if a != b)
        assert out.token_ids[k] in want_top[k], f"request {i}: our token not in HF's top-{top} at {k}"
        assert want[k] in out.logprobs[k], f"request {i}: HF's token not in our top-{top} at {k}"
    return identical
