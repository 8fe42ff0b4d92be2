"""Fit one temperature per mask depth to a checkpoint's mask confidences and store it in its mars_config.json.

    mars-bench calibrate --checkpoint outputs/train/<run>/hf
    mars-bench calibrate --checkpoint outputs/train/<run>/hf --limit 64 --dry-run

The held-out prompts (never trained on) are ordered by a hash of their ``id`` and split in two halves, so both
halves mix every source: the temperatures are fitted on the first half and the expected calibration error (ECE)
of each depth is measured on the second, before and after.  Each prompt is answered at threshold 1.0 (the
model's own greedy text) and its masks scored against it by teacher forcing, exactly as ``mars-bench
reliability`` does (:mod:`mars.bench.mask_scores`): the masks of every step the greedy text could take, and
whether each one's argmax is the greedy token.  The fit, the ECE and the stored fields are defined in
:mod:`mars.calibration`; the same steps give the draft acceptance table ``tree=auto`` reads
(:func:`mars.calibration.acceptance_table`).  Both go into the checkpoint's ``mars_config.json`` in one atomic
write, and a folder where that write cannot happen is refused before the model loads; decoders load them with the
checkpoint (``model.mars_calibration``, ``model.mars_draft_acceptance``).  ``--dry-run`` prints the
tables and writes nothing.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

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
        from mars.calibration import check_can_store

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
        import torch

        torch.set_num_threads(args.threads)
    from mars.bench.mask_scores import fit_checkpoint
    from mars.calibration import store_calibration

    fitted = fit_checkpoint(
        args.checkpoint,
        block,
        fit_prompts,
        held_prompts,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
    )
    print(table(fitted.calibration, fitted.fit_masks, fitted.held_masks))
    print(acceptance_lines(fitted.acceptance.table()))
    if args.dry_run:
        print("dry run: nothing written")
    else:  # one atomic write of both: a kill leaves the old pair or the new one
        written = store_calibration(args.checkpoint, fitted.calibration, fitted.acceptance)
        print(f"calibration and draft acceptance written to {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
