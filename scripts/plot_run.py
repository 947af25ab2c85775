"""Plot one or more training runs: loss with spikes, patch-embedding RMS, learning rate, loss scale, and the
evaluations (zero-shot top-1 and retrieval R@1 of every evaluation set) when the run has them.

Usage: python scripts/plot_run.py RUN_DIR [RUN_DIR ...] [-o OUT.png]
       python scripts/plot_run.py --summary RUN_DIR [RUN_DIR ...]   # one line of figures per run, no plot
       python scripts/plot_run.py --summary --seeds RUN_DIR ...    # and per group of seeds of one configuration

Each RUN_DIR holds metrics.jsonl and optionally spikes.jsonl (events of src.trainer.spikes) and
config.yaml (for spikes.rms_threshold and optim.name). Several runs overlay, one colour per run.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from src.jsonl import JsonlError, iter_jsonl

SPIKES_YAML = Path(__file__).resolve().parents[1] / "configs" / "spikes" / "default.yaml"
DEFAULT_RMS_THRESHOLD = yaml.safe_load(SPIKES_YAML.read_text())["rms_threshold"]
LOSS, RMS, LR, SCALE = "train/loss", "optim/rms/patch_embed", "train/lr", "scaler/scale"
# Evaluation metrics of any set and of the EMA weights: eval/zeroshot_top1, eval/<set>/t2i_r1, eval_ema/...
EVAL_PANELS = {"zero-shot top-1": re.compile(r"^eval[^/]*/(.+/)?zeroshot_top1$"),
               "retrieval R@1": re.compile(r"^eval[^/]*/(.+/)?(i2t|t2i)_r1$")}


class RunError(Exception):
    """A run directory that cannot be plotted; the message names the offending path."""


@dataclass
class Run:
    label: str
    metrics: list[dict[str, Any]]
    spikes: list[dict[str, Any]] = field(default_factory=list)
    rms_threshold: float = DEFAULT_RMS_THRESHOLD
    batch_size: int | None = None
    config: dict[str, Any] = field(default_factory=dict)  # config.yaml, flattened to dotted keys

    def series(self, key: str, positive: bool = False) -> tuple[list[float], list[float]]:
        """(steps, values) of the lines with a numeric `key`, sorted by step.

        A resumed run logs some steps twice; the later line wins. Non-finite values become NaN so the
        curve shows a gap there instead of wrecking the axis limits.
        """
        by_step: dict[float, float] = {}
        for row in self.metrics:
            step, value = row.get("step"), row.get(key)
            if _is_number(step) and _is_number(value) and (value > 0 or not positive):
                by_step[step] = value if math.isfinite(value) else math.nan
        steps = sorted(by_step)
        return steps, [by_step[s] for s in steps]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        return [row for _, row in iter_jsonl(path)]
    except JsonlError as err:
        raise RunError(str(err)) from err


def _lookup(config: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(config, dict):
            return None
        config = config.get(key)
    return config


def load_run(run_dir: Path) -> Run:
    if not run_dir.is_dir():
        raise RunError(f"{run_dir}: run directory does not exist")
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise RunError(f"{metrics_path}: metrics file does not exist")
    run = Run(label=run_dir.resolve().name, metrics=read_jsonl(metrics_path))
    if (run_dir / "spikes.jsonl").is_file():
        run.spikes = read_jsonl(run_dir / "spikes.jsonl")
    config_path = run_dir / "config.yaml"
    if config_path.is_file():
        try:
            config = yaml.safe_load(config_path.read_text())
        except yaml.YAMLError as e:
            raise RunError(f"{config_path}: malformed YAML ({e})") from e
        threshold = _lookup(config, "spikes.rms_threshold")
        if _is_number(threshold):
            run.rms_threshold = float(threshold)
        batch_size = _lookup(config, "data.batch_size")
        if _is_number(batch_size):
            run.batch_size = int(batch_size)
        optim_name = _lookup(config, "optim.name")
        if optim_name:
            run.label += f" ({optim_name})"
        run.config = flatten(config) if isinstance(config, dict) else {}
    return run


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a.b": value} for a nested mapping's leaves (lists are leaves)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _no_data(ax) -> None:
    ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")


def _spike_markers(ax, run: Run, kind: str, value_key: str, color: str) -> bool:
    """Mark `kind` events; loss events are filled when an RMS spike preceded them."""
    drawn = False
    for event in run.spikes:
        step, value = event.get("step"), event.get(value_key)
        if event.get("type") != kind or not _is_number(step):
            continue
        drawn = True
        if not _is_number(value) or not math.isfinite(value):
            # A non-finite loss has no height to mark; show where it happened instead.
            ax.axvline(step, color=color, linestyle=":", linewidth=1)
            continue
        filled = kind == "rms" or bool(event.get("preceded_by_rms_spike"))
        ax.plot(
            [step],
            [value],
            linestyle="none",
            marker="o" if kind == "loss" else "^",
            markersize=7,
            markeredgecolor=color,
            markerfacecolor=color if filled else "none",
            markeredgewidth=1.5,
        )
    return drawn


def eval_keys(runs: list[Run]) -> dict[str, list[str]]:
    """The evaluation metrics the runs logged, by panel; panels no run has are left out."""
    logged = sorted({key for run in runs for row in run.metrics for key in row})
    panels = {title: [key for key in logged if pattern.match(key)] for title, pattern in EVAL_PANELS.items()}
    return {title: keys for title, keys in panels.items() if keys}


def plot_eval(ax, runs: list[Run], colors: list[str], title: str, keys: list[str]) -> None:
    """One line per run and metric, marked at each evaluation (they are sparse); line styles tell metrics apart."""
    styles = ["-", "--", ":", "-."]
    for run, color in zip(runs, colors, strict=True):
        for index, key in enumerate(keys):
            steps, values = run.series(key)
            if steps:
                ax.plot(steps, values, color=color, linestyle=styles[index % len(styles)], marker=".", linewidth=1)
    ax.legend(handles=[Line2D([], [], color="black", linestyle=styles[i % len(styles)], label=key)
                       for i, key in enumerate(keys)], loc="lower right", fontsize="small")
    ax.set_ylabel(title)
    ax.grid(alpha=0.3)


def plot(runs: list[Run], out: Path) -> None:
    panels = eval_keys(runs)
    fig = Figure(figsize=(11, 11 + 2.5 * len(panels)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(4 + len(panels), 1, sharex=True)
    colors = [f"C{i % 10}" for i in range(len(runs))]

    for ax, (title, keys) in zip(axes[4:], panels.items(), strict=True):
        plot_eval(ax, runs, colors, title, keys)
    for ax, key in zip(axes[:4], (LOSS, RMS, LR, SCALE), strict=True):
        drawn = False
        for run, color in zip(runs, colors, strict=True):
            steps, values = run.series(key, positive=key == SCALE)  # the scale panel is log-scaled
            if steps:
                ax.plot(steps, values, color=color, linewidth=1)
                drawn = True
            if key == LOSS:
                drawn |= _spike_markers(ax, run, "loss", "loss", color)
            elif key == RMS:
                drawn |= _spike_markers(ax, run, "rms", "rms", color)
        if key == RMS and drawn:
            for threshold in sorted({run.rms_threshold for run in runs}):
                ax.axhline(
                    threshold, color="black", linestyle="--", linewidth=1, label=f"threshold {threshold:g}"
                )
        if key == SCALE and drawn:
            ax.set_yscale("log")
        if not drawn:
            _no_data(ax)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)

    if any(event.get("type") == "loss" for run in runs for event in run.spikes):
        axes[0].legend(
            handles=[
                Line2D(
                    [], [], linestyle="none", marker="o", color="black", label="loss spike after RMS spike"
                ),
                Line2D(
                    [],
                    [],
                    linestyle="none",
                    marker="o",
                    color="black",
                    markerfacecolor="none",
                    label="loss spike, no RMS spike",
                ),
                Line2D([], [], linestyle=":", color="black", label="non-finite loss"),
            ],
            loc="upper right",
            fontsize="small",
        )
    if axes[1].get_legend_handles_labels()[0]:
        axes[1].legend(loc="upper right", fontsize="small")
    run_handles = [Line2D([], [], color=c, label=r.label) for r, c in zip(runs, colors, strict=True)]
    fig.legend(handles=run_handles, loc="outside upper center", ncols=min(len(runs), 4))
    axes[-1].set_xlabel("step")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def summary(run: Run) -> dict[str, Any]:
    """A run's figures: steps, the mean loss of its last 10 logged steps, the detector's counts (spikes.jsonl),
    the share of loss spikes preceded by a patch-embedding RMS spike, the last zero-shot top-1 and its step (a
    run stopped before its final evaluation has an earlier one), the median
    step time over the run's second half (the first windows include compilation), and the tensors that loss
    events name as the largest update before them, most often named first."""
    steps, losses = run.series(LOSS)
    loss_events = [e for e in run.spikes if e.get("type") == "loss"]
    preceded = sum(bool(e.get("preceded_by_rms_spike")) for e in loss_events)
    top1_steps, top1 = run.series("eval/zeroshot_top1")
    rate_steps, rates = run.series("train/samples_per_s", positive=True)
    late = sorted(r for s, r in zip(rate_steps, rates) if s > rate_steps[-1] / 2) if rates else []
    final = [x for x in losses[-10:] if math.isfinite(x)]
    # Events written before the detector named the largest update have no largest_rms.
    leaders = Counter(e["largest_rms"]["tensor"] for e in loss_events if e.get("largest_rms"))
    return {
        "run": run.label, "steps": int(steps[-1]) if steps else 0,
        "final_loss": sum(final) / len(final) if final else None,
        "loss_spikes": len(loss_events), "rms_spikes": sum(e.get("type") == "rms" for e in run.spikes),
        "preceded": preceded, "preceded_share": preceded / len(loss_events) if loss_events else None,
        "zeroshot_top1": top1[-1] if top1 else None, "zeroshot_step": int(top1_steps[-1]) if top1 else None,
        "samples_per_s": late[len(late) // 2] if late else None,
        "step_ms": 1000 * run.batch_size / late[len(late) // 2] if late and run.batch_size else None,
        "largest_rms_tensors": ",".join(f"{name}:{n}" for name, n in leaders.most_common()) or None,
    }


def format_summary(row: dict[str, Any]) -> str:
    def fmt(value: Any) -> str:
        return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
    return "  ".join(f"{k}={fmt(v)}" for k, v in row.items())


# What differs between runs of one configuration at several seeds.
SEED_KEYS = frozenset({"trainer.seed", "trainer.run_dir"})
SEED_FIGURES = ("final_loss", "zeroshot_top1", "step_ms", "loss_spikes")


def seed_groups(runs: list[Run]) -> list[tuple[str, list[Run]]]:
    """The runs grouped by configuration, trainer.seed and trainer.run_dir aside, in the order first seen; each
    group named by the settings in which the groups differ ("all" for one group)."""
    groups: dict[tuple, tuple[dict[str, Any], list[Run]]] = {}
    for run in runs:
        setting = {k: v for k, v in run.config.items() if k not in SEED_KEYS}
        groups.setdefault(tuple(sorted((k, repr(v)) for k, v in setting.items())), (setting, []))[1].append(run)
    settings = [setting for setting, _ in groups.values()]

    def shown(setting: dict[str, Any], key: str) -> str:
        return str(setting[key]) if key in setting else "(unset)"

    keys = sorted({k for setting in settings for k in setting})
    differ = [k for k in keys if len({shown(setting, k) for setting in settings}) > 1]
    return [(", ".join(f"{k}={shown(setting, k)}" for k in differ) or "all", members)
            for setting, members in groups.values()]


def seed_summary(name: str, runs: list[Run]) -> dict[str, Any]:
    """A group's seeds and, for each of SEED_FIGURES, the mean over its runs and its range; and the steps of the
    zero-shot figures it averages, which differ where a run stopped before its final evaluation."""
    rows = [summary(run) for run in runs]
    out: dict[str, Any] = {"group": name, "runs": len(runs),
                           "seeds": ",".join(str(run.config.get("trainer.seed", "?")) for run in runs)}
    for figure in SEED_FIGURES:
        values = [row[figure] for row in rows if row[figure] is not None]
        out[figure] = sum(values) / len(values) if values else None
        out[f"{figure}_range"] = f"{min(values):.4g}..{max(values):.4g}" if values else None
    steps = sorted({row["zeroshot_step"] for row in rows if row["zeroshot_step"] is not None})
    out["zeroshot_steps"] = ",".join(map(str, steps)) or None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument(
        "-o", "--output", type=Path, help="PNG path (default: RUN_DIR/plot.png or ./runs.png)"
    )
    parser.add_argument("--summary", action="store_true",
                        help="print each run's figures (final loss, spike counts, zero-shot top-1, step time); "
                             "plot only with -o")
    parser.add_argument("--seeds", action="store_true",
                        help="with --summary: also one line per configuration run at several seeds (runs whose "
                             "config.yaml differ in trainer.seed only): mean and range of its figures")
    args = parser.parse_args(argv)
    try:
        runs = [load_run(d) for d in args.run_dirs]
    except RunError as e:
        print(f"plot_run: error: {e}", file=sys.stderr)
        return 2
    if args.seeds and not args.summary:
        parser.error("--seeds summarizes groups of runs: add --summary")
    if args.summary:
        for run in runs:
            print(format_summary(summary(run)))
        if args.seeds:
            for name, members in seed_groups(runs):
                print(format_summary(seed_summary(name, members)))
        if args.output is None:
            return 0
    out = args.output or (args.run_dirs[0] / "plot.png" if len(runs) == 1 else Path("runs.png"))
    plot(runs, out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
