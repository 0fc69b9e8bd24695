"""Targets of issue 15 and how ``bench_shuffle.py`` reports them: tables, verdicts, the plot."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["BOUND", "DEFAULTS", "FIRST_BATCH_S", "HEADER", "RATIO_TARGETS", "RESUME_RATIO",
           "Targets", "Verdicts", "plot", "row"]  # fmt: skip

FIRST_BATCH_S, RESUME_RATIO = 1.0, 1.5  # first batch of an epoch; resume at 90 % / at 0 %


@dataclass(frozen=True)
class Targets:
    """Quality targets: per batch labels and spread at least, neighbours at most."""

    labels: float
    spread: float
    neighbours: float
    spearman: float | None = None  # |rho| below this, when it is a target

    def misses(self, q: Mapping[str, float]) -> list[str]:
        """The figures of ``q`` (``Quality.as_dict()``) that miss (empty: all met)."""
        out = []
        if q["labels"] < self.labels:
            out.append(f"labels {q['labels']:.2f} < {self.labels}")
        if q["spread"] < self.spread:
            out.append(f"spread {q['spread']:.3f} < {self.spread}")
        if q["neighbours"] > self.neighbours:
            out.append(f"neighbours {q['neighbours']:.2%} > {self.neighbours:.0%}")
        if self.spearman is not None and abs(q["spearman"]) >= self.spearman:
            out.append(f"|spearman| {abs(q['spearman']):.3f} >= {self.spearman}")
        return out

    def __str__(self) -> str:
        rho = f", |spearman| < {self.spearman}" if self.spearman is not None else ""
        return f"≥ {self.labels} labels, ≥ {self.spread}, ≤ {self.neighbours:.0%}{rho}"


DEFAULTS = Targets(labels=9.5, spread=0.27, neighbours=0.01, spearman=0.05)
BOUND = Targets(labels=9.0, spread=0.25, neighbours=0.02)
RATIO_TARGETS = {"main w0": 0.65, "main w2": 0.85, "tokens w0": 0.85, "tokens w2": 0.85,
                 "packed w0": 0.85, "packed w2": 0.85}  # fmt: skip


HEADER = (f"  {'contender':<30}{'labels':>8}{'spread':>8}{'neighb.':>9}{'spearman':>10}"
          f"{'rows/s':>9}{'1st batch':>11}")  # fmt: skip


def row(name: str, f: dict[str, float]) -> None:
    """One line of a quality table (``HEADER``)."""
    speed = f"{f['rows_per_s'] / 1e6:8.2f}M" if "rows_per_s" in f else f"{'':9}"
    first = f"{f['first_batch_s'] * 1e3:9.0f}ms" if "first_batch_s" in f else ""
    print(f"  {name:<30}{f['labels']:8.2f}{f['spread']:8.3f}{f['neighbours']:9.2%}"
          f"{f['spearman']:10.3f}{speed}{first}", flush=True)  # fmt: skip


class Verdicts:
    """Every target of the run: figure, baseline, met or not; printed at the end, in the JSON."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, what: str, figure: str, baseline: str, target: str, met: bool) -> None:
        self.rows.append(
            {"what": what, "figure": figure, "baseline": baseline, "target": target, "met": met}
        )

    def quality(self, what: str, f: dict[str, float], base: dict[str, float], t: Targets) -> None:
        misses = t.misses(f)
        self.add(what, _short(f), "uniform " + _short(base), str(t), not misses)

    def show(self) -> None:
        print("\nsummary: every target, figure beside its baseline")
        for r in self.rows:
            met = "met" if r["met"] else "MISSED"
            print(f"  {met:<7}{r['what']:<34}{r['figure']:<32}(target {r['target']}; "
                  f"{r['baseline']})")  # fmt: skip


def _short(f: dict[str, float]) -> str:
    return f"{f['labels']:.2f} / {f['spread']:.3f} / {f['neighbours']:.2%} / {f['spearman']:.3f}"


def plot(
    path: str, curve: list[dict[str, Any]], base: dict[str, float], binding: float, note: str
) -> None:
    """Quality and first-batch latency against the budget (``curve``), beside the uniform
    permutation (``base``) and the targets (those of a binding budget at ``binding``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed; no plot written")
        return
    panels = [("labels", "distinct labels per batch", BOUND.labels, DEFAULTS.labels),
              ("spread", "std of pos / rows per batch", BOUND.spread, DEFAULTS.spread),
              ("neighbours", "rows with id - 1 in the batch", BOUND.neighbours,
               DEFAULTS.neighbours),
              ("first_batch_s", "first batch (s)", None, FIRST_BATCH_S)]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4))
    x = [point["fraction"] for point in curve]
    for ax, (key, title, bound, target) in zip(axes, panels, strict=True):
        ax.plot(x, [point[key] for point in curve], marker="o", label="ours w0")
        if key in base:
            ax.axhline(base[key], color="#55A868", linestyle=":", label="uniform permutation")
        if target is not None:
            ax.axhline(target, color="#C44E52", linestyle="--", label="target, defaults")
        if bound is not None:
            label = f"target at 1/{round(1 / binding)}"
            ax.plot([binding], [bound], "v", color="#C44E52", label=label)
        ax.set_xscale("log", base=2)
        if key == "neighbours":
            ax.set_yscale("log")  # the uniform 0.02 % and the targets 1-2 % beside today's 97 %
        ax.set_xlabel("shuffle_memory_bytes / stream's data")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.text(0.01, 0.01, note, fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")
