"""`kvserve serve --model <folder>` of a tiny random Qwen3-MoE checkpoint (transformers' own config class) answers:
its model listed, a completion over token ids whose greedy text is transformers', a chat answer, a stream."""
from __future__ import annotations

import pytest

from tests.helpers.architectures import make_checkpoint
from tests.helpers.oracles import hf_greedy
from tests.helpers.server import in_process


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_moe"))
    return path, make_checkpoint(path, "qwen3_moe", seed=9)


@pytest.fixture(scope="module")
def server(moe):
    yield from in_process(moe[0])


def test_greedy_completion_equals_transformers(server, moe):
    path, hf = moe
    prompt = [17, 4242, 901, 33333, 7, 12000, 5, 64, 48000, 321]
    with server.http() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        out = http.post("/v1/completions", json=body).json()
    want, _ = hf_greedy(hf, prompt, 8)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert (out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"]) == (10, 8)
    assert out["choices"][0]["text"] == tokenizer.decode(want)
    assert out["choices"][0]["finish_reason"] == "length"


def test_chat_and_stream_answer(server):
    client = server.openai()
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi there"}],
                                          max_tokens=5, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    pieces = [c.choices[0].text for c in client.completions.create(model=model, prompt="Once upon a time",
                                                                   max_tokens=6, temperature=0, stream=True)
              if c.choices]
    plain = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert "".join(pieces) == plain.choices[0].text

