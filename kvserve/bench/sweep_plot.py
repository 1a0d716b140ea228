"""`kvserve bench sweep-plot`: the serving curve of one or more `kvserve bench sweep` JSON files, one PNG.

Two panels share the x axis, output tokens/s achieved at each request rate: p99 time to first token and
p99 inter-token latency (log scale: a saturated server's TTFT grows by orders of magnitude). One line per
file, named by its label (an engine, or a setting), each point marked with its request rate. Up and to
the left is worse; a curve that stays low further right serves more at the same latency.
"""
from __future__ import annotations

import argparse
import json
import os

from kvserve.cli.standalone import standalone_main


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", help="JSON files written by `kvserve bench sweep`")
    parser.add_argument("--output", "-o", required=True, help="PNG file to write")
    parser.add_argument("--title", default=None, help="figure title (default: the workload's name)")


def load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a sweep result ({e})") from None
    if not isinstance(report, dict) or not isinstance(report.get("rates"), list) or not report["rates"]:
        raise ValueError(f"{path}: not a `kvserve bench sweep` result (no rates)")
    return report


def plot(reports: list[dict], png_path: str, title: str | None = None) -> None:
    """Write the serving-curve PNG of these sweep reports."""
    import matplotlib

    matplotlib.use("Agg")  # NOTE: files only: no display on a server, and pyplot must not pick a GUI backend
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for report in reports:
        rows = [r for r in report["rates"] if r.get("completed")]
        x = [r["output_throughput"] for r in rows]
        for ax, key in zip(axes, ("ttft", "itl")):
            y = [max(r[key]["p99_ms"], 1e-3) for r in rows]
            line, = ax.plot(x, y, marker="o", label=report.get("label") or "?")
            for xi, yi, r in zip(x, y, rows):
                ax.annotate(str(r["request_rate"]), (xi, yi), textcoords="offset points", xytext=(4, 4),
                            fontsize=7, color=line.get_color())
    for ax, name in zip(axes, ("TTFT p99 (ms)", "ITL p99 (ms)")):
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[1].set_xlabel("output throughput (tok/s); points: request rate (req/s)")
    axes[0].legend(loc="upper left")
    workload = os.path.basename(str(reports[0].get("workload", "")))
    fig.suptitle(title or f"serving curve: {workload}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if not args.output.lower().endswith(".png"):
        raise ValueError(f"--output must be a .png file, got {args.output!r}")
    plot([load(p) for p in args.results], args.output, args.title)
    print(f"plot: {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m kvserve.bench.sweep_plot`: the same as `kvserve bench sweep-plot`."""
    return standalone_main("kvserve bench sweep-plot", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
