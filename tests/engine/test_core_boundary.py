"""The engine-core boundary on a tiny checkpoint: per-step outputs are deltas of constant size, and the
three output kinds carry the same result."""
from __future__ import annotations

import pickle

import pytest

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from tests.helpers.engine import run_to_completion


# ---- the engine-core boundary and output kinds -------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(EngineArgs(model=tiny_llama[0], num_gpu_blocks_override=64, max_model_len=512))


def test_core_outputs_are_deltas_of_constant_size(engine):
    engine.add_request("d", list(range(1, 200)), SamplingParams(max_tokens=60, ignore_eos=True, logprobs=2))
    sizes = []
    while engine.has_unfinished_requests():
        outputs = engine.core.step()
        for o in outputs:
            assert len(o.new_token_ids) <= 1
        sizes.append(len(pickle.dumps(outputs)))
        engine.output_processor.process(outputs)
    decode = sizes[2:-1]
    assert max(decode) - min(decode) < 64, "a step's bytes must not grow with the output"


@pytest.mark.parametrize("n", [1, 2])
def test_output_kinds_carry_the_same_result(engine, n):
    prompt = list(range(5, 40))
    results = {}
    for kind in RequestOutputKind:
        engine.add_request(kind.name, prompt, SamplingParams(n=n, max_tokens=20, ignore_eos=True, seed=3,
                                                             temperature=0.8, logprobs=1, output_kind=kind,
                                                             stop=["zz"]))
        outs = []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.request_id == kind.name]
        results[kind] = outs
    cumulative = results[RequestOutputKind.CUMULATIVE][-1]
    final = results[RequestOutputKind.FINAL_ONLY]
    assert len(final) == 1 and final[0].finished
    deltas = results[RequestOutputKind.DELTA]
    for i in range(n):
        want = cumulative.outputs[i]
        assert final[0].outputs[i].token_ids == want.token_ids and final[0].outputs[i].text == want.text
        assert sum((d.outputs[i].token_ids for d in deltas), []) == want.token_ids
        assert "".join(d.outputs[i].text for d in deltas) == want.text
        got = sum((d.outputs[i].logprobs for d in deltas), [])
        assert [list(e) for e in got] == [list(e) for e in want.logprobs]  # (separate runs: values to 1e-5)
        assert [lp.logprob for e in got for lp in e.values()] == pytest.approx(
            [lp.logprob for e in want.logprobs for lp in e.values()], abs=1e-4)
    run_to_completion(engine)
