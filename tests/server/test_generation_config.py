"""Default sampling parameters from the model's generation config (vLLM's --generation-config and
--override-generation-config): fields a request leaves unset take them, fields it sets win; the built-in
model's defaults make the README's quick-start request answer correctly."""
from __future__ import annotations

import json

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineArgs
from kvserve.config.generation import BUILTIN_DEFAULTS, default_sampling
from kvserve.server.anthropic_protocol import MessagesRequest
from kvserve.server.errors import APIError
from tests.helpers.server import API_KEY, in_process


@pytest.fixture(scope="module")
def tiny_with_generation_config(tiny_llama, tmp_path_factory):
    """A copy of the tiny model whose generation_config.json sets sampling defaults."""
    import shutil

    path = tmp_path_factory.mktemp("tiny_gen") / "model"
    shutil.copytree(tiny_llama[0], path)
    with open(path / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.3, "top_k": 5,
                   "max_new_tokens": 7}, f)
    return str(path)


def test_defaults_by_mode(tiny_with_generation_config, tmp_path):
    path = tiny_with_generation_config
    assert default_sampling("auto", None, None) == BUILTIN_DEFAULTS
    assert default_sampling("auto", path, None) == {"temperature": 0.3, "top_k": 5, "max_tokens": 7}
    assert default_sampling("vllm", path, None) == {}
    assert default_sampling(path, None, '{"temperature": 0.9, "max_new_tokens": 3}') == {
        "temperature": 0.9, "top_k": 5, "max_tokens": 3}
    with pytest.raises(ValueError, match="unknown key"):
        EngineArgs(override_generation_config='{"temprature": 1}')
    with pytest.raises(ValueError, match="JSON"):
        EngineArgs(override_generation_config="{")
    with pytest.raises(ValueError, match="temperature"):
        default_sampling("vllm", None, {"temperature": -1})
    with pytest.raises(ValueError, match="generation-config"):
        default_sampling(str(tmp_path / "missing"), None, None)


def test_offline_defaults_and_explicit_values_win(tiny_with_generation_config):
    llm = LLM(tiny_with_generation_config, num_gpu_blocks_override=64)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.max_tokens) == (0.3, 5, 7)
    out = llm.generate([[5, 6, 7]], use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) <= 7
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    plain = LLM(tiny_with_generation_config, num_gpu_blocks_override=64, generation_config="vllm")
    assert plain.get_default_sampling_params().temperature == 1.0


@pytest.fixture(scope="module")
def server(tiny_with_generation_config):
    yield from in_process(tiny_with_generation_config, "--stats-interval", "0",
                          "--override-generation-config", '{"repetition_penalty": 1.2, "temperature": 0.0}')


def test_server_applies_defaults_only_to_unset_fields(server):
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 7  # max_new_tokens
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 2, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 2
    assert "default sampling parameters" in server.log() and "'repetition_penalty': 1.2" in server.log()


def test_messages_request_takes_the_defaults_for_unset_fields():
    defaults = {"temperature": 0.0, "top_p": 0.5, "top_k": 5, "repetition_penalty": 1.2, "max_tokens": 7}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30}
    params = MessagesRequest(**body).to_sampling_params(defaults)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.0, 0.5, 5, 1.2)
    assert params.max_tokens == 30  # required by the Messages API: the default never applies
    params = MessagesRequest(**body, temperature=0.7, top_k=0).to_sampling_params(defaults)
    assert (params.temperature, params.top_k, params.top_p) == (0.7, 0, 0.5)  # set fields win
    assert MessagesRequest(**body).to_sampling_params().temperature == 1.0  # no defaults: Anthropic's own
    with pytest.raises(APIError, match="between 0 and 1"):  # Anthropic's range, defaults or not
        MessagesRequest(**body, temperature=1.5).to_sampling_params(defaults)


def test_server_messages_without_temperature_are_greedy_under_an_override(server):
    """--override-generation-config '{"temperature": 0.0}': a Messages request without temperature gives the
    explicit temperature-0 answer, every time (tokens and text)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Name three prime numbers."}], "max_tokens": 12}
    with server.http(headers={"x-api-key": API_KEY}) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        body["model"] = model
        unset = [http.post("/v1/messages", json=body).json() for _ in range(3)]
        explicit = http.post("/v1/messages", json={**body, "temperature": 0}).json()
    assert explicit["type"] == "message", explicit
    assert [m["content"] for m in unset] == [explicit["content"]] * 3
    assert [m["usage"]["output_tokens"] for m in unset] == [explicit["usage"]["output_tokens"]] * 3
    assert explicit["usage"]["output_tokens"] == 12 or explicit["stop_reason"] == "end_turn"  # not the default 7


@pytest.mark.slow
def test_quick_start_request_answers_well_with_default_flags(smollm2_path):
    """The README's request (no temperature, no max_tokens; the model named by the served default), 10 seeds:
    a short correct answer in at least 9."""
    good, answers = 0, []
    for srv in in_process(smollm2_path, "--stats-interval", "0"):
        with srv.http(timeout=120) as h:
            for seed in range(10):
                r = h.post("/v1/chat/completions", json={
                    "seed": seed,
                    "messages": [{"role": "user", "content": "What is the capital of France?"}]})
                choice = r.json()["choices"][0]
                text = choice["message"]["content"]
                answers.append(text)
                good += "Paris" in text.split(".")[0] and choice["finish_reason"] == "stop"
    assert good >= 9, answers
