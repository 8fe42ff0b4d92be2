"""Send an evaluation's points, table and plots to Weights & Biases.

Offline (``WANDB_MODE=offline``, sync later with ``wandb sync``) unless credentials exist, so it never
prompts; see ``mars.logs.wandb_mode``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from mars.evaluation.aggregate import FIELDS, INTERVAL_KEYS, is_verify
from mars.evaluation.config import Plan
from mars.evaluation.report import fmt_threshold
from mars.evaluation.store import ResultsDir

log = logging.getLogger(__name__)


def log_to_wandb(
    plan: Plan,
    store: ResultsDir,
    points: list[dict[str, Any]],
    table_md: str,
    plots: list[Path],
    logger_cfg: dict[str, Any] | None = None,
    save_dir: str | os.PathLike | None = None,
):
    """One W&B run per results folder: a ``points`` table, metrics per threshold (x axis = threshold
    step in sweep order), the markdown table and the Pareto PNGs.  Returns the finished run's directory."""
    import wandb

    from mars.logs import wandb_sync_hint

    run = _start_run(plan, store, dict(logger_cfg or {}), save_dir)
    columns = list(FIELDS)
    run.log({"points": wandb.Table(columns=columns, data=[[p.get(c) for c in columns] for p in points])})
    _log_threshold_metrics(run, points)
    run.log({"table": wandb.Html(f"<pre>{_escape(table_md)}</pre>")})
    images = [path for path in plots if path.suffix == ".png"]  # W&B shows images; pdf/svg stay in the folder
    run.log({f"pareto/{path.stem.removeprefix('pareto_')}": wandb.Image(str(path)) for path in images})
    for p in points:
        if p.get("task") == "Average" and not is_verify(p):
            run.summary[f"average/accuracy@{fmt_threshold(p['threshold'])}"] = p["accuracy"]
            run.summary[f"average/tokens_per_forward@{fmt_threshold(p['threshold'])}"] = p["tokens_per_forward"]
    run_dir = Path(run.dir).parent
    hint = wandb_sync_hint(run)
    run.finish()
    if hint:
        log.info(hint)
    return run_dir


def _start_run(plan: Plan, store: ResultsDir, cfg: dict[str, Any], save_dir: str | os.PathLike | None):
    """The W&B run named after the results folder, offline unless credentials exist (never a prompt)."""
    import wandb

    from mars.logs import wandb_mode

    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(
        project=cfg.get("project") or "mars",
        entity=cfg.get("entity"),
        group=cfg.get("group"),
        tags=list(cfg.get("tags") or []) + ["evaluate"],
        name=store.root.name,
        dir=str(save_dir or store.root),
        mode=wandb_mode(cfg.get("mode", "auto")),
        config={"fingerprint": plan.fingerprint, "thresholds": plan.thresholds},
        job_type="evaluate",
        reinit="finish_previous",
    )


def _log_threshold_metrics(run, points: list[dict[str, Any]]) -> None:
    """Every task's figures as metrics plotted against the threshold, one log step per threshold (highest first)."""
    from mars.evaluation.plots import slug

    run.define_metric("threshold")
    # metric keys from task labels such as "Math (ASDiv)": no spaces or brackets ("math_asdiv/accuracy")
    for task in dict.fromkeys(slug(p["task"]) for p in points):
        run.define_metric(f"{task}/*", step_metric="threshold")  # plot every task metric against the threshold
    # every figure with its 95% interval (``<key>_lo``/``<key>_hi``), plus throughput
    keys = [k for base in INTERVAL_KEYS for k in (base, f"{base}_lo", f"{base}_hi")] + ["tokens_per_second", "n_paired"]
    for thr in sorted({p["threshold"] for p in points}, reverse=True):
        metrics: dict[str, Any] = {"threshold": thr}
        for p in points:
            if p["threshold"] != thr or is_verify(p):  # the verify point's figures: in the points table
                continue
            for key in keys:
                if isinstance(p.get(key), (int, float)) and not isinstance(p.get(key), bool):
                    metrics[f"{slug(p['task'])}/{key}"] = p[key]
        run.log(metrics)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
