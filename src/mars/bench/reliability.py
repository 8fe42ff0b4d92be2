"""How far a checkpoint's mask confidence can be trusted, and what a threshold can buy with it.

    mars-bench reliability --checkpoint outputs/train/<run>/hf --out reliability/
    mars-bench reliability --checkpoint snapshots/15min --checkpoint snapshots/60min --out curve/

Each held-out prompt is answered at threshold 1.0 (the model's own greedy text; a gated adapter's is its
base model's).  Then, in the training layout, every token of that text is masked and one forward per grid
offset scores the masks after every position: a block of masks starting at position ``s`` sees exactly
what a decoding step whose last real token is ``s - 1`` sees, so every step the greedy text could take is
scored at once, without decoding at any threshold below 1.0.  Per step it keeps each mask's confidence (the
probability of its argmax, the ``probability`` metric) and whether that argmax is the greedy token.

From these, per checkpoint:

- **reliability** per mask depth: confidence bins and how often the masks in each bin are right (a
  calibrated mask at confidence 0.9 is right 90% of the time; an overconfident one less);
- **the acceptance frontier**: per threshold, tokens per forward (1 + the run of leading masks at or above
  it) against fidelity (the share of those accepted that are right), each with a bootstrap interval over
  prompts, and the oracle (1 + the run of leading right masks: an acceptance rule that knew which masks are
  right, the most these masks can give at full fidelity);
- per fidelity target: the most tokens per forward a threshold buys while keeping at least that fidelity.

The steps follow the greedy text, so these are estimates of a decoder's figures at the same threshold (a
decoder also scores masks after its own wrongly accepted tokens); they need one forward per prompt and grid
offset, so comparing snapshots of a run takes minutes, not an evaluation each.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mars.bench import cli_options
from mars.evaluation.agreement import ratio_interval
from mars.paths import data_dir

BINS = (0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0)
THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.97, 0.99, 0.995, 0.999)
FIDELITY_TARGETS = (0.9, 0.95, 0.99)
DIAGRAM_MIN_MASKS = 20  # bins with fewer masks stay in the table but out of the diagram (their share is noise)


@dataclass(frozen=True)
class StepScores:
    """One row per decoding step the greedy text could take; one column per mask depth."""

    confidence: np.ndarray  # [steps, depths] probability of each mask's argmax (0 where no mask)
    correct: np.ndarray  # [steps, depths] bool: the argmax is the greedy token
    valid: np.ndarray  # [steps, depths] bool: the mask exists (not past the text's end)
    prompt: np.ndarray  # [steps] which prompt the step belongs to
    start: np.ndarray  # [steps] position of the step's first mask (its last real token is the one before)

    def __post_init__(self) -> None:
        if not (self.confidence.shape == self.correct.shape == self.valid.shape):
            raise ValueError("confidence, correct and valid must have one shape")
        if not (self.prompt.shape == self.start.shape == self.confidence.shape[:1]):
            raise ValueError("prompt and start must hold one value per step")

    @property
    def prompts(self) -> int:
        return int(np.unique(self.prompt).size)


def _leading(flags: np.ndarray) -> np.ndarray:
    """Per row, the mask of its leading run of True (``[steps, depths]`` bool)."""
    return np.cumprod(flags, axis=1).astype(bool)


def _per_prompt(steps: StepScores, values: np.ndarray) -> np.ndarray:
    """``values`` (one per step) summed per prompt, in prompt order."""
    _, index = np.unique(steps.prompt, return_inverse=True)
    return np.bincount(index, weights=values.astype(float))


def frontier_point(steps: StepScores, threshold: float) -> dict[str, Any]:
    """Tokens per forward and fidelity at one threshold (intervals: bootstrap over prompts)."""
    accepted = _leading((steps.confidence >= threshold) & steps.valid)
    run = accepted.sum(1)
    right = (accepted & steps.correct).sum(1)
    ones = np.ones(len(run))
    tpf = ratio_interval(_per_prompt(steps, 1 + run), _per_prompt(steps, ones))
    fid = ratio_interval(_per_prompt(steps, right), _per_prompt(steps, run))
    return {"threshold": threshold, **tpf.fields("tokens_per_forward"), **fid.fields("fidelity")}


def oracle(steps: StepScores) -> dict[str, Any]:
    """1 + the run of leading right masks per step: an acceptance rule that knew which masks are right."""
    run = _leading(steps.correct & steps.valid).sum(1)
    est = ratio_interval(_per_prompt(steps, 1 + run), _per_prompt(steps, np.ones(len(run))))
    return est.fields("tokens_per_forward")


def best_at_fidelity(points: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The point with the most tokens per forward whose fidelity is at least ``target`` (None: no threshold
    keeps it; a threshold that accepts no mask has no fidelity and is not counted)."""
    kept = [p for p in points if p["fidelity"] is not None and p["fidelity"] >= target]
    return max(kept, key=lambda p: p["tokens_per_forward"]) if kept else None


def reliability_table(steps: StepScores, bins: tuple[float, ...] = BINS) -> list[dict[str, Any]]:
    """Per depth and confidence bin: masks, mean confidence, share right (the top bin includes 1.0)."""
    rows = []
    for depth in range(steps.confidence.shape[1]):
        ok = steps.valid[:, depth]
        conf, right = steps.confidence[ok, depth], steps.correct[ok, depth]
        for i, (lo, hi) in enumerate(zip(bins[:-1], bins[1:])):
            last = i == len(bins) - 2
            inside = (conf >= lo) & ((conf <= hi) if last else (conf < hi))
            n = int(inside.sum())
            rows.append(
                {
                    "depth": depth,
                    "bin": f"[{lo:g}, {hi:g}{']' if last else ')'}",
                    "masks": n,
                    "share_of_masks": n / max(1, int(ok.sum())),
                    "mean_confidence": float(conf[inside].mean()) if n else None,
                    "right": float(right[inside].mean()) if n else None,
                }
            )
    return rows


# ------------------------------------------------------------------------------------------------
# Scoring a checkpoint
# ------------------------------------------------------------------------------------------------
def step_columns(is_mask: torch.Tensor, layout, masks_per_step: int) -> tuple[torch.Tensor, ...]:
    """The decoding steps in one grid offset's noisy columns ``[rows, W]`` (``layout``: their positions and
    depths): each block start (a mask at depth 0) and the ``masks_per_step`` columns from it.  Returns the
    steps' ``[row, column]`` starts ``[steps, 2]`` and, per step and mask ``[steps, masks_per_step]``, its row,
    its column and whether that mask exists (a mask of that depth, inside the text)."""
    depth = layout.depth()
    width = is_mask.shape[1]
    starts = (is_mask & (depth == 0)).nonzero()
    cols = starts[:, 1:2] + torch.arange(masks_per_step)
    inside = cols < width
    cols = cols.clamp(max=width - 1)
    rows = starts[:, :1].expand_as(cols)
    valid = inside & is_mask[rows, cols] & (depth[rows, cols] == torch.arange(masks_per_step))
    return starts, rows, cols, valid


def steps_of_rows(
    confidence: torch.Tensor,
    correct: torch.Tensor,
    is_mask: torch.Tensor,
    layout,
    masks_per_step: int,
) -> tuple[np.ndarray, ...]:
    """Cut one grid offset's noisy columns into steps (:func:`step_columns`).  Returns confidence, correct,
    valid, each step's row and its first mask's position."""
    starts, rows, cols, valid = step_columns(is_mask, layout, masks_per_step)
    conf = torch.where(valid, confidence[rows, cols], 0.0)
    right = valid & correct[rows, cols]
    first = layout.positions[starts[:, 0], starts[:, 1]]
    return conf.numpy(), right.numpy(), valid.numpy(), starts[:, 0].numpy(), first.numpy()


def score_texts(
    module, texts: list[list[int]], prompt_lengths: list[int], masks_per_step: int, batch_size: int = 8
) -> StepScores:
    """Every step of every text (prompt + its greedy answer), scored by ``module``'s masks.

    ``module`` is a :class:`mars.training.module.MarsModule` around the loaded checkpoint (its masks, adapter and
    block grid); every grid offset is scored so each answer position starts a step once."""
    block = module.block_size
    if not 1 <= masks_per_step < block + 1:
        raise ValueError(f"masks_per_step must be 1..{block} for block size {block}, got {masks_per_step}")
    parts: list[tuple[np.ndarray, ...]] = []
    for batch, logp, layout, is_mask in teacher_forced_masks(module, texts, prompt_lengths, batch_size):
        top = logp.max(-1)
        correct = (top.indices == layout.targets) & is_mask
        conf, right, valid, rows, first = steps_of_rows(top.values.exp(), correct, is_mask, layout, masks_per_step)
        parts.append((conf, right, valid, np.asarray(batch)[rows], first))
    return StepScores(*(np.concatenate(p) for p in zip(*parts)))


def teacher_forced_masks(module, texts: list[list[int]], prompt_lengths: list[int], batch_size: int = 8):
    """Per batch of texts (longest first) and grid offset: the texts' indices, the noisy stream's
    log-probabilities ``[rows, W, vocab]`` (the mask token suppressed, as a decoder does), its layout, and which
    columns are masks with a target (the text's next token: the greedy token when the text is greedy output)."""
    from mars.decoding.acceptance import suppress
    from mars.training.module import IGNORE

    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        width = max(len(texts[i]) for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        loss_mask = torch.zeros_like(ids)
        for r, i in enumerate(batch):  # right padding: no loss there and, causally, seen by no real token
            ids[r, : len(texts[i])] = torch.tensor(texts[i])
            loss_mask[r, prompt_lengths[i] : len(texts[i])] = 1
        for offset in range(module.block_size):
            logits, layout = module.mask_predictions(ids, loss_mask, torch.full((len(batch),), offset))
            logp = torch.log_softmax(suppress(logits, [module.mask_token_id]), dim=-1)
            yield batch, logp, layout, (layout.ids == module.mask_token_id) & (layout.targets != IGNORE)


def summarise(steps: StepScores, thresholds=THRESHOLDS, targets=FIDELITY_TARGETS) -> dict[str, Any]:
    points = [frontier_point(steps, t) for t in thresholds]
    return {
        "prompts": steps.prompts,
        "steps": int(len(steps.prompt)),
        "frontier": points,
        "oracle": oracle(steps),
        "best_at_fidelity": {str(t): best_at_fidelity(points, t) for t in targets},
        "reliability": reliability_table(steps),
    }


def _greedy_texts(loaded, block: int, prompts: list[str], max_new_tokens: int, batch_size: int):
    from mars.bench.probe import chat_prompt_ids, decode
    from mars.decoding import DecodingSettings

    ids = chat_prompt_ids(loaded.tokenizer, prompts)
    settings = DecodingSettings(threshold=1.0, block_size=block, max_new_tokens=max_new_tokens)
    outs, _, _ = decode(loaded.model.eval(), loaded.tokenizer, ids, settings, loaded.mask.id, batch_size)
    return [p + list(o) for p, o in zip(ids, outs)], [len(p) for p in ids]


def greedy_mask_module(loaded, block: int, prompts: list[str], max_new_tokens: int, batch_size: int):
    """The loaded checkpoint's greedy texts (prompt + answer at threshold 1.0), their prompt lengths, and a
    :class:`~mars.training.module.MarsModule` around it that lends :func:`teacher_forced_masks` its layout."""
    from mars.training.module import MarsModule
    from mars.training.objectives import Objective

    texts, prompt_lengths = _greedy_texts(loaded, block, prompts, max_new_tokens, batch_size)
    # The module only lends its training layout: the checkpoint's adapter is already in the model.
    module = MarsModule(loaded.model, loaded.mask.id, block_size=block, objective=Objective(name="mars")).eval()
    return module, texts, prompt_lengths


def score_checkpoint(checkpoint: str, prompts: list[str], max_new_tokens: int, batch_size: int, window: int | None):
    from mars.bench.probe import load

    loaded, block = load(checkpoint, None, "float32")
    module, texts, prompt_lengths = greedy_mask_module(loaded, block, prompts, max_new_tokens, batch_size)
    masks = (window or block) - 1
    return score_texts(module, texts, prompt_lengths, masks, batch_size), block


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def _interval(p: dict[str, Any], key: str, pct: bool) -> str:
    if p.get(key) is None:
        return "–"
    fmt = (lambda v: f"{100 * v:.1f}") if pct else (lambda v: f"{v:.3f}")
    return f"{fmt(p[key])} [{fmt(p[key + '_lo'])}, {fmt(p[key + '_hi'])}]"


def markdown(results: dict[str, dict[str, Any]]) -> str:
    names = list(results)
    lines = ["# Mask reliability and the acceptance frontier", ""]
    lines += [
        "| checkpoint | oracle tok/fwd (right masks only) | "
        + " | ".join(f"best tok/fwd at fidelity >= {t:g} (threshold)" for t in FIDELITY_TARGETS)
        + " |",
        "|---|---|" + "---|" * len(FIDELITY_TARGETS),
    ]
    for name in names:
        r = results[name]
        cells = []
        for t in FIDELITY_TARGETS:
            b = r["best_at_fidelity"][str(t)]
            cells.append("none" if b is None else f"{b['tokens_per_forward']:.3f} ({b['threshold']:g})")
        lines.append(f"| {name} | {_interval(r['oracle'], 'tokens_per_forward', False)} | " + " | ".join(cells) + " |")
    for name in names:
        r = results[name]
        lines += ["", f"## {name} ({r['prompts']} prompts, {r['steps']} steps)", ""]
        lines += ["| threshold | tokens per forward | fidelity % |", "|---|---|---|"]
        for p in r["frontier"]:
            lines.append(
                f"| {p['threshold']:g} | {_interval(p, 'tokens_per_forward', False)} | {_interval(p, 'fidelity', True)} |"
            )
        lines += [
            "",
            "| mask depth | confidence | masks | share | mean confidence | right |",
            "|---|---|---|---|---|---|",
        ]
        for row in r["reliability"]:
            lines.append(
                f"| {row['depth'] + 1} | {row['bin']} | {row['masks']} | {_pct(row['share_of_masks'])} | "
                f"{_pct(row['mean_confidence'])} | {_pct(row['right'])} |"
            )
    return "\n".join(lines) + "\n"


def figure(results: dict[str, dict[str, Any]]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.plot([0, 1], [0, 1], color="0.7", linestyle="--", label="calibrated")
    last = list(results)[-1]
    for depth in sorted({row["depth"] for row in results[last]["reliability"]}):
        rows = [r for r in results[last]["reliability"] if r["depth"] == depth and r["masks"] >= DIAGRAM_MIN_MASKS]
        left.plot(
            [r["mean_confidence"] for r in rows], [r["right"] for r in rows], marker="o", label=f"mask {depth + 1}"
        )
    left.set(
        xlabel="mask confidence (bin mean)",
        ylabel="share right (= greedy token)",
        title=f"reliability: {last} (bins of >= {DIAGRAM_MIN_MASKS} masks)",
    )
    left.legend(fontsize=8)
    for name, r in results.items():
        pts = [p for p in r["frontier"] if p["fidelity"] is not None]
        right.errorbar(
            [100 * p["fidelity"] for p in pts],
            [p["tokens_per_forward"] for p in pts],
            xerr=[
                [100 * (p["fidelity"] - p["fidelity_lo"]) for p in pts],
                [100 * (p["fidelity_hi"] - p["fidelity"]) for p in pts],
            ],
            marker="o",
            markersize=3,
            capsize=2,
            label=name,
        )
    right.set(
        xlabel="fidelity of accepted masks (%)",
        ylabel="tokens per forward",
        title="acceptance frontier (thresholds 0.5-0.999)",
    )
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


def build_parser():
    p = cli_options.parser("mars-bench reliability", __doc__)
    p.add_argument("--checkpoint", action="append", required=True, help="an exported HF folder (repeat to compare)")
    p.add_argument("--name", action="append", help="a label per --checkpoint (default: its folder name)")
    p.add_argument("--prompts", default=str(data_dir() / "prompts" / "heldout.jsonl"), help="JSONL, 'prompt' field")
    p.add_argument("--n", type=int, default=64, help="the first n prompts")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--window", type=int, help="predictions per decoding step (default: the block size)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, help="torch CPU threads")
    cli_options.add_out(p, None, help="directory for reliability.md, reliability.json and reliability.png")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = args.name or [Path(c).name for c in args.checkpoint]
    if len(names) != len(args.checkpoint):
        raise SystemExit(f"--name given {len(names)} times for {len(args.checkpoint)} --checkpoint")
    if args.n < 1 or args.max_new_tokens < 1:
        raise SystemExit("--n and --max-new-tokens must be >= 1")
    if args.window is not None and args.window < 2:
        raise SystemExit(f"--window must be >= 2 (the AR column and at least one mask), got {args.window}")
    missing = [c for c in args.checkpoint if not Path(c).is_dir()]
    if missing:
        raise SystemExit(f"not a checkpoint folder: {', '.join(missing)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    from mars.bench.probe import read_prompts

    prompts = read_prompts(args.prompts, args.n)
    results = {}
    for name, ckpt in zip(names, args.checkpoint):
        steps, block = score_checkpoint(ckpt, prompts, args.max_new_tokens, args.batch_size, args.window)
        results[name] = {"checkpoint": ckpt, "block_size": block, **summarise(steps)}
        print(
            f"{name}: oracle {results[name]['oracle']['tokens_per_forward']:.3f} tok/fwd; "
            + "; ".join(
                f"fidelity>={t}: "
                + (
                    "none"
                    if (b := results[name]["best_at_fidelity"][str(t)]) is None
                    else f"{b['tokens_per_forward']:.3f} at tau {b['threshold']:g}"
                )
                for t in FIDELITY_TARGETS
            ),
            flush=True,
        )
    text = markdown(results)
    print(text)
    if args.out:
        from mars.figures import PlotSettings, write_figure
        from mars.persistence import atomic_write_json, atomic_write_text

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "reliability.md", text)
        atomic_write_json(
            out / "reliability.json",
            {"prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens, "results": results},
            indent=2,
        )
        write_figure(figure(results), out / "reliability.png", PlotSettings())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
