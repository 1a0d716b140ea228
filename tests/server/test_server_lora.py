"""Multi-LoRA through the HTTP server (its app in process): `model` names an adapter (its greedy text is
transformers+peft's), /v1/models lists adapters with the base as parent, unknown adapters are 404, adapters
load and unload at run time (paths confined to --allowed-lora-dirs; bad adapters a 400 naming the problem,
the others still served), and the prefix-cache explain endpoint keeps adapters apart."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.server import in_process

peft = pytest.importorskip("peft")

PROMPT = [101, 202, 303, 404, 505, 606, 707, 808, 909, 1001, 1102, 1203, 1304, 1405, 1506, 1607, 1708, 1809]


def _adapter(base, path, targets, seed):
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(copy.deepcopy(base), cfg).eval()
    model.save_pretrained(str(path))
    return model


@torch.inference_mode()
def _greedy(model, n=6):
    out = model.generate(input_ids=torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("srv_lora")
    base = make_tiny_checkpoint(str(root / "base"), "llama")
    allowed = root / "adapters"
    models = {"sql": _adapter(base, allowed / "sql", ["q_proj", "v_proj"], 1),
              "chat": _adapter(base, allowed / "chat", ["o_proj", "down_proj"], 2)}
    outside = root / "elsewhere"
    _adapter(base, outside, ["q_proj"], 3)
    oracle = {name: _greedy(m) for name, m in models.items()} | {None: _greedy(base)}
    return root, base, allowed, outside, oracle


@pytest.fixture(scope="module")
def server(setup):
    root, _, allowed, _, _ = setup
    yield from in_process(str(root / "base"), "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                          "--lora-modules", f"sql={allowed / 'sql'}", "--allowed-lora-dirs", str(allowed),
                          "--enable-debug-endpoints", "--stats-interval", "0")


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


def _complete(http, model):
    r = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                           "ignore_eos": True, "logprobs": 0})
    return r


def _tokens(r):
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_models_lists_adapters_and_requests_run_with_them(setup, http, server):
    _, _, allowed, _, oracle = setup
    cards = http.get("/v1/models").json()["data"]
    base = cards[0]["id"]
    assert [(c["id"], c.get("parent")) for c in cards] == [(base, None), ("sql", base)]
    tok = http.post("/detokenize", json={"tokens": oracle["sql"]}).json()["prompt"]
    assert _tokens(_complete(http, "sql")) == tok
    assert _tokens(_complete(http, base)) == http.post("/detokenize", json={"tokens": oracle[None]}).json()["prompt"]
    r = _complete(http, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_load_unload_at_run_time_and_bad_adapters(setup, http):
    _, _, allowed, outside, oracle = setup
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(allowed / "chat")})
    assert r.status_code == 200, r.text
    want = http.post("/detokenize", json={"tokens": oracle["chat"]}).json()["prompt"]
    assert _tokens(_complete(http, "chat")) == want
    # three adapters (sql, chat, base) over two slots: still right
    assert _tokens(_complete(http, "sql")) == http.post("/detokenize", json={"tokens": oracle["sql"]}).json()["prompt"]
    for body, status, words in [
            ({"lora_name": "x", "lora_path": str(outside)}, 400, "allowed-lora-dirs"),
            ({"lora_name": "x", "lora_path": str(allowed / "missing")}, 400, "cannot be loaded"),
            ({"lora_name": "chat", "lora_path": str(allowed / "chat")}, 400, "already in use"),
            ({"lora_name": "x"}, 400, "lora_path")]:
        r = http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == status and words in r.json()["error"]["message"], (body, r.text)
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 200
    assert _complete(http, "chat").status_code == 404
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert _tokens(_complete(http, "sql"))  # the others are still served


def test_explain_keeps_adapters_apart(http):
    base = http.get("/v1/models").json()["data"][0]["id"]
    fresh = [t + 7 for t in PROMPT] * 2  # computed for "sql" only
    r = http.post("/v1/completions", json={"model": "sql", "prompt": fresh, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200
    ex_sql = http.post("/debug/prefix-cache/explain", json={"model": "sql", "prompt": fresh}).json()
    ex_base = http.post("/debug/prefix-cache/explain", json={"model": base, "prompt": fresh}).json()
    assert ex_sql["num_cached_tokens"] >= 32 and ex_base["num_cached_tokens"] == 0


def test_unload_while_a_request_streams_lets_it_finish(setup, http):
    """Deferred unload: the name goes at once, the running request finishes with its adapter."""
    _, _, allowed, _, _ = setup
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "chat2", "lora_path": str(allowed / "chat")}
                     ).status_code == 200
    body = {"model": "chat2", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    texts, unloaded = [], False
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            texts.append(line)
            if not unloaded:
                assert http.post("/v1/unload_lora_adapter", json={"lora_name": "chat2"}).status_code == 200
                assert _complete(http, "chat2").status_code == 404
                unloaded = True
    assert unloaded and len(texts) > 1 and '"finish_reason":"length"' in texts[-1].replace(" ", "")
