"""`kvserve proxy --prefill URL [--prefill URL ...] --decode URL [--decode URL ...]`: disaggregated serving's
front (vLLM's prefill-then-decode flow, router/pd.py); the router's app with --pd-disaggregation, round robin
over each pool by default."""
from __future__ import annotations

import argparse

from kvserve.router.cli import serve
from kvserve.router.config import RouterConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    RouterConfig.add_cli_args(parser, proxy=True)


def run(args: argparse.Namespace) -> int:
    return serve(RouterConfig.from_cli(args))
