"""DefaultsHelpFormatter: `--help` states every flag's default (or that the flag is required).

argparse's own ArgumentDefaultsHelpFormatter prints Python reprs ("None", "False", "[]") and repeats a
default the help text already explains; this one words them for a reader:

    True / False -> on / off;  None, "" or an empty list -> none;  a list -> its items, space-separated;
    a help text that already says "default: ..." keeps its own wording; a required flag says "(required)".

A flag whose unset value means something specific should say so in its help ("default: the model's
max_position_embeddings"); "none" is the fallback.
"""
from __future__ import annotations

import argparse
import copy
from typing import Any


def describe_default(value: Any) -> str:
    """How a default reads in --help."""
    if value is True:
        return "on"
    if value is False:
        return "off"
    if value is None or value == "" or value == () or value == []:
        return "none"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


def help_with_default(action: argparse.Action) -> str:
    """`action.help` plus its default, unless the text already states it (escaped for argparse's %-expansion)."""
    text = action.help or ""
    takes_default = bool(action.option_strings) or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)
    if (not takes_default or action.default is argparse.SUPPRESS or "default:" in text.lower()
            or "%(default)" in text):
        return text
    suffix = "(required)" if action.required else f"(default: {describe_default(action.default)})"
    return f"{text.rstrip()} {suffix.replace('%', '%%')}".lstrip()


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """The formatter of every kvserve parser (pass it as `formatter_class`)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return help_with_default(action)

    def _format_action(self, action: argparse.Action) -> str:
        # NOTE: argparse skips _get_help_string when help is empty; a flag without help still shows its default.
        text = help_with_default(action)
        if not action.help and text:
            action = copy.copy(action)
            action.help = text  # already states the default: _get_help_string leaves it as it is
        return super()._format_action(action)
