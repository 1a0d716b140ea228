"""`kvserve kv-calc` run in process, as the command line would run it."""
from __future__ import annotations

import argparse
import json


def kv_calc_exit(*argv: str) -> int:
    """The exit status of `kvserve kv-calc ARGV` (its report or error goes to stdout / stderr)."""
    from kvserve.cli import kv_calc

    parser = argparse.ArgumentParser(prog="kvserve kv-calc")
    kv_calc.add_arguments(parser)
    return kv_calc.run(parser.parse_args(list(argv)))


def kv_calc_json(capsys, *argv: str) -> dict:
    """The `--json` report of `kvserve kv-calc ARGV`, which must succeed."""
    assert kv_calc_exit(*argv, "--json") == 0
    return json.loads(capsys.readouterr().out)
