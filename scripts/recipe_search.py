#!/usr/bin/env python
"""The equal-compute recipe search: which way of teaching the masks pays off within a CPU budget.

Every variant of ``conf/recipe_search.yaml`` trains from the same base on the same self-distilled answers for
the same compute (``budget.minutes`` on the CPU clock, so a busy machine slows a variant but does not rob it),
then is scored on the quality suite in fp32 against the untouched base model:

1. base        the base model on the quality suite at tau 1.0 (once; the paired reference of every variant)
2. <v>/train   python train.py experiment=recipe_search <overrides> budget.minutes=B
3. <v>/eval    the quality suite at the thresholds (tokens per forward, 5-task average vs its own tau 1.0 and
               vs the base at tau 1.0 with paired intervals, identical-to-tau-1.0 share, per-token fidelity)
4. <v>/verify  lossless verify mode: tokens per forward, outputs vs the base's greedy outputs
5. report      results/recipe_search/: table.md, table.csv, pareto.png, configs, loss curves, commands

Each stage is skipped when its result exists and resumes from its own partial state (train from
``last.ckpt`` with the budget it had used, evaluation from its per-sample files), so a killed search is
resumed by running the same command; a variant enters the table only when all its stages are complete.

    nohup python scripts/recipe_search.py > recipe_search.log 2>&1 &     # the whole search (hours)
    python scripts/recipe_search.py --variants gated,gated_certainty --budget 10
    python scripts/recipe_search.py --report-only                       # table and plot from what is done
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from mars.hardware import WAIT_POLICY, wait_policy_chosen
from mars.persistence import atomic_write_text
from mars.pipeline import Stages, complete_checkpoint, has_points, reuse_base_reference
from mars.training.config import check_train_overrides

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "conf" / "recipe_search.yaml"


def load_search(path: Path, args) -> dict[str, Any]:
    spec = yaml.safe_load(path.read_text())
    names = [v["name"] for v in spec["variants"]]
    if len(set(names)) != len(names):
        raise SystemExit(f"{path}: variant names must be unique, got {names}")
    if args.variants:
        wanted = args.variants.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise SystemExit(f"unknown variant(s) {unknown}; {path} defines {names}")
        spec["variants"] = [v for v in spec["variants"] if v["name"] in wanted]
    if args.budget is not None:
        spec["budget_minutes"] = args.budget
    if args.limit is not None:
        spec["limit"] = args.limit
    if not spec["budget_minutes"] or spec["budget_minutes"] <= 0:
        raise SystemExit(f"the budget must be > 0 minutes, got {spec['budget_minutes']}")
    return spec


def eval_command(target: list[str], out: Path, spec: dict, extra: list[str]) -> list[str]:
    return [
        "evaluate.py",
        *target,
        "benchmarks=quality",
        "dtype=float32",
        f"limit={spec['limit']}",
        f"output_dir={out}",
        *extra,
    ]


def equal_compute_env() -> dict[str, str]:
    """The training stages' OpenMP wait: spinning threads would count as compute on the CPU clock, so idle
    threads sleep (``OMP_WAIT_POLICY=PASSIVE``) unless the caller chose a policy."""
    return {} if wait_policy_chosen() else {"OMP_WAIT_POLICY": WAIT_POLICY}


def train_overrides(variant: dict, work: Path, spec: dict) -> list[str]:
    """The Hydra overrides of a variant's training stage (``python train.py <these>``)."""
    return [
        *spec["common"],
        *variant["overrides"],
        f"budget.minutes={spec['budget_minutes']}",
        f"budget.clock={spec['clock']}",
        f"run_name=rs-{variant['name']}",
        f"output_dir={work / variant['name'] / 'train'}",
    ]


def check_variants(spec: dict, work: Path) -> None:
    """Compose every variant's training config and run train.py's own checks on it (config values, model source,
    data, a budget that holds a step) before the first stage: a bad override is refused now, naming its variant,
    not when the search reaches that variant hours later."""
    jobs = {f"{v['name']} ({' '.join(v['overrides'])})": train_overrides(v, work, spec) for v in spec["variants"]}
    check_train_overrides(jobs, REPO / "conf")


def run_variant(stages: Stages, variant: dict, work: Path, base_eval: Path, spec: dict) -> None:
    name = variant["name"]
    train_dir = work / name / "train"
    hf = train_dir / "hf"
    stages.run(
        f"{name}/train",
        ["train.py", *train_overrides(variant, work, spec)],
        done=complete_checkpoint(hf),
        env=equal_compute_env(),
    )
    thresholds = "[" + ",".join(str(t) for t in spec["thresholds"]) + "]"
    if is_gated(variant) and not stages.dry_run:
        reuse_base_reference(base_eval, work / name / "eval")
    stages.run(
        f"{name}/eval",
        eval_command(
            [f"checkpoint={hf}"], work / name / "eval", spec, [f"thresholds={thresholds}", f"compare=[{base_eval}]"]
        ),
        done=has_points(work / name / "eval", spec["thresholds"]),
    )
    stages.run(
        f"{name}/verify",
        eval_command(
            [f"checkpoint={hf}"],
            work / name / "verify",
            spec,
            ["decoding=mars_verified", "threshold=1.0", "reference=false", f"compare=[{base_eval}]"],
        ),
        done=has_points(work / name / "verify", [1.0]),
    )


def is_gated(variant: dict) -> bool:
    return "adapter=gated_lora" in variant["overrides"]


# ------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------
def _average(folder: Path, threshold: float) -> dict[str, Any] | None:
    path = folder / "points.json"
    if not path.is_file():
        return None
    for p in json.loads(path.read_text()):
        if p["task"] == "Average" and abs(float(p["threshold"]) - threshold) < 1e-9:
            return p
    return None


def _ci(p: dict | None, key: str, scale: float = 1.0, digits: int = 2) -> str:
    if p is None or p.get(key) is None:
        return "–"
    lo, hi = p.get(f"{key}_lo"), p.get(f"{key}_hi")
    value = f"{p[key] * scale:.{digits}f}"
    if lo is None or hi is None:
        return value
    return f"{value} [{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]"


def variant_row(variant: dict, work: Path, spec: dict) -> dict[str, Any] | None:
    name = variant["name"]
    summary_path = work / name / "train" / "train_summary.json"
    if not (complete_checkpoint(work / name / "train" / "hf") and summary_path.is_file()):
        return None
    if not (has_points(work / name / "eval", spec["thresholds"]) and has_points(work / name / "verify", [1.0])):
        return None
    s = json.loads(summary_path.read_text())
    budget = s.get("budget") or {}
    steps = max(1, int(s["global_step"]))
    points = {t: _average(work / name / "eval", t) for t in spec["thresholds"]}
    verify = _average(work / name / "verify", 1.0)
    row: dict[str, Any] = {
        "variant": name,
        "lever": variant.get("lever", ""),
        "steps": s["global_step"],
        "tokens": s.get("tokens_seen"),
        "response_tokens": s.get("response_tokens_seen"),
        "budget_minutes": budget.get("used_minutes"),
        "cpu_s_per_step": round(60 * budget.get("used_minutes", 0) / steps, 2),
        "wall_s_per_step": s.get("seconds_per_step"),
        "final_mask_loss": (s.get("final") or {}).get("loss_mask"),
        "points": points,
        "verify": verify,
    }
    return row


def table(rows: list[dict], spec: dict) -> str:
    lows = [t for t in spec["thresholds"] if t < 1.0]
    head = [
        "variant",
        "steps",
        "tokens (resp.)",
        "CPU s/step",
        "5-task avg, tau 1.0: vs base",
    ]
    for t in lows:
        head += [f"tok/fwd tau {t}", f"avg vs base, tau {t}", f"identical to tau 1 ({t})", f"mask fidelity ({t})"]
    head += ["verify tok/fwd", "verify avg vs base"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        p1 = r["points"][1.0]
        cells = [
            f"**{r['variant']}**",
            str(r["steps"]),
            f"{(r['tokens'] or 0) / 1e3:.0f}k ({(r['response_tokens'] or 0) / 1e3:.0f}k)",
            f"{r['cpu_s_per_step']:.1f}",
            _ci(p1, "compare_ar_delta", 100, 1),
        ]
        for t in lows:
            p = r["points"][t]
            cells += [
                _ci(p, "tokens_per_forward"),
                _ci(p, "compare_ar_delta", 100, 1),
                _ci(p, "agreement", 100, 0),
                _ci(p, "fidelity", 100, 1),
            ]
        cells += [_ci(r["verify"], "tokens_per_forward"), _ci(r["verify"], "compare_ar_delta", 100, 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def rows_csv(rows: list[dict], spec: dict) -> str:
    out = io.StringIO()
    fields = ["variant", "steps", "tokens", "response_tokens", "budget_minutes", "cpu_s_per_step", "wall_s_per_step"]
    fields.append("final_mask_loss")
    keys = ["tokens_per_forward", "compare_ar_delta", "agreement", "fidelity", "accuracy"]
    for t in spec["thresholds"]:
        fields += [f"{k}{suffix}@{t}" for k in keys for suffix in ("", "_lo", "_hi")]
    fields += [f"verify_{k}{suffix}" for k in keys for suffix in ("", "_lo", "_hi")]
    writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        flat = {k: r[k] for k in fields if k in r}
        for t, p in r["points"].items():
            for k in keys:
                for suffix in ("", "_lo", "_hi"):
                    flat[f"{k}{suffix}@{t}"] = (p or {}).get(f"{k}{suffix}")
        for k in keys:
            for suffix in ("", "_lo", "_hi"):
                flat[f"verify_{k}{suffix}"] = (r["verify"] or {}).get(f"{k}{suffix}")
        writer.writerow(flat)
    return out.getvalue()


def pareto_plot(rows: list[dict], spec: dict, path: Path) -> None:
    """Tokens per forward against the change of the 5-task average from the base model at tau 1.0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    markers = {t: m for t, m in zip([t for t in spec["thresholds"] if t < 1.0], "os^Dv")}
    for i, r in enumerate(rows):
        color = f"C{i % 10}"
        for t, marker in markers.items():
            p = r["points"][t]
            if not p or p.get("compare_ar_delta") is None:
                continue
            x, y = 100 * p["compare_ar_delta"], p["tokens_per_forward"]
            xerr = [[x - 100 * p["compare_ar_delta_lo"]], [100 * p["compare_ar_delta_hi"] - x]]
            yerr = [[y - p["tokens_per_forward_lo"]], [p["tokens_per_forward_hi"] - y]]
            ax.errorbar(
                x,
                y,
                xerr=xerr,
                yerr=yerr,
                fmt=marker,
                color=color,
                capsize=2,
                ms=6,
                label=r["variant"] if t == max(markers) else None,
            )
        v = r["verify"]
        if v and v.get("compare_ar_delta") is not None:
            ax.plot(100 * v["compare_ar_delta"], v["tokens_per_forward"], "*", color=color, ms=11)
    ax.axvline(0, color="grey", lw=0.8)
    ax.axvline(-1, color="grey", lw=0.8, ls=":")
    ax.axhline(1.5, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("5-task average: change from the base model at tau 1.0 (points; paired 95% interval)")
    ax.set_ylabel("tokens per forward per request (95% bootstrap interval)")
    ax.set_title(
        f"Equal compute ({spec['budget_minutes']} min each): "
        + ", ".join(f"{m} tau {t}" for t, m in markers.items())
        + ", * verify",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def report(spec: dict, work: Path, bench: Path, stages: Stages, base_eval: Path) -> None:
    bench.mkdir(parents=True, exist_ok=True)
    rows = [r for v in spec["variants"] if (r := variant_row(v, work, spec)) is not None]
    missing = [v["name"] for v in spec["variants"] if v["name"] not in {r["variant"] for r in rows}]
    for r in rows:
        src = work / r["variant"] / "train"
        for name in ("config.yaml", "losses.csv", "loss_curve.png", "train_summary.json"):
            if (src / name).is_file():
                shutil.copy(src / name, bench / f"{r['variant']}_{name}")
        for kind in ("eval", "verify"):
            if (work / r["variant"] / kind / "table.md").is_file():
                shutil.copy(work / r["variant"] / kind / "table.md", bench / f"{r['variant']}_{kind}_table.md")
    if (base_eval / "table.md").is_file():
        shutil.copy(base_eval / "table.md", bench / "base_table.md")
    atomic_write_text(bench / "table.csv", rows_csv(rows, spec))
    if rows:
        pareto_plot(rows, spec, bench / "pareto.png")
    variants = "\n".join(
        f"- **{v['name']}**: {v.get('lever', '')} (`{' '.join(v['overrides'])}`); evidence: {v.get('evidence', '')}"
        for v in spec["variants"]
    )
    text = [
        "# Equal-compute recipe search",
        "",
        f"Each variant: {spec['budget_minutes']} minutes of compute ({spec['clock']} clock) from the embedded "
        f"SmolLM2-135M on the same self-distilled answers (`{' '.join(spec['common'])}`), then the quality "
        f"suite ({spec['limit']} samples per task, fp32) at tau {spec['thresholds']} and in lossless verify mode. "
        "`vs base` is the paired change of the 5-task average from the untouched base model at tau 1.0 "
        "(points, 95% paired bootstrap interval); tok/fwd per request with its bootstrap interval; *identical* "
        "= outputs identical to the same checkpoint's tau 1.0 output; *mask fidelity* = share of mask-accepted "
        "tokens equal to the model's own greedy choice. Gated variants reuse the base's tau 1.0 samples as "
        "their reference point (bit-identical by construction, tested). Produced by `python scripts/recipe_search.py`; "
        "commands in commands.md, stage times in stages.json.",
        "",
        table(rows, spec),
        "Pareto plot: pareto.png. Per-variant tables: `<variant>_eval_table.md`, `<variant>_verify_table.md`; "
        "loss curves `<variant>_loss_curve.png`.",
        "",
        "## Variants",
        "",
        variants,
        "",
    ]
    if missing:
        text += [f"Not in the table yet (stages unfinished): {', '.join(missing)}", ""]
    atomic_write_text(bench / "README.md", "\n".join(text))
    stages.write_commands(bench / "commands.md", "Commands run by scripts/recipe_search.py")
    print(f"report: {bench / 'README.md'} ({len(rows)} variants)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(CONFIG))
    p.add_argument("--variants", help="comma-separated subset of the config's variants")
    p.add_argument("--budget", type=float, help="minutes of compute per variant (default: the config's)")
    p.add_argument("--limit", type=int, help="samples per quality task (default: the config's)")
    p.add_argument("--work", default=str(REPO / "outputs" / "recipe_search"))
    p.add_argument("--out", default=str(REPO / "results" / "recipe_search"))
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    spec = load_search(Path(args.config), args)
    work, bench = Path(args.work), Path(args.out)
    if not args.report_only:  # a report of finished outputs does not need today's configs to compose
        check_variants(spec, work)
    # --report-only walks the stages without running them, so commands.md still lists every variant's commands
    stages = Stages(bench, args.dry_run or args.report_only, REPO)
    base_eval = work / "base" / "eval"
    stages.run(
        "base/eval",
        eval_command(
            # checkpoint=null: the model as it is, not its shipped MARS checkpoint
            [f"model={spec.get('base', 'smollm2-135m')}", "checkpoint=null"],
            base_eval,
            spec,
            ["threshold=1.0", "reference=false"],
        ),
        done=has_points(base_eval, [1.0]),
    )
    for variant in spec["variants"]:
        run_variant(stages, variant, work, base_eval, spec)
    if args.dry_run:
        print("\n".join(stages.commands))
        return 0
    report(spec, work, bench, stages, base_eval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
