"""The playbook's workloads, generated from a seed: token ids below the model's vocabulary size, so any model
takes them (the built-in workloads' ids are SmolLM2's). Each is sized by the preset (bench/playbook_presets.py).

- varied: prompts of similar length, outputs from a long-tailed spread (what static batching pays for);
- interference: short decode-heavy requests at t=0, long prompts arriving while they decode (chunked prefill);
- agent: sessions whose every step re-sends a system prompt and a scratchpad that grew by the last step's
  thought and observation (the classic agent loop), steps in rounds;
- rag: a few shared documents, each request one of them plus its own question;
- free-form: short random prompts (little for an n-gram proposer to copy);
- copy-heavy: prompts that hold a passage twice, asking in effect for a third copy.
"""
from __future__ import annotations

import random

from kvserve.bench.workload import WorkloadRequest

_FIRST_ID = 100  # clear of the special tokens at the start of every vocabulary we load


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(_FIRST_ID, vocab) for _ in range(n)]


def varied(n: int, prompt_len: int, max_output: int, vocab: int, seed: int = 0) -> list[WorkloadRequest]:
    """Outputs from max_output/16 to max_output tokens, most short, a few long (a chat service's spread)."""
    rng = random.Random(f"varied-{seed}")
    lengths = [max(1, int(max_output * min(1.0, rng.paretovariate(1.2) / 16))) for _ in range(n)]
    return [WorkloadRequest(f"v{i}", _tokens(rng, prompt_len + rng.randrange(prompt_len // 4 + 1), vocab), m)
            for i, m in enumerate(lengths)]


def interference(num_short: int, num_long: int, short_prompt: int, short_output: int, long_prompt: int,
                 long_arrival_s: float, vocab: int, seed: int = 0) -> list[WorkloadRequest]:
    rng = random.Random(f"interference-{seed}")
    short = [WorkloadRequest(f"s{i}", _tokens(rng, short_prompt, vocab), short_output) for i in range(num_short)]
    long = [WorkloadRequest(f"l{i}", _tokens(rng, long_prompt, vocab), 4, arrival_s=long_arrival_s * (1 + i / 4))
            for i in range(num_long)]
    return short + long


def agent(num_sessions: int, num_steps: int, system_len: int, step_len: int, output: int, vocab: int,
          seed: int = 0) -> list[list[WorkloadRequest]]:
    """Rounds: round s holds every session's step s, whose prompt extends its step s-1 prompt by step_len."""
    rng = random.Random(f"agent-{seed}")
    system = _tokens(rng, system_len, vocab)
    pads = [list(system) for _ in range(num_sessions)]
    rounds = []
    for step in range(num_steps):
        for pad in pads:
            pad.extend(_tokens(rng, step_len, vocab))
        rounds.append([WorkloadRequest(f"a{i}-{step}", list(pad), output) for i, pad in enumerate(pads)])
    return rounds


def rag(num_requests: int, num_docs: int, doc_len: int, question_len: int, output: int, vocab: int,
        seed: int = 0) -> list[WorkloadRequest]:
    rng = random.Random(f"rag-{seed}")
    docs = [_tokens(rng, doc_len, vocab) for _ in range(num_docs)]
    return [WorkloadRequest(f"r{i}", docs[i % num_docs] + _tokens(rng, question_len, vocab), output)
            for i in range(num_requests)]


def free_form(n: int, prompt_len: int, output: int, vocab: int, seed: int = 0) -> list[WorkloadRequest]:
    rng = random.Random(f"free-{seed}")
    return [WorkloadRequest(f"f{i}", _tokens(rng, prompt_len, vocab), output) for i in range(n)]


def copy_heavy(n: int, passage_len: int, output: int, vocab: int, seed: int = 0) -> list[WorkloadRequest]:
    rng = random.Random(f"copy-{seed}")
    out = []
    for i in range(n):
        passage = _tokens(rng, passage_len, vocab)
        out.append(WorkloadRequest(f"c{i}", passage + passage + passage[:passage_len // 4], output))
    return out
