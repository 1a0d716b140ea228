"""The latency budget in a real engine: latency-sized prompt chunks change no output, and outputs match
transformers."""
from __future__ import annotations

import random

from kvserve.sampling_params import SamplingParams


def test_engine_outputs_unchanged_by_latency_sized_chunks_and_match_transformers(tiny_llama):
    """A real engine, decodes running while long prompts arrive: a tiny target (every chunk beside decodes
    at its floor or the 2x rule) and auto (the 90-token prompt whole, the 150-token one in chunks) give the
    same greedy tokens as the fixed budget and as transformers."""
    import torch

    from tests.helpers.engine import check_engine_invariants
    from kvserve.config import EngineArgs
    from kvserve.engine.engine import Engine

    path, hf = tiny_llama
    rng = random.Random(7)
    short = [[rng.randrange(3, 200) for _ in range(5)] for _ in range(3)]
    long = [[rng.randrange(3, 200) for _ in range(n)] for n in (150, 90)]
    results, steps = [], []
    for target in (0.001, 0.0, "auto"):
        engine = Engine(EngineArgs(model=path, num_gpu_blocks_override=64, max_model_len=256,
                                   max_num_batched_tokens=128, target_itl_ms=target, speculative_config=None))
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i, p in enumerate(short):
            engine.add_request(f"s{i}", p, params)
        engine.step()                                    # the short prompts; from now on they decode
        for i, p in enumerate(long):
            engine.add_request(f"l{i}", p, params)
        done, n = {}, 1
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            check_engine_invariants(engine)
            n += 1
        results.append(done)
        steps.append(n)
    assert results[0] == results[1] == results[2]
    assert steps[0] > steps[1], "the target did cut the long prompts' chunks"
    for rid, prompt in [(f"s{i}", p) for i, p in enumerate(short)] + [(f"l{i}", p) for i, p in enumerate(long)]:
        with torch.inference_mode():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert list(results[0][rid]) == want, rid
