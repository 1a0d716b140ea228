"""`--help` states every flag's default (or that it is required), on every subcommand, in words a reader
uses: on/off, none, or what an unset flag means, never Python's None/False/True."""
from __future__ import annotations

import argparse

import pytest

from kvserve.cli import main as cli_main
from kvserve.utils.cli_help import DefaultsHelpFormatter, describe_default

SUBCOMMANDS = [[name] for name in cli_main._COMMANDS] + [["bench", name] for name in cli_main._BENCH]


def _subparser(words: list[str]) -> argparse.ArgumentParser:
    parser = cli_main.build_parser(words)
    for word in words:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


def _help_blocks(text: str) -> list[str]:
    """One block per argument of a --help text: its invocation line and the help lines under it."""
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            blocks.append([line.strip()])
        elif line.startswith("   ") and blocks:
            blocks[-1].append(line.strip())
        else:
            blocks.append([])  # a heading or a blank line ends the block
    return [" ".join(b) for b in blocks if b]


def _documented_actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            yield action


@pytest.mark.parametrize("words", SUBCOMMANDS, ids=[" ".join(w) for w in SUBCOMMANDS])
def test_every_option_shows_its_default(words, monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")  # one line per help text: blocks are easy to tell apart
    parser = _subparser(words)
    assert parser.formatter_class is DefaultsHelpFormatter
    blocks = _help_blocks(parser.format_help())
    actions = list(_documented_actions(parser))
    assert actions, words
    for action in actions:
        name = action.option_strings[0] if action.option_strings else action.metavar or action.dest
        block = next((b for b in blocks if b == name or b.startswith((name + " ", name + ","))), None)
        assert block is not None, f"{' '.join(words)}: {name} is not in --help"
        assert "default:" in block.lower() or "(required)" in block, f"{' '.join(words)}: {block}"
        for python_word in ("None", "False", "True", "[]", "()"):
            assert f"(default: {python_word})" not in block, f"{' '.join(words)}: {block}"
        assert block.lower().count("default:") <= 1, f"{' '.join(words)}: the default said twice: {block}"


def test_defaults_read_as_words(monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")
    blocks = _help_blocks(_subparser(["serve"]).format_help())

    def block(flag: str) -> str:
        return next(b for b in blocks if b.startswith(flag + " ") or b.startswith(flag + ","))

    assert block("--max-num-seqs").endswith("(default: 256)")
    assert block("--enable-prefix-caching").endswith("(default: on)")
    assert block("--enable-lora").endswith("(default: off)")
    assert block("--lora-modules").endswith("(default: none)")
    assert "default: the model's max_position_embeddings" in block("--max-model-len")  # the help's own words
    assert [describe_default(v) for v in (True, False, None, "", (), ("a", "b"), 0.5)] == [
        "on", "off", "none", "none", "none", "a b", "0.5"]
    kv_calc = _help_blocks(_subparser(["kv-calc"]).format_help())
    assert any(b.startswith("--num-layers") and "(default: the model's)" in b for b in kv_calc)


def test_help_through_the_console_script(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main.main(["generate", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "(default: 64)" in out and "(default: off)" in out
