"""The tensor-parallel equivalence setup shared by the mp and Ray backends' tests: engine arguments small
enough that one mixed batch runs chunked prefills, prefix hits, ngram drafts and preemptions, that batch, and
a run with block invariants after every step."""
from __future__ import annotations

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.helpers.engine import check_engine_invariants

# Small pool and budget: the mixed batch below runs chunked prefills, prefix hits, ngram drafts and
# preemptions in both engines (the same schedule, since both have the same blocks).
TP_ARGS = dict(num_gpu_blocks_override=24, block_size=4, max_num_batched_tokens=24, max_num_seqs=4,
             num_threads=1)


def tp_mixed_batch():
    shared = list(range(100, 140))
    prompts = [shared + [7, 8, 9], shared + [11, 12], list(range(1000, 1061)), [5, 6, 5, 6, 5, 6, 5, 6],
               [42], [3, 1, 4, 1, 5, 9, 2, 6]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (9, 14, 6, 20, 11, 8)]
    params[2] = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    return prompts, params


def run_tp(llm: LLM, prompts, params):
    """Add every request, step to the end with block invariants checked after each step."""
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        check_engine_invariants(engine)
    return [done[str(i)] for i in range(len(prompts))]


def assert_same_outputs(ref, out) -> None:
    """Two runs of one batch (run_tp's outputs) agree: the same tokens, each step's top logprobs within 1e-4."""
    for a, b in zip(ref, out):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for token in la:
                assert abs(la[token].logprob - lb[token].logprob) < 1e-4
