"""`python -m kvserve.bench.<name>`: a subcommand module run on its own, with the same flags and exit codes
as through `kvserve` (2 and a one-line message for a bad argument)."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from kvserve.utils.cli_help import DefaultsHelpFormatter


def standalone_main(prog: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                    run: Callable[[argparse.Namespace], int], argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=DefaultsHelpFormatter)
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
