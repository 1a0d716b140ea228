"""`kvserve bench playbook`: the serving playbook's cost table, measured on this machine in one run.

Every row compares two settings of the same engine on the same model (the built-in one unless --model), both
measured in this run: static vs continuous batching, contiguous vs paged KV, chunked prefill off vs on, prefix
caching off vs on (agent loop, RAG), prompt caching (cached vs uncached TTFT), speculative decoding (n-gram,
a draft model; copy-heavy and free-form), multi-LoRA vs one engine per adapter, MoE's fused experts vs the
reference. Beside each figure: the range the classic table claims, and the command that measures that row
alone. Rows the engine cannot measure say so. Never asserts; what pays on this machine is the reader's call
(docs/PLAYBOOK.md).
"""
from __future__ import annotations

import argparse
import datetime
import subprocess
import traceback
from collections.abc import Callable

import torch

from kvserve.bench import playbook_rows_cache as cache_rows
from kvserve.bench import playbook_rows_other as other_rows
from kvserve.bench import playbook_rows_sched as sched_rows
from kvserve.bench.engine_flags import engine_flags
from kvserve.bench.playbook_presets import PRESETS, Preset
from kvserve.bench.playbook_report import FAILED, Row, plot, print_table, write_json
from kvserve.bench.playbook_run import Context
from kvserve.cli.standalone import standalone_main
from kvserve.config import EngineArgs

# Each measurement, and the rows (their keys) it yields, in the report's order.
MEASUREMENTS: list[tuple[Callable[[Context], Row | list[Row]], tuple[str, ...]]] = [
    (sched_rows.continuous_batching, ("continuous-batching",)),
    (sched_rows.paged_attention, ("paged-attention",)),
    (sched_rows.chunked_prefill, ("chunked-prefill",)),
    (cache_rows.prefix_agent, ("prefix-agent",)),
    (cache_rows.prefix_rag, ("prefix-rag",)),
    (cache_rows.prompt_caching, ("prompt-caching",)),
    (other_rows.speculative, ("spec-ngram", "spec-draft")),
    (other_rows.multi_lora, ("multi-lora",)),
    (other_rows.moe, ("moe",)),
    (other_rows.batch_invariance, ("batch-invariance",)),
    (other_rows.medusa_eagle, ("medusa-eagle",)),
]
ROW_KEYS = tuple(k for _, keys in MEASUREMENTS for k in keys)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="the quick preset (small request counts): "
                                                              "under 10 minutes on 2 cores")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="workload sizes: quick, full, or tiny (a test checkpoint in seconds); default: full, "
                             "or quick with --quick")
    parser.add_argument("--rows", default=None, help=f"comma-separated rows to run, of {', '.join(ROW_KEYS)} "
                                                     "(default: all)")
    parser.add_argument("--draft-model", default=None,
                        help="a smaller model sharing the target's tokenizer, for the draft-model speculation row")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON to PATH")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="write a PNG bar chart (measured vs claimed range) to PATH (needs kvserve[plot])")
    EngineArgs.add_cli_args(parser.add_argument_group("engine (every side of every row starts from these)"))


def _quote(word: str) -> str:
    import shlex

    return shlex.quote(word)


def command_for(preset: str, engine_args: EngineArgs, draft_model: str | None) -> Callable[[str], str]:
    extra = engine_flags(engine_args) + (["--draft-model", draft_model] if draft_model else [])
    return lambda key: " ".join(["kvserve bench playbook", f"--preset {preset}", f"--rows {key}"]
                                + [_quote(w) for w in extra])


def _selected(rows_arg: str | None) -> list[str]:
    if rows_arg is None:
        return list(ROW_KEYS)
    keys = [k.strip() for k in rows_arg.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ROW_KEYS]
    if unknown or not keys:
        raise ValueError(f"--rows: unknown row(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(ROW_KEYS)}")
    return keys


def run_playbook(engine_args: EngineArgs, preset: Preset, keys: list[str], *, draft_model: str | None = None,
                 log: Callable[[str], None] = print) -> list[Row]:
    """Measure the selected rows, in the report's order. A row whose measurement raises is reported as failed
    (with the error) and the others still run."""
    model = engine_args.create_engine_config().model
    ctx = Context(engine_args, preset, model.vocab_size, model.hf_config,
                  command_for(preset.name, engine_args, draft_model), draft_model, log, tuple(keys))
    rows = []
    for measure, produced in MEASUREMENTS:
        wanted = [k for k in produced if k in keys]
        if not wanted:
            continue
        try:
            got = measure(ctx)
        except Exception as e:  # noqa: BLE001 -- one row's failure must not cost the others
            log(traceback.format_exc())
            got = [Row(k, k, "", None, status=FAILED, note=f"{type(e).__name__}: {e}", command=ctx.command(k))
                   for k in wanted]
        rows += [r for r in (got if isinstance(got, list) else [got]) if r.key in wanted]
    return rows


def _meta(engine_args: EngineArgs, preset: Preset) -> dict:
    from kvserve.utils.cpu_isa import selected_isa

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                                timeout=5, cwd=__file__.rsplit("/", 3)[0]).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "model": engine_args.model or "built-in SmolLM2-135M-Instruct", "preset": preset.name,
            "torch_threads": torch.get_num_threads(), "cpu_isa": selected_isa()}


def run(args: argparse.Namespace) -> int:
    if args.quick and args.preset not in (None, "quick"):
        raise ValueError(f"--quick is --preset quick; it cannot be combined with --preset {args.preset}")
    preset = PRESETS[args.preset or ("quick" if args.quick else "full")]
    keys = _selected(args.rows)
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        raise ValueError(f"--plot must be a .png file, got {args.plot!r}")
    engine_args = EngineArgs.from_cli(args)
    meta = _meta(engine_args, preset)
    print(f"playbook: preset {preset.name}, model {meta['model']}, {meta['torch_threads']} torch threads, "
          f"ISA {meta['cpu_isa']}", flush=True)
    rows = run_playbook(engine_args, preset, keys, draft_model=args.draft_model,
                        log=lambda line: print(line, flush=True))
    print()
    print_table(rows, f"serving playbook, measured {meta['date']} (commit {meta['commit']})")
    if args.json:
        write_json(rows, meta, args.json)
        print(f"json: {args.json}")
    if args.plot:
        plot(rows, args.plot, f"kvserve playbook ({preset.name}, {meta['date'][:10]})")
        print(f"plot: {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m kvserve.bench.playbook`: the same as `kvserve bench playbook`."""
    return standalone_main("kvserve bench playbook", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
