"""Issue 9, item 4: property-based fuzzing.

- Every HTTP endpoint, from kvserve's own OpenAPI document (`GET /openapi.json`), with schemathesis: valid
  and invalid bodies alike, sent to the server's app in process. No 5xx; every error body in OpenAI's shape (Anthropic's under /v1/messages);
  afterwards the engine is healthy and a real generation succeeds.
- SamplingParams and LLM.generate with hypothesis: any value either raises ValueError up front or
  generates; the engine stays usable.

Bounded for CI; `pytest tests/server/test_fuzz.py --fuzz-examples 500` runs more.
"""
from __future__ import annotations

import math

import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.server import API_KEY, in_process, metric, wait_idle

FUZZ_FLAGS = ("--max-model-len", "256", "--max-num-seqs", "8", "--max-queue-len", "24", "--enable-debug-endpoints",
              "--stats-interval", "0", "--no-access-log", "--request-timeout", "30")
_COUNTS = {"cases": 0, "4xx": 0, "5xx": 0}


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama):
    yield from in_process(tiny_llama[0], *FUZZ_FLAGS)


@pytest.fixture(scope="module")
def operations(fuzz_server):
    with fuzz_server.http(headers={}) as http:
        schema = schemathesis.openapi.from_file(http.get("/openapi.json").text)
    return [result.ok() for result in schema.get_all_operations()]


def _check_error_body(path: str, body) -> None:
    if path.startswith("/v1/messages"):
        assert isinstance(body, dict) and body.get("type") == "error", body
        assert isinstance(body["error"].get("type"), str) and isinstance(body["error"].get("message"), str), body
        return
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error) and isinstance(error["message"], str), body


# NOTE: operations are driven with hypothesis directly (schemathesis' own pytest plugin does not run on
# this pytest); both valid bodies (positive) and bodies that break the schema (negative) are sent.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_no_5xx_and_errors_in_the_clients_shape(fuzz_server, operations, mode, request):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/messages",
                                              "/v1/messages/count_tokens", "/tokenize", "/detokenize",
                                              "/debug/prefix-cache/explain"}
    session = fuzz_server.requests_session()
    for op in operations:
        if mode == GenerationMode.NEGATIVE and op.method.upper() != "POST":
            continue  # nothing to break in a GET without parameters
        @settings(max_examples=request.config.getoption("--fuzz-examples"), deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def one(case):
            response = case.call(base_url=fuzz_server.base_url, session=session, headers=headers, timeout=60)
            _COUNTS["cases"] += 1
            status = response.status_code
            if status >= 500:
                _COUNTS["5xx"] += 1
            assert status < 500, (case.method, case.path, case.body, response.text[:500])
            if status >= 400:
                _COUNTS["4xx"] += 1
                _check_error_body(case.path, response.json())

        one()


def test_engine_healthy_after_fuzzing(fuzz_server, capsys):
    with fuzz_server.http() as http:
        wait_idle(http, timeout=60)
        assert metric(http, "kvserve:kv_cache_request_blocks") == 0
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    assert "Traceback" not in fuzz_server.log()
    with capsys.disabled():
        print(f"\nfuzz: {_COUNTS['cases']} cases, {_COUNTS['4xx']} answered 4xx, {_COUNTS['5xx']} 5xx")
    assert _COUNTS["cases"] > 0


# ---- SamplingParams / LLM.generate ------------------------------------------------------------
_ANY = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
                 st.lists(st.integers(min_value=-5, max_value=60_000), max_size=3))
_VALID = {
    "n": st.integers(1, 3), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "repetition_penalty": st.floats(0.5, 2), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "seed": st.integers(-2**63, 2**63 - 1), "max_tokens": st.integers(1, 8),
    "min_tokens": st.integers(0, 2), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 49_151), max_size=2), "logprobs": st.integers(0, 5),
    "ignore_eos": st.booleans(), "prompt_logprobs": st.integers(0, 5),
    "logit_bias": st.dictionaries(st.integers(0, 49_151), st.floats(-100, 100), max_size=2)}


@st.composite
def _sampling_kwargs(draw):
    """Mostly valid values, with any value (NaN, huge, wrong type) mixed in."""
    names = draw(st.lists(st.sampled_from(sorted(_VALID)), max_size=5, unique=True))
    kwargs = {name: draw(st.one_of(_VALID[name], _VALID[name], _VALID[name], _ANY)) for name in names}
    if isinstance(kwargs.get("max_tokens"), int) and not isinstance(kwargs["max_tokens"], bool):
        kwargs["max_tokens"] = max(-1, min(kwargs["max_tokens"], 8))  # keep generation short
    if isinstance(kwargs.get("n"), int) and not isinstance(kwargs["n"], bool):
        kwargs["n"] = min(kwargs["n"], 3)
    return kwargs


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from kvserve import LLM

    return LLM(tiny_llama[0], kv_cache_memory="16MiB", max_model_len=128)


def test_sampling_params_and_generate_never_break_the_engine(llm, request):
    from kvserve import SamplingParams

    outcomes = {"rejected": 0, "generated": 0}

    @settings(max_examples=request.config.getoption("--fuzz-examples") * 2, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(kwargs=_sampling_kwargs(), prompt=st.one_of(
        st.text(min_size=1, max_size=20), st.lists(st.integers(0, 49_151), min_size=1, max_size=6),
        st.lists(st.integers(min_value=-3, max_value=50_000), max_size=6)))
    def one(kwargs, prompt):
        try:
            params = SamplingParams(**kwargs)
            outs = llm.generate(prompt, params, use_tqdm=False)
        except ValueError:
            outcomes["rejected"] += 1
            return
        if prompt == []:  # no prompts at all, as in vLLM
            assert outs == []
            return
        outcomes["generated"] += 1
        for o in outs[0].outputs:
            assert o.finish_reason in ("stop", "length"), o
            assert all(math.isfinite(lp) for lp in ([o.cumulative_logprob] if o.cumulative_logprob else []))
        llm.engine.scheduler.check_invariants()

    one()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_pool.counts()["in_use"] == 0
    out = llm.generate("ok", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert outcomes["rejected"] and outcomes["generated"], outcomes
