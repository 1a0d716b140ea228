"""Tool-call parsers (hermes, smollm2, and the two for constrained outputs), whole and streamed, with the text
split at every character: a stream must add up to what the whole parse returns. Malformed calls are content,
never a crash. Plus the parser registry, inference from a chat template, and the start-up flag."""
from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.server.config import ServerConfig
from kvserve.server.tool_parsers import (NamedCallParser, RequiredCallsParser, StreamDelta, get_tool_parser,
                                         infer_tool_parser, resolve_tool_parser)
from tests.helpers.checkpoints import builtin_tokenizer
from tests.helpers.tool_calling import HERMES, SMOLLM2


# ---- helpers ----------------------------------------------------------------------------------
def _check_call_delta(d, seen: set) -> None:
    if d.id is not None:  # a call's first delta: id and name, once, at the next index
        assert d.index == len(seen) and d.index not in seen and d.name and d.id.startswith("call_")
        seen.add(d.index)
    else:
        assert d.index in seen and d.name is None


def streamed(parser, pieces: list[str]) -> tuple[str, list[tuple[str, object]]]:
    """(content, [(name, parsed arguments)]) of a stream of `pieces`."""
    s = parser.streamer()
    merged, seen = StreamDelta(), set()
    deltas = [s.feed(p) for p in pieces] + [s.finish()]
    for d in deltas:
        for c in d.calls:
            _check_call_delta(c, seen)
        merged.extend(d)
    calls: dict[int, list] = {}
    for c in merged.calls:
        entry = calls.setdefault(c.index, [c.name, ""])
        entry[1] += c.arguments
    return merged.content, [(name, json.loads(args)) for name, args in calls.values()]


def whole(parser, text: str) -> tuple[str, list[tuple[str, object]]]:
    parsed = parser.extract(text)
    return parsed.content or "", [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def splits(text: str, seed: int = 0) -> list[list[str]]:
    """Two pieces cut at every character, one character at a time, and a few random chunkings."""
    out = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    rng = random.Random(seed)
    for _ in range(5):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


# ---- parsers: whole and streamed ----------------------------------------------------------------
WEATHER = {"city": "Paris", "unit": "celsius"}
VALID = [
    (SMOLLM2, 'Sure.\n<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n]'
              '</tool_call>', "Sure.", [("get_weather", WEATHER)]),
    (SMOLLM2, '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"n": [1, 2]}}]</tool_call>',
     "", [("a", {}), ("b", {"n": [1, 2]})]),
    (HERMES, '<tool_call>\n{"name": "a", "arguments": {"q": "x \\"}\\" y", "n": [1, {"k": null}], "é": "ü"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
     "", [("a", {"q": 'x "}" y', "n": [1, {"k": None}], "é": "ü"}), ("b", {})]),
    (HERMES, '<tool_call>{"arguments": {"x": 1}, "name": "later"}</tool_call>', "", [("later", {"x": 1})]),
    (HERMES, '<tool_call>{"name": "s", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("s", {"x": 1})]),
    (HERMES, '<tool_call>{"name": "p", "parameters": {"x": true}}</tool_call>', "", [("p", {"x": True})]),
    (HERMES, '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\nDone.', "\nDone.", [("f", {"x": 1})]),
    (SMOLLM2, '<tool_call>[{"name": "open", "arguments": {"x": 1}}]', "", [("open", {"x": 1})]),
    (SMOLLM2, '<tool_call>[{"name": "cut", "arguments": {}}]</tool_', "", [("cut", {})]),
    (SMOLLM2, "No tool needed: the answer is 4.  \n", "No tool needed: the answer is 4.  \n", []),
    (SMOLLM2, "<tool_call>[]</tool_call>", "", []),
    (SMOLLM2, "a < b and <tool but not a call", "a < b and <tool but not a call", []),
]


@pytest.mark.parametrize("parser,text,content,calls", VALID, ids=range(len(VALID)))
def test_whole_parse(parser, text, content, calls):
    assert whole(parser, text) == (content, calls)
    parsed = parser.extract(text)
    assert parsed.content is None if calls and not content else parsed.content == content
    assert len({c.id for c in parsed.tool_calls}) == len(calls)


@pytest.mark.parametrize("parser,text,content,calls", VALID, ids=range(len(VALID)))
def test_stream_split_anywhere_adds_up_to_the_whole_parse(parser, text, content, calls):
    for pieces in splits(text):
        assert streamed(parser, pieces) == (content, calls), pieces


def test_stream_sends_the_call_head_before_its_arguments_and_arguments_as_they_come():
    text = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    s = SMOLLM2.streamer()
    deltas = [s.feed(ch) for ch in text] + [s.finish()]
    calls = [c for d in deltas for c in d.calls]
    assert calls[0].name == "get_weather" and calls[0].arguments == ""
    head_at = next(i for i, d in enumerate(deltas) if d.calls)
    assert text[:head_at + 1].endswith('"arguments":')  # announced as soon as the arguments' key arrived
    assert len(calls) > 10 and "".join(c.arguments for c in calls) == '{"city": "Paris"}'
    assert not any(d.content for d in deltas)


MALFORMED = [
    '<tool_call>{"name": broken}</tool_call> tail',
    "<tool_call>not json at all</tool_call>",
    "<tool_call>[1, 2]</tool_call>",
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    '<tool_call>{"name": 5}</tool_call>',
    "<tool_call></tool_call>",
    "<tool_call>",
    "text <tool_c",
    '<tool_call>{"arguments": {"x": 1}}</tool_call>',
    '<tool_call>[{"name": "f", "arguments": {"x": 1}]</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"x": 1',
    '<tool_call>[{"name": "f", "arguments": {}}, 7]</tool_call>',
]
# Malformed before any call was announced: a stream can still give the text back as content.
UNANNOUNCED = MALFORMED[:9]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_calls_are_content_and_never_crash(text):
    for parser in (SMOLLM2, HERMES):
        parsed = parser.extract(text)
        assert parsed.content == text and parsed.tool_calls == []
        for pieces in splits(text):
            s = parser.streamer()
            deltas = [s.feed(p) for p in pieces] + [s.finish()]
            if text in UNANNOUNCED:
                assert "".join(d.content for d in deltas) == text and not any(d.calls for d in deltas)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(['<tool_call>', '</tool_call>', '[', ']', '{', '}', '"name"', '"arguments"', ':',
                                 ',', '"f"', '"x\\"', ' ', '\n', '1', 'hi', '<tool', '"']), max_size=30),
       st.integers(0, 10))
def test_any_text_parses_without_crashing(words, cut):
    text = "".join(words)
    for parser in (SMOLLM2, HERMES):
        parsed = parser.extract(text)
        if not parsed.tool_calls and not re.search(r"\[\s*\]", text):  # [] is "no call", not content
            assert parsed.content == text
        s = parser.streamer()
        delta = StreamDelta()
        for piece in (text[:cut], text[cut:]):
            delta.extend(s.feed(piece))
        delta.extend(s.finish())
        if not delta.calls and not parsed.tool_calls:
            assert delta.content == parsed.content


def test_required_and_named_parsers():
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    required = RequiredCallsParser()
    assert whole(required, text) == ("", [("f", {"a": 1}), ("g", {})])
    for pieces in splits(text):
        assert streamed(required, pieces) == ("", [("f", {"a": 1}), ("g", {})])
    for bad in ('[{"name": "f", "parameters": {"a"', "not json", "[]", '[{"parameters": {}}]'):
        assert required.extract(bad).content is None and not required.extract(bad).tool_calls
        s = required.streamer()
        deltas = [s.feed(ch) for ch in bad] + [s.finish()]
        assert not any(d.content for d in deltas)  # "required" never answers content
        if '"name"' in bad:  # announced before it broke: the stream keeps the call (it cannot take it back)
            assert [c.name for d in deltas for c in d.calls if c.name] == ["f"]
        else:
            assert not any(d.calls for d in deltas)
    named = NamedCallParser("get_weather")
    args = '{"city":"Paris"}'
    assert whole(named, args) == ("", [("get_weather", {"city": "Paris"})])
    assert named.extract(args).tool_calls[0].arguments == args
    for pieces in splits(args):
        assert streamed(named, pieces) == ("", [("get_weather", {"city": "Paris"})])


def test_required_list_cut_anywhere_gives_its_complete_calls_never_content():
    """max_tokens can cut a "required" list anywhere: the whole answer is the calls that closed before the cut
    (issue 34: it was the cut text as content); the stream's calls start with those, the same."""
    calls = [("get_weather", {"location": "Paris", "unit": "celsius"}), ("noop", {}), ("f", {"a": [1, "]}"]})]
    text = "[" + ", ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls) + "]"
    closes = [text.index(json.dumps({"name": n, "parameters": a})) + len(json.dumps({"name": n, "parameters": a}))
              for n, a in calls]
    required = RequiredCallsParser()
    for cut in range(len(text) + 1):
        prefix = text[:cut]
        complete = calls[:sum(end <= cut for end in closes)]
        parsed = required.extract(prefix)
        assert parsed.content is None and whole(required, prefix) == ("", complete), prefix
        s = required.streamer()
        merged = StreamDelta()
        for piece in (prefix[:cut // 2], prefix[cut // 2:]):
            merged.extend(s.feed(piece))
        merged.extend(s.finish())
        assert not merged.content
        names = [c.name for c in merged.calls if c.name]
        assert names[:len(complete)] == [n for n, _ in complete] and len(names) <= len(complete) + 1


# ---- registry, inference, flags -----------------------------------------------------------------
def test_parser_registry_and_inference():
    builtin = builtin_tokenizer().chat_template  # load_gguf_tokenizer(builtin_model_path()), read once a session
    assert "tools" not in builtin  # NOTE: the built-in template ignores tools, hence the fallback template
    assert infer_tool_parser(builtin) is SMOLLM2
    assert infer_tool_parser("{{ '<tool_call>\\n' }}{{ tools }}") is HERMES
    assert infer_tool_parser("{{ messages }}") is None and infer_tool_parser(None) is None
    assert resolve_tool_parser("hermes", builtin) is HERMES
    with pytest.raises(ValueError, match="hermes, smollm2"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        ServerConfig(tool_call_parser="nope")
    assert SMOLLM2.chat_template and "<tool_call>[" in SMOLLM2.chat_template
    assert HERMES.chat_template and "<tool_call>" in HERMES.chat_template


def test_unknown_tool_call_parser_exits_2_at_start_up(capsys):
    from kvserve.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--tool-call-parser", "nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--tool-call-parser" in err and "nope" in err and "hermes" in err
