"""The routing workloads of `kvserve bench scale` (section b), packaged as workloads/groups.jsonl and chat.jsonl.

    groups   G groups of R completions: each group's prompts share a long prefix (token ids cut from the
             `mixed` workload's text), then a suffix of their own; sent in rounds of one request per group
             (each round in its own order), so a cache too small for every group's prefix evicts them in turn
    chat     C conversations of T turns sharing one system prompt; turn t repeats turns 1..t-1 (their
             assistant answers fixed in the file, as a recorded chat replays) and adds a user message

`python -m kvserve.bench.scale_workloads` rewrites both files from the packaged `mixed` and `prefix` workloads
with the built-in model's tokenizer (SmolLM2's, as every packaged workload); the result is deterministic.
`--quick` takes a prefix of each: the first groups and requests, the first conversations and turns.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

from kvserve.bench.workload import WORKLOAD_DIR, WorkloadRequest, load_workload, read_jsonl

GROUPS_FILE = os.path.join(WORKLOAD_DIR, "groups.jsonl")
CHAT_FILE = os.path.join(WORKLOAD_DIR, "chat.jsonl")
_GROUPS, _PER_GROUP, _PREFIX_TOKENS, _OUTPUT_TOKENS = 8, 8, 384, 8
_CONVERSATIONS, _TURNS, _CHAT_OUTPUT_TOKENS = 8, 4, 16


@dataclass(frozen=True)
class ChatRequest:
    id: str
    conversation: int
    turn: int
    messages: list[dict]
    max_tokens: int
    ignore_eos: bool = True


def group_of(request: WorkloadRequest) -> int:
    """The group of a groups.jsonl request (its id is group-G-R)."""
    return int(request.id.split("-")[1])


def load_groups(num_groups: int | None = None, per_group: int | None = None,
                path: str = GROUPS_FILE) -> list[WorkloadRequest]:
    """groups.jsonl in its (interleaved) order, keeping the first num_groups groups and per_group requests each."""
    out = []
    for r in load_workload(path):
        g, i = group_of(r), int(r.id.split("-")[2])
        if (num_groups is None or g < num_groups) and (per_group is None or i < per_group):
            out.append(r)
    return out


def load_chat(num_conversations: int | None = None, turns: int | None = None,
              path: str = CHAT_FILE) -> list[ChatRequest]:
    requests = read_jsonl(path, "chat workload request", lambda n, item: ChatRequest(
        str(item["id"]), int(item["conversation"]), int(item["turn"]), list(item["messages"]),
        int(item["max_tokens"]), bool(item.get("ignore_eos", True))))
    out = [r for r in requests if (num_conversations is None or r.conversation < num_conversations)
           and (turns is None or r.turn < turns)]
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def _token_stream() -> list[int]:
    return [t for r in load_workload("mixed") for t in r.prompt_token_ids]


def _round_order(n: int, round_index: int) -> list[int]:
    """0..n-1 in an order of this round's own: in a fixed order, round robin over an even number of replicas would
    send each group (or conversation) to the same replica every time, an affinity by accident."""
    order = list(range(n))
    random.Random(round_index).shuffle(order)
    return order


def make_groups(tokenizer) -> list[dict]:
    stream = _token_stream()
    step = len(stream) // (_GROUPS + 1)
    rows = []
    for i in range(_PER_GROUP):
        for g in _round_order(_GROUPS, i):
            prefix = stream[g * step:g * step + _PREFIX_TOKENS]
            start = g * step + _PREFIX_TOKENS + 500 + 40 * i  # a suffix from text no prefix holds
            suffix = stream[start:start + 32 + (7 * i + 5 * g) % 33]
            ids = prefix + suffix
            rows.append({"id": f"group-{g}-{i}", "prompt": tokenizer.decode(ids), "prompt_token_ids": ids,
                         "max_tokens": _OUTPUT_TOKENS, "ignore_eos": True})
    return rows


def make_chat(tokenizer) -> list[dict]:
    texts = [r.prompt_token_ids for r in load_workload("mixed")]
    system = tokenizer.decode(load_workload("prefix")[0].prompt_token_ids[:200])

    def text(i: int, n: int) -> str:
        return tokenizer.decode(texts[i % len(texts)][:n]).strip()

    rows = []
    for c in range(_CONVERSATIONS):
        messages = [{"role": "system", "content": system}]
        for t in range(_TURNS):
            messages = messages + [{"role": "user", "content": text(c * _TURNS + t, 60 + 10 * t)}]
            rows.append({"id": f"chat-{c}-{t}", "conversation": c, "turn": t, "messages": messages,
                         "max_tokens": _CHAT_OUTPUT_TOKENS, "ignore_eos": True})
            messages = messages + [{"role": "assistant", "content": text(c * _TURNS + t + 31, 40)}]
    # NOTE: turn by turn across the conversations, as users take turns: the order the bench sends them
    orders = {t: _round_order(_CONVERSATIONS, t) for t in range(_TURNS)}
    return sorted(rows, key=lambda r: (r["turn"], orders[r["turn"]].index(r["conversation"])))


def main() -> int:
    from kvserve.model_loader.gguf_loader import builtin_model_path
    from kvserve.model_loader.loader import ModelSource, load_tokenizer

    tokenizer = load_tokenizer(ModelSource.resolve(builtin_model_path()))
    for path, rows in ((GROUPS_FILE, make_groups(tokenizer)), (CHAT_FILE, make_chat(tokenizer))):
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"wrote {len(rows)} requests to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
