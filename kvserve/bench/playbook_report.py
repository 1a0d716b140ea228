"""The playbook's report: one Row per technique (the claim, what this run measured, the command that reproduces
it), printed as a table, written as JSON, and drawn as a bar chart of measured vs claimed range."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

MEASURED = "measured"
NOT_BUILT = "not built yet"
NOT_MEASURABLE = "not measurable by this engine"
NOT_MEASURED = "not measured"
FAILED = "failed"


@dataclass
class Row:
    key: str
    """The row's name for --rows."""
    technique: str
    claim: str
    """The classic table's claim, in its words."""
    claim_range: tuple[float, float] | None
    """The claim as a range of the headline figure (None: the claim is not a ratio)."""
    status: str = MEASURED
    headline: float | None = None
    """This run's figure comparable with the claim (a ratio; for prompt caching a fraction)."""
    headline_label: str = ""
    details: dict = field(default_factory=dict)
    """Every figure measured for the row, by name."""
    command: str = ""
    note: str = ""
    """Why the row is not measured, or what to keep in mind reading it."""

    @property
    def verdict(self) -> str:
        """Where the measurement falls against the claimed range."""
        if self.headline is None or self.claim_range is None:
            return ""
        lo, hi = self.claim_range
        return "below" if self.headline < lo else "above" if self.headline > hi else "within"


def _measured_text(row: Row) -> str:
    if row.status != MEASURED:
        return row.status
    unit = "%" if row.headline_label.endswith("%") else "x"
    value = 100 * row.headline if unit == "%" else row.headline
    return f"{value:.2f}{unit} {row.headline_label.rstrip(' %')}".strip()


def print_table(rows: list[Row], header: str) -> None:
    print(header)
    print(f"{'technique':<37} {'claimed':<37} {'measured':<32} {'vs claim':<8}")
    for r in rows:
        print(f"{r.technique:<37} {r.claim:<37} {_measured_text(r):<32} {r.verdict:<8}")
    print()
    for r in rows:
        figures = ", ".join(f"{k} {_fmt(v)}" for k, v in r.details.items())
        print(f"[{r.key}] {figures}" + (f"\n    note: {r.note}" if r.note else ""))
        if r.command:
            print(f"    reproduce: {r.command}")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def to_json(rows: list[Row], meta: dict) -> dict:
    return {"meta": meta, "rows": [dataclasses.asdict(r) | {"verdict": r.verdict} for r in rows]}


def write_json(rows: list[Row], meta: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_json(rows, meta), f, indent=2)


def plot(rows: list[Row], png_path: str, title: str) -> None:
    """One horizontal bar per measured row (its headline), the claimed range shaded behind it; log scale, so
    1x (no gain) is the middle line."""
    import matplotlib

    matplotlib.use("Agg")  # NOTE: files only: no display on a server, and pyplot must not pick a GUI backend
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.status == MEASURED and r.headline and r.headline > 0
             and not r.headline_label.endswith("%")]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(shown) + 1.5))
    for y, r in enumerate(shown):
        if r.claim_range is not None:
            lo, hi = r.claim_range
            ax.barh(y, hi - lo, left=lo, height=0.8, color="lightgray", label="claimed" if y == 0 else None)
        # from 1x, so a loss (below 1x) points left
        ax.barh(y, r.headline - 1.0, left=1.0, height=0.4, color="tab:blue", label="measured" if y == 0 else None)
    ax.set_yticks(range(len(shown)), [r.technique for r in shown])
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("ratio vs the baseline (x)")
    ax.invert_yaxis()
    if shown:
        ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
