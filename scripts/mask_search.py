#!/usr/bin/env python
"""Masks trained for acceptance: the variants of ``conf/mask_search.yaml`` at an equal number of optimizer steps,
each measured the way lossless verify and the calibrated thresholds use its masks.

Per variant (``outputs/mask_search/<variant>/``, every stage skipped when its result exists):

1. train      python train.py <common> <overrides> trainer.max_steps=<steps>   (a gated adapter, resumable)
2. rank       the adapter cut to rank 8 (python -m mars.training.adapter_rank)
3. calibrate  one temperature per depth and the draft acceptance table (mars-bench calibrate)
4. spec       verify with each layout of ``trees`` on the held-out prompts (mars-bench spec): mean accepted
              tokens, tokens per forward, outputs identical to greedy AR
5. probe      tokens per forward and fidelity of mask-accepted tokens at the calibrated thresholds on prompts
              used neither for fitting nor for ECE (mars-bench probe)
6. eval       the quality suite at the thresholds against the untouched base (the lossy frontier)
7. publish    results/mask_search/<variant>/: the calibrated rank-8 adapter, figures.json, the learning curve,
              the configs and raw tables; figures.json is written last and marks the variant as done

The trained adapter and its learning curve are published as soon as stage 2 ends (the first piece to commit); a
variant published that far is measured elsewhere without training again.

A published variant is skipped as a whole, so the search continues on any machine from what is committed:

    nohup python scripts/mask_search.py > outputs/mask_search.log 2>&1 &   # every unpublished variant (hours)
    python scripts/mask_search.py --variants soft                          # one variant
    python scripts/mask_search.py --long soft                              # the winner's longer run
    python scripts/mask_search.py --report-only                            # README and plots from what is published
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from mars.hardware import WAIT_POLICY, describe, wait_policy_chosen
from mars.persistence import atomic_write_text
from mars.pipeline import Stages, complete_checkpoint, has_points, reuse_base_reference
from mars.training.budget import CLOCKS
from mars.training.config import check_train_overrides

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "conf" / "mask_search.yaml"
FIGURES = "figures.json"
ADAPTER_FILES = (
    "adapter_config.json",
    "adapter_model.safetensors",
    "chat_template.jinja",
    "mars_adapter.json",
    "mars_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def load_spec(path: Path, variants: str | None, long: str | None) -> dict[str, Any]:
    spec = yaml.safe_load(path.read_text())
    names = [v["name"] for v in spec["variants"]]
    if len(set(names)) != len(names):
        raise SystemExit(f"{path}: variant names must be unique, got {names}")
    for key in ("steps", "rank"):
        if not isinstance(spec.get(key), int) or spec[key] < 1:
            raise SystemExit(f"{path}: {key} must be a positive integer, got {spec.get(key)!r}")
    minutes = spec.get("long_minutes")
    if isinstance(minutes, bool) or not isinstance(minutes, int | float) or minutes <= 0:
        raise SystemExit(f"{path}: long_minutes must be a positive number of minutes, got {minutes!r}")
    if spec.get("long_clock") not in CLOCKS:
        raise SystemExit(f"{path}: long_clock must be one of {CLOCKS}, got {spec.get('long_clock')!r}")
    for v in spec["variants"]:
        v["steps"] = spec["steps"]
    if long:
        if long not in names:
            raise SystemExit(f"--long {long}: not a variant of {path} ({', '.join(names)})")
        chosen = dict(next(v for v in spec["variants"] if v["name"] == long))
        lever = f"{chosen['lever']} (longer run: {spec['long_minutes']} minutes, {spec['long_clock']} clock)"
        chosen.update(name=f"{long}_long", steps=None, minutes=spec["long_minutes"], lever=lever)
        chosen["clock"] = spec["long_clock"]
        spec["variants"].append(chosen)
        variants = chosen["name"]
    if variants:
        wanted = variants.split(",")
        unknown = sorted(set(wanted) - {v["name"] for v in spec["variants"]})
        if unknown:
            raise SystemExit(f"unknown variant(s) {unknown}; {path} defines {names}")
        spec["selected"] = [v for v in spec["variants"] if v["name"] in wanted]
    else:
        spec["selected"] = [v for v in spec["variants"] if not v["name"].endswith("_long")]
    return spec


def train_overrides(variant: dict, work: Path, spec: dict) -> list[str]:
    """The Hydra overrides of a variant's training stage (``python train.py <these>``): a compared variant trains
    for the search's number of steps, the longer run for a compute budget (``long_minutes`` on ``long_clock``), so
    that it fits a session on whatever machine it runs on."""
    minutes = variant.get("minutes")
    length = [f"budget.minutes={minutes}", f"budget.clock={variant.get('clock')}", "trainer.max_steps=-1"]
    if not minutes:
        length = ["budget.minutes=null", f"trainer.max_steps={variant['steps']}"]
    return [
        *spec["common"],
        *variant["overrides"],
        *length,
        f"run_name=ms-{variant['name']}",
        f"output_dir={work / variant['name'] / 'train'}",
    ]


def check_variants(spec: dict, work: Path) -> None:
    """Compose and validate every selected variant's training config now, not hours later."""
    jobs = {f"{v['name']} ({' '.join(v['overrides'])})": train_overrides(v, work, spec) for v in spec["selected"]}
    check_train_overrides(jobs, REPO / "conf")


def quality_command(target: list[str], out: Path, spec: dict, extra: list[str]) -> list[str]:
    return [
        "evaluate.py",
        *target,
        "benchmarks=quality",
        "dtype=float32",
        f"limit={spec['quality_limit']}",
        f"output_dir={out}",
        "verify.enabled=false",  # the spec stage measures verify, on every layout compared
        *extra,
    ]


def calibrated(folder: Path) -> bool:
    path = folder / "mars_config.json"
    if not path.is_file():
        return False
    meta = json.loads(path.read_text())
    return bool(meta.get("calibration")) and bool(meta.get("draft_acceptance"))


def tree_folder(tree: str) -> str:
    return tree.replace(",", "-")


def run_variant(stages: Stages, variant: dict, work: Path, results: Path, base_eval: Path, spec: dict) -> Path:
    name = variant["name"]
    root = work / name
    hf, cut = root / "train" / "hf", root / f"rank{spec['rank']}"
    env = {} if wait_policy_chosen() else {"OMP_WAIT_POLICY": WAIT_POLICY}
    trained = not stages.dry_run and restore_training(variant, work, results, spec)
    train = ["train.py", *train_overrides(variant, work, spec)]
    stages.run(f"{name}/train", train, done=trained or complete_checkpoint(hf), env=env)
    rank_cmd = ["-m", "mars.training.adapter_rank", str(hf), str(cut), "--rank", str(spec["rank"])]
    stages.run(f"{name}/rank", rank_cmd, done=(cut / "adapter_model.safetensors").is_file())
    if not stages.dry_run:
        publish_training(variant, work, results, spec)
    bench = ["-m", "mars.bench"]
    calibrate = [*bench, "calibrate", "--checkpoint", str(cut), "--limit", str(spec["calibrate_prompts"])]
    stages.run(f"{name}/calibrate", calibrate, done=calibrated(cut))
    for tree in spec["trees"]:
        out = root / "spec" / tree_folder(tree)
        cmd = [*bench, "spec", "--checkpoint", str(cut), "--limit-per-category", str(spec["spec_per_category"])]
        cmd += ["--repeats", "1", "--max-new-tokens", str(spec["max_new_tokens"]), "--tree", tree, "--out", str(out)]
        stages.run(f"{name}/spec-{tree_folder(tree)}", cmd, done=(out / "spec.csv").is_file())
    thresholds = ",".join(str(t) for t in spec["thresholds"])
    probe = [*bench, "probe", "--checkpoint", str(cut), "--prompts", str(REPO / spec["unseen_prompts"])]
    probe += ["--n", str(spec["unseen_n"]), "--thresholds", thresholds, "--max-new-tokens", str(spec["max_new_tokens"])]
    stages.run(f"{name}/probe", [*probe, "--out", str(root / "probe.json")], done=(root / "probe.json").is_file())
    if not stages.dry_run:
        reuse_base_reference(base_eval, root / "eval")
    stages.run(
        f"{name}/eval",
        quality_command(
            [f"checkpoint={cut}"], root / "eval", spec, [f"thresholds=[{thresholds}]", f"compare=[{base_eval}]"]
        ),
        done=has_points(root / "eval", spec["thresholds"]),
    )
    return cut


# ------------------------------------------------------------------------------------------
# The figures of one variant
# ------------------------------------------------------------------------------------------
def _overall(spec_csv: Path) -> dict[str, Any]:
    rows = list(csv.DictReader(spec_csv.open()))
    row = rows[-1]  # the aggregate row comes last
    return {
        "prompts": int(row["prompts"]),
        "mean_acceptance_length": float(row["mean_acceptance_length"]),
        "tokens_per_forward": float(row["tokens_per_forward"]),
        "draft_acceptance_rate": float(row["draft_acceptance_rate"]),
        "identical_outputs": int(row["identical_outputs"]),
    }


def _average(points_json: Path, threshold: float) -> dict[str, Any] | None:
    for p in json.loads(points_json.read_text()):
        if p["task"] == "Average" and abs(float(p["threshold"]) - threshold) < 1e-9:
            keep = ("tokens_per_forward", "compare_ar_delta", "agreement", "fidelity", "accuracy")
            return {k: p.get(k) for k in keep} | {f"{k}_{s}": p.get(f"{k}_{s}") for k in keep for s in ("lo", "hi")}
    return None


def figures(variant: dict, work: Path, spec: dict) -> dict[str, Any]:
    root = work / variant["name"]
    cut = root / f"rank{spec['rank']}"
    summary = json.loads((root / "train" / "train_summary.json").read_text())
    meta = json.loads((cut / "mars_config.json").read_text())
    table = meta["draft_acceptance"]["conditional"]
    probe = json.loads((root / "probe.json").read_text())["results"]
    return {
        "variant": variant["name"],
        "lever": variant.get("lever", ""),
        "overrides": variant["overrides"],
        "steps": summary["global_step"],
        "tokens": summary.get("tokens_seen"),
        "seconds_per_step": summary.get("seconds_per_step"),
        "cpu_seconds_per_step": round(summary["cpu_seconds"] / summary["global_step"], 2)
        if summary.get("cpu_seconds")
        else None,
        "final": summary.get("final"),
        "rank": spec["rank"],
        "depth1_top1": table[0][0],
        "depth1_top2": table[0][1],
        "depth2_top1": table[1][0] if len(table) > 1 else None,
        "draft_acceptance": table,
        "temperatures": meta["calibration"]["temperatures"],
        "ece_after": meta["calibration"].get("ece_after"),
        "verify": {tree: _overall(root / "spec" / tree_folder(tree) / "spec.csv") for tree in spec["trees"]},
        "unseen": [
            {k: r[k] for k in ("threshold", "tokens_per_forward", "mask_fidelity", "identical_to_tau_1")} for r in probe
        ],
        "quality": {str(t): _average(root / "eval" / "points.json", t) for t in spec["thresholds"]},
        "machine": describe(),
        "finished": time.strftime("%Y-%m-%d"),
    }


TRAINING_FILES = ("losses.csv", "loss_curve.png", "config.yaml", "train_summary.json")


def publish_training(variant: dict, work: Path, results: Path, spec: dict) -> None:
    """The first finished piece of a variant: its rank-cut adapter (before calibration) and its learning curve, so
    that a search stopped after training continues elsewhere from the measurements."""
    root, out = work / variant["name"], results / variant["name"]
    if (out / "adapter" / "adapter_model.safetensors").is_file():
        return
    (out / "adapter").mkdir(parents=True, exist_ok=True)
    for name in TRAINING_FILES:
        if (root / "train" / name).is_file():
            shutil.copy(root / "train" / name, out / name)
    cut = root / f"rank{spec['rank']}"
    for name in ADAPTER_FILES:
        if (cut / name).is_file():
            shutil.copy(cut / name, out / "adapter" / name)
    print(f"published the trained adapter of {variant['name']} in {out}", flush=True)


def restore_training(variant: dict, work: Path, results: Path, spec: dict) -> bool:
    """A variant whose trained adapter is published but not yet measured: its adapter and training records are
    copied back into the work folder (no training again); True when the training is thereby done."""
    root, out = work / variant["name"], results / variant["name"]
    cut = root / f"rank{spec['rank']}"
    if (cut / "adapter_model.safetensors").is_file():
        return (root / "train" / "train_summary.json").is_file()
    if not (out / "adapter" / "adapter_model.safetensors").is_file() or not (out / "train_summary.json").is_file():
        return False
    shutil.copytree(out / "adapter", cut)
    (root / "train").mkdir(parents=True, exist_ok=True)
    for name in TRAINING_FILES:
        if (out / name).is_file():
            shutil.copy(out / name, root / "train" / name)
    print(f"=== {variant['name']}: trained adapter restored from {out}", flush=True)
    return True


def publish(variant: dict, work: Path, results: Path, spec: dict) -> None:
    """Copy the variant's small results into the results folder; figures.json last (the variant's done mark)."""
    root, out = work / variant["name"], results / variant["name"]
    cut = root / f"rank{spec['rank']}"
    adapter = out / "adapter"
    adapter.mkdir(parents=True, exist_ok=True)
    for name in ADAPTER_FILES:
        if (cut / name).is_file():
            shutil.copy(cut / name, adapter / name)
    for name in TRAINING_FILES:
        if (root / "train" / name).is_file():
            shutil.copy(root / "train" / name, out / name)
    shutil.copy(root / "probe.json", out / "probe_unseen.json")
    for tree in spec["trees"]:
        shutil.copy(root / "spec" / tree_folder(tree) / "spec.csv", out / f"spec_{tree_folder(tree)}.csv")
    for name in ("points.csv", "table.md"):
        if (root / "eval" / name).is_file():
            shutil.copy(root / "eval" / name, out / f"quality_{name}")
    atomic_write_text(out / FIGURES, json.dumps(figures(variant, work, spec), indent=2) + "\n")
    print(f"published {out}", flush=True)


# ------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _interval(p: dict | None, key: str, scale: float = 1.0, digits: int = 2) -> str:
    if not p or p.get(key) is None:
        return "–"
    text = f"{p[key] * scale:.{digits}f}"
    lo, hi = p.get(f"{key}_lo"), p.get(f"{key}_hi")
    return text if lo is None or hi is None else f"{text} [{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]"


COMPARED_TREES = ("chain", "1")  # the layouts whose mean accepted tokens decide the winner
REFERENCE = "reference"
GAIN_TARGET = 0.10  # the gain in mean accepted tokens over the reference that the search looks for
NEAR_TIE = 0.01  # winners this close on accepted tokens are told apart by quality at the lowest threshold


def _reference(rows: list[dict]) -> dict | None:
    return next((r for r in rows if r["variant"] == REFERENCE), None)


def _accepted(row: dict) -> float:
    return sum(row["verify"][t]["mean_acceptance_length"] for t in COMPARED_TREES) / len(COMPARED_TREES)


def reference_table(results: Path, tree: str, prompts: int) -> Path | None:
    """The reference recipe's spec table with a layout on ``prompts`` prompts: the search's own run, or its
    re-measurement on more prompts (``verify48/``), so that a row is only ever compared on the same prompts."""
    for path in (results / REFERENCE / f"spec_{tree_folder(tree)}.csv",
                 results / "verify48" / f"{REFERENCE}_{tree_folder(tree)}.csv"):  # fmt: skip
        if path.is_file() and _overall(path)["prompts"] == prompts:
            return path
    return None


def comparable(row: dict, results: Path) -> bool:
    """Whether the reference was measured on the row's prompts with every compared layout (and is not the row)."""
    return row["variant"] != REFERENCE and all(
        reference_table(results, t, row["verify"][t]["prompts"]) is not None for t in COMPARED_TREES
    )


def gains(row: dict, results: Path) -> str:
    """Mean accepted tokens with each compared layout, relative to the reference recipe's on the same prompts."""
    if not comparable(row, results):
        return "–"
    parts = []
    for t in COMPARED_TREES:
        theirs = _overall(reference_table(results, t, row["verify"][t]["prompts"]))["mean_acceptance_length"]
        parts.append(f"{100 * (row['verify'][t]['mean_acceptance_length'] / theirs - 1):+.1f}%")
    return " / ".join(parts)


def _category_accepted(table: Path) -> dict[str, float]:
    rows = list(csv.DictReader(table.open()))
    return {r["category"]: float(r["mean_acceptance_length"]) for r in rows[:-1]}  # the aggregate row comes last


def gain_interval(results: Path, variant: str, tree: str, resamples: int = 4000) -> tuple[float, float, float, int]:
    """The change of mean accepted tokens from the reference, paired by prompt category (the mean over categories
    of each, the same prompts in both): the point, a 95% bootstrap interval over the categories, their number."""
    import numpy as np

    table = results / variant / f"spec_{tree_folder(tree)}.csv"
    ours = _category_accepted(table)
    theirs = _category_accepted(reference_table(results, tree, _overall(table)["prompts"]))
    shared = sorted(set(ours) & set(theirs))
    a, b = np.array([ours[c] for c in shared]), np.array([theirs[c] for c in shared])
    picks = np.random.default_rng(0).integers(0, len(shared), size=(resamples, len(shared)))
    ratios = a[picks].mean(1) / b[picks].mean(1) - 1
    interval = np.quantile(ratios, [0.025, 0.975])
    return float(a.mean() / b.mean() - 1), float(interval[0]), float(interval[1]), len(shared)


def paired_gains(results: Path, variant: str) -> tuple[str, int]:
    """:func:`gain_interval` with each compared layout, as text, and the number of categories paired."""
    parts, categories = [], 0
    for t in COMPARED_TREES:
        mid, lo, hi, categories = gain_interval(results, variant, t)
        parts.append(f"`{t}` {100 * mid:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}]")
    return "; ".join(parts), categories


def winner(rows: list[dict], spec: dict) -> dict | None:
    """The compared variant with the most mean accepted tokens over the compared layouts; within
    :data:`NEAR_TIE` of it, the one that loses least quality at the lowest threshold."""
    compared = [r for r in rows if not r["variant"].endswith("_long")]
    if not compared:
        return None
    best = max(_accepted(r) for r in compared)
    near = [r for r in compared if _accepted(r) >= best * (1 - NEAR_TIE)]
    lowest = str(min(spec["thresholds"]))

    def quality(r: dict) -> float:
        q = r["quality"].get(lowest) or {}
        return q.get("compare_ar_delta") if q.get("compare_ar_delta") is not None else float("-inf")

    return max(near, key=lambda r: (quality(r), _accepted(r)))


def comparison_table(rows: list[dict], spec: dict, results: Path) -> str:
    trees = spec["trees"]
    head = ["variant", "steps", "depth-1 top-1", "depth-1 top-2", "depth-2 top-1"]
    head += [f"verify `{t}`: accepted (tok/fwd)" for t in trees]
    head += ["identical", f"accepted vs {REFERENCE} ({' / '.join(f'`{t}`' for t in COMPARED_TREES)})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"**{r['variant']}**", str(r["steps"]), _pct(r["depth1_top1"]), _pct(r["depth1_top2"])]
        cells.append(_pct(r["depth2_top1"]))
        cells += [
            f"{r['verify'][t]['mean_acceptance_length']:.2f} ({r['verify'][t]['tokens_per_forward']:.2f})"
            for t in trees
        ]
        cells.append(", ".join(f"{r['verify'][t]['identical_outputs']}/{r['verify'][t]['prompts']}" for t in trees))
        cells.append(gains(r, results))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def frontier_table(rows: list[dict], spec: dict) -> str:
    lows = [t for t in spec["thresholds"] if t < 1.0]
    head = ["variant"]
    for t in lows:
        head += [f"tau {t}: tok/fwd", "quality vs base (points)", "fidelity (suite)", "fidelity (unseen)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"**{r['variant']}**"]
        unseen = {float(u["threshold"]): u for u in r["unseen"]}
        for t in lows:
            q = r["quality"].get(str(t))
            cells += [
                _interval(q, "tokens_per_forward"),
                _interval(q, "compare_ar_delta", 100, 1),
                _interval(q, "fidelity", 100, 1),
                _pct((unseen.get(t) or {}).get("mask_fidelity")),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def learning_curves(results: Path, rows: list[dict]) -> None:
    """Each variant's mask loss per step, one panel per kind of target (cross-entropy and KL do not share a
    scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    soft = [r for r in rows if any("soft" in o for o in r["overrides"])]
    hard = [r for r in rows if r not in soft]
    panels = [(title, group) for title, group in (("data targets (CE)", hard), ("soft targets (KL)", soft)) if group]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (title, group) in zip(axes[0], panels):
        for r in group:
            steps, losses = [], []
            for row in csv.DictReader((results / r["variant"] / "losses.csv").open()):
                if row.get("loss_mask"):
                    steps.append(int(row["step"]))
                    losses.append(float(row["loss_mask"]))
            window = 20
            smooth = [
                sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1])
                for i in range(len(losses))
            ]
            ax.plot(steps, smooth, label=r["variant"])
        ax.set_title(f"mask loss, {title}; mean of the last 20 steps", fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(results / "learning_curves.png", dpi=120)
    plt.close(fig)


def winner_lines(rows: list[dict], spec: dict, results: Path) -> list[str]:
    best = winner(rows, spec)
    if best is None:
        return []
    reference = _reference(rows)
    name = best["variant"]
    lines = [
        f"**Winner at equal steps: {name}** (accepted tokens vs {REFERENCE}, "
        f"{' / '.join(f'`{t}`' for t in COMPARED_TREES)}: {gains(best, results)}; the most mean accepted tokens "
        f"over those layouts, a tie within {100 * NEAR_TIE:.0f}% going to the smaller quality loss at tau "
        f"{min(spec['thresholds'])})."
    ]
    if reference is not None and best is not reference:
        paired, categories = paired_gains(results, name)
        lines.append(
            f"Paired by prompt category (the mean of the {categories} category means, 95% bootstrap interval over "
            f"the categories): {paired}; the target is +{100 * GAIN_TARGET:.0f}% on both."
        )
    long = next((r for r in rows if r["variant"] == f"{name}_long"), None)
    if long is not None and reference is not None and comparable(long, results):
        lines.append(
            f"Its longer run ({long['steps']} steps, {long['steps'] / reference['steps']:.1f}x the compared "
            f"compute) against the reference recipe on the same {long['verify'][COMPARED_TREES[0]]['prompts']} "
            f"prompts, paired by category: {paired_gains(results, long['variant'])[0]}."
        )
    if long is None:
        lines.append(
            f"Its longer run ({spec['long_minutes']} minutes, {spec['long_clock']} clock): "
            f"`python scripts/mask_search.py --long {name}`."
        )
    return [*lines, ""]


def report(spec: dict, results: Path) -> None:
    compared = [v["name"] for v in spec["variants"] if not v["name"].endswith("_long")]
    names = [*compared, *(f"{name}_long" for name in compared)]  # a published longer run, whichever command ran
    rows = [json.loads((results / n / FIGURES).read_text()) for n in names if (results / n / FIGURES).is_file()]
    missing = [n for n in compared if not (results / n / FIGURES).is_file()]
    if rows:
        learning_curves(results, rows)
    machines = sorted({f"{r['machine'].get('cpu')} ({r['machine'].get('cpu_capability')})" for r in rows})
    text = [
        "# Masks trained for acceptance",
        "",
        f"**Machines: {'; '.join(machines) or '–'}; fp32 measurement, torch CPU.**",
        "",
        "What it compares: ways of teaching the masks of a gated adapter on the embedded SmolLM2-135M, at an "
        f"equal number of optimizer steps ({spec['steps']} per variant: the same forwards, only the mask "
        "loss differs, so the comparison does not depend on the machine's load), each cut to rank "
        f"{spec['rank']} and calibrated before it is measured. Produced by `python scripts/mask_search.py` "
        "(conf/mask_search.yaml); each variant's folder holds its calibrated adapter, `figures.json`, its "
        "learning curve (`losses.csv`, `loss_curve.png`), its training config and the raw tables.",
        "",
        "## Lossless verify and the masks' acceptance",
        "",
        "Verify on the first held-out prompts of each category (`data/prompts/heldout.jsonl`, 8 categories, "
        f"{spec['max_new_tokens']} new tokens, batch 1, greedy): mean accepted tokens per draft step (vLLM's mean "
        "acceptance length) and tokens per forward; *identical*: outputs equal to greedy AR, out of the run's "
        "prompts. "
        "Depth-k top-j: teacher-forced share of steps whose greedy token is among the depth's top j, given the "
        f"earlier depths' were (the calibration pass, {spec['calibrate_prompts']} held-out prompts).",
        "",
        comparison_table(rows, spec, results),
        "## The lossy frontier at calibrated thresholds",
        "",
        f"Quality suite ({spec['quality_limit']} samples per task, fp32): tokens per forward and the paired change "
        "of the 5-task average from the untouched base at tau 1.0 (95% intervals); fidelity: the share of "
        "mask-accepted tokens equal to the model's own greedy choice, on the suite and on "
        f"{spec['unseen_n']} prompts used neither to fit the temperatures nor to measure ECE "
        f"(`{spec['unseen_prompts']}`). A calibrated tau keeps its word when the unseen fidelity is near tau.",
        "",
        frontier_table(rows, spec),
        "Learning curves: learning_curves.png (and each variant's loss_curve.png)."
        + (
            " A depth-weighted mask loss (`depth_weighting`) counts the later depths less, so its curve lies lower by"
            " construction: compare the curves' shapes, not their levels."
            if any("depth_weighting" in o for r in rows for o in r["overrides"])
            else ""
        ),
        "",
        "## Variants",
        "",
        *[f"- **{v['name']}**: {v.get('lever', '')} (`{' '.join(v['overrides'])}`)" for v in spec["variants"]],
        "",
    ]
    if (results / "verify48" / "README.md").is_file():
        text += ["On three times the prompts: [verify48/README.md](verify48/README.md).", ""]
    if missing:
        text += [f"Not measured yet: {', '.join(missing)} (`python scripts/mask_search.py` continues).", ""]
    else:
        text += winner_lines(rows, spec, results)
    atomic_write_text(results / "README.md", "\n".join(text))
    print(f"report: {results / 'README.md'} ({len(rows)} variants)", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(CONFIG))
    p.add_argument("--variants", help="comma-separated subset of the config's variants")
    p.add_argument("--long", metavar="VARIANT", help="the longer run of one variant (long_minutes), as <variant>_long")
    p.add_argument("--work", default=str(REPO / "outputs" / "mask_search"))
    p.add_argument("--results", default=str(REPO / "results" / "mask_search"))
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    spec = load_spec(Path(args.config), args.variants, args.long)
    work, results = Path(args.work), Path(args.results)
    if args.report_only:
        report(spec, results)
        return 0
    todo = [v for v in spec["selected"] if not (results / v["name"] / FIGURES).is_file()]
    for v in spec["selected"]:
        if v not in todo:
            print(f"=== {v['name']}: published in {results / v['name']}, skipped", flush=True)
    check_variants({**spec, "selected": todo}, work)
    stages = Stages(work, args.dry_run, REPO)
    base_eval = work / "base" / "eval"
    if todo:
        thresholds = ["threshold=1.0", "reference=false"]
        base = quality_command([f"model={spec['base']}", "checkpoint=null"], base_eval, spec, thresholds)
        stages.run("base/eval", base, done=has_points(base_eval, [1.0]))
    for variant in todo:
        run_variant(stages, variant, work, results, base_eval, spec)
        if not args.dry_run:
            publish(variant, work, results, spec)
            report(spec, results)
    if args.dry_run:
        print("\n".join(stages.commands))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
