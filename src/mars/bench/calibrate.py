"""Fit one temperature per mask depth to a checkpoint's mask confidences and store it in its mars_config.json.

    mars-bench calibrate --checkpoint outputs/train/<run>/hf
    mars-bench calibrate --checkpoint outputs/train/<run>/hf --limit 64 --dry-run

The held-out prompts (never trained on) are ordered by a hash of their ``id`` and split in two halves, so both
halves mix every source: the temperatures are fitted on the first half and the expected calibration error (ECE)
of each depth is measured on the second, before and after.  Each prompt is answered at threshold 1.0 (the
model's own greedy text) and its masks scored against it by teacher forcing, exactly as ``mars-bench
reliability`` does (:func:`mars.bench.reliability.teacher_forced_masks`): the masks of every step the greedy
text could take, and whether each one's argmax is the greedy token.  The fit, the ECE and the stored fields are
defined in :mod:`mars.decoding.calibration`; the same steps give the draft acceptance table ``tree=auto`` reads
(:func:`mars.decoding.tree_choice.acceptance_table`).  Both go into the checkpoint's ``mars_config.json`` in one
atomic write, and a folder where that write cannot happen is refused before the model loads; decoders load them
with the checkpoint (``model.mars_calibration``, ``model.mars_draft_acceptance``).  ``--dry-run`` prints the
tables and writes nothing.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from mars.bench import cli_options
from mars.paths import data_dir


def split_by_id(path: str | Path, limit: int | None) -> tuple[list[str], list[str]]:
    """The prompts of a prompt file (:mod:`mars.prompt_files`; an ``id`` in every row) ordered by the sha256 of their
    id, the first ``limit`` of them (all: None), as two halves: (fit, held out)."""
    rows = cli_options.prompt_rows(path, "--prompts", require={"id": "the halves are drawn by a hash of it"})
    rows.sort(key=lambda r: hashlib.sha256(r.id.encode()).hexdigest())
    rows = rows[:limit] if limit else rows
    half = len(rows) // 2
    if half < 1:
        raise SystemExit(f"--prompts {path}: {len(rows)} prompt(s); a fit half and a held-out half need 2 at least")
    return [r.prompt for r in rows[:half]], [r.prompt for r in rows[half:]]


def depth_scores(module, texts: list[list[int]], prompt_lengths: list[int], batch_size: int):
    """One :class:`~mars.decoding.calibration.MaskScores` per mask depth ``1 .. B-1``: every decoding step of the
    texts, each mask reduced to its log top-probabilities on the temperature grid (a batch's logits at a time)."""
    from mars.bench.reliability import step_columns, teacher_forced_masks
    from mars.decoding.calibration import MaskScores

    masks = module.block_size - 1
    parts: list[list[MaskScores]] = [[] for _ in range(masks)]
    ranks = []
    for _, logp, layout, is_mask in teacher_forced_masks(module, texts, prompt_lengths, batch_size):
        right = logp.argmax(-1) == layout.targets
        _, rows, cols, valid = step_columns(is_mask, layout, masks)
        for d in range(masks):
            r, c = rows[valid[:, d], d], cols[valid[:, d], d]
            parts[d].append(MaskScores.from_logits(logp[r, c], right[r, c]))
        ranks.append(greedy_ranks(logp, layout.targets, rows, cols, valid))
    return [MaskScores.concat(p) for p in parts], torch.cat(ranks).numpy()


def greedy_ranks(logp, targets, rows, cols, valid, width: int = 4) -> torch.Tensor:
    """Per step and mask depth ``[steps, depths]``: the rank of the greedy token in the mask's distribution, capped
    at ``width`` (beyond any tree's candidates), -1 where the step has no mask of that depth."""
    at = logp[rows, cols]  # [steps, depths, vocab]
    target = targets[rows, cols].clamp_min(0)
    own = at.gather(-1, target.unsqueeze(-1))
    rank = (at > own).sum(-1).clamp_max(width)
    return torch.where(valid, rank, -1)


def table(calibration, fit_masks: list[int], held_masks: list[int]) -> str:
    """The per-depth table: temperature, ECE before and after on the held-out half, masks of each half."""

    def pct(v: float | None) -> str:
        return "–" if v is None else f"{100 * v:.2f}%"

    lines = [
        f"block size {calibration.block_size}, {calibration.fit_prompts} fit / {calibration.eval_prompts} held-out "
        f"prompts, checkpoint {calibration.checkpoint}",
        "",
        "| mask depth | T | ECE before | ECE after | masks (fit / held out) |",
        "|---|---|---|---|---|",
    ]
    rows = zip(calibration.temperatures, calibration.ece_before, calibration.ece_after, fit_masks, held_masks)
    for depth, (t, before, after, n_fit, n_held) in enumerate(rows, start=1):
        lines.append(f"| {depth} | {t:.3f} | {pct(before)} | {pct(after)} | {n_fit} / {n_held} |")
    return "\n".join(lines) + "\n"


def acceptance_lines(table: list[list[float]]) -> str:
    """The draft acceptance per depth and rank (tree=auto reads it) as a Markdown table."""
    lines = ["", "| depth | top-1 | top-2 | top-3 | top-4 |", "|---|---|---|---|---|"]
    lines += [f"| {d + 1} | " + " | ".join(f"{100 * a:.1f}%" for a in row) + " |" for d, row in enumerate(table)]
    return "\n".join(lines)


def build_parser():
    p = cli_options.parser("mars-bench calibrate", __doc__)
    p.add_argument(
        "--checkpoint", required=True, help="an exported checkpoint folder (its mars_config.json is updated)"
    )
    p.add_argument(
        "--prompts", default=str(data_dir() / "prompts" / "heldout.jsonl"), help="JSONL with 'id' and 'prompt' fields"
    )
    p.add_argument("--limit", type=int, default=128, help="prompts used, half to fit and half to measure (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--dry-run", action="store_true", help="print the table, write nothing")
    return p


def check_checkpoint(folder: str, write: bool = True) -> int:
    """The checkpoint's training block size, refusing before any model loads a folder that is no MARS
    checkpoint, whose block has no mask to calibrate, or (``write``) whose ``mars_config.json`` cannot be
    replaced: the results would be lost after the whole run."""
    from mars.calibration_store import check_can_store
    from mars.metadata import MetadataError, read_metadata

    if not Path(folder).is_dir():
        raise SystemExit(f"--checkpoint {folder}: no such folder")
    try:
        meta = read_metadata(folder)
    except MetadataError as err:
        raise SystemExit(f"--checkpoint {folder}: {err}") from None
    if meta is None:
        raise SystemExit(f"--checkpoint {folder}: no mars_config.json, so not a MARS checkpoint (export one first)")
    if meta.block_size < 2:
        raise SystemExit(f"--checkpoint {folder}: block size {meta.block_size} has no mask to calibrate")
    if write:
        try:
            check_can_store(folder)
        except OSError as err:
            raise SystemExit(f"--checkpoint {folder}: {err} (or pass --dry-run to write nothing)") from None
    return meta.block_size


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.limit < 0 or args.max_new_tokens < 1 or args.batch_size < 1:
        raise SystemExit("--limit must be >= 0, --max-new-tokens and --batch-size >= 1")
    block = check_checkpoint(args.checkpoint, write=not args.dry_run)
    fit_prompts, held_prompts = split_by_id(args.prompts, args.limit or None)
    if args.threads:
        torch.set_num_threads(args.threads)
    from mars.bench.reliability import greedy_mask_module
    from mars.decoding.calibration import DraftAcceptance, checkpoint_identity, fit_calibration, store_calibration
    from mars.decoding.tree_choice import acceptance_table
    from mars.models import load_model

    identity = checkpoint_identity(args.checkpoint)
    # a stored calibration is not attached: it may be the stale one this run replaces
    loaded = load_model(args.checkpoint, dtype="float32", calibration=False)
    prompts = fit_prompts + held_prompts
    module, texts, lengths = greedy_mask_module(loaded, block, prompts, args.max_new_tokens, args.batch_size)
    n = len(fit_prompts)
    fit, fit_ranks = depth_scores(module, texts[:n], lengths[:n], args.batch_size)
    held, held_ranks = depth_scores(module, texts[n:], lengths[n:], args.batch_size)
    acceptance = DraftAcceptance(
        conditional=acceptance_table(np.concatenate([fit_ranks, held_ranks])),
        block_size=block,
        checkpoint=identity,
        prompts=len(prompts),
    )
    calibration = fit_calibration(
        fit, held, block_size=block, checkpoint=identity, fit_prompts=n, eval_prompts=len(held_prompts)
    )
    print(table(calibration, [len(s.correct) for s in fit], [len(s.correct) for s in held]))
    print(acceptance_lines(acceptance.table()))
    if args.dry_run:
        print("dry run: nothing written")
    else:  # one atomic write of both: a kill leaves the old pair or the new one
        print(
            f"calibration and draft acceptance written to {store_calibration(args.checkpoint, calibration, acceptance)}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
