"""``python -m mars.training.adapter_rank CHECKPOINT OUT --rank 8``: a gated adapter checkpoint saved again at a lower
rank, for decoding.

Each projection's low-rank product B A is replaced by its best rank-``rank`` approximation
(:func:`mars.adapters.truncate_adapter_rank`), so a step with masks reads and multiplies fewer factor rows
(on a CPU the adapter's factors are a large share of a masked step's extra cost) and the file shrinks by
``r / rank``.  The gate still leaves every real column to the base model: threshold 1.0 and verify mode give
the base model's greedy output exactly as before; only the masks' predictions move.  The tensors keep the
source file's dtype (float32 if it mixes several); ``mars_adapter.json`` records the source rank and the
smallest share of a product's energy kept.  Everything is checked before the model loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mars.adapters import ADAPTER_WEIGHTS, AdapterError, AdapterSettings, read_adapter_meta


def stored_dtype(folder: Path):
    """The one dtype of every tensor in the adapter file (the lower rank is written in it), or None when the
    file mixes dtypes (then the lower rank is written in float32, which rounds nothing)."""
    from safetensors import safe_open

    path = folder / ADAPTER_WEIGHTS
    if not path.is_file():
        raise AdapterError(f"{folder}: no {ADAPTER_WEIGHTS}")
    with safe_open(str(path), framework="pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    return dtypes.pop() if len(dtypes) == 1 else None


def checked_source(checkpoint: Path, out: Path, rank: int) -> AdapterSettings:
    """The source's adapter settings, after every refusal that needs no model."""
    meta = read_adapter_meta(checkpoint)
    if meta is None:
        raise AdapterError(f"{checkpoint}: not an adapter checkpoint (no mars_adapter.json)")
    settings = AdapterSettings.from_dict(meta["settings"])
    if not settings.gated:
        raise AdapterError(f"{checkpoint}: a {settings.kind} adapter; only a gated one keeps the base's columns exact")
    if rank < 1 or rank >= settings.rank:
        raise AdapterError(f"--rank must be between 1 and the adapter's rank {settings.rank} (exclusive), got {rank}")
    if out.resolve() == checkpoint.resolve():
        raise AdapterError(f"the output {out} is the source checkpoint: write the lower rank elsewhere")
    return settings


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="a gated adapter checkpoint folder (a training run's hf/)")
    p.add_argument("out", type=Path)
    p.add_argument("--rank", type=int, required=True)
    args = p.parse_args(argv)
    try:
        settings = checked_source(args.checkpoint, args.out, args.rank)
        dtype = stored_dtype(args.checkpoint)
    except AdapterError as err:
        p.error(str(err))

    import torch

    from mars.adapters import truncate_adapter_rank
    from mars.metadata import read_metadata
    from mars.models import load_model
    from mars.training.export import export_adapter

    loaded = load_model(str(args.checkpoint), dtype=torch.float32)
    kept = truncate_adapter_rank(loaded.model, args.rank)
    export_adapter(
        loaded.model,
        loaded.tokenizer,
        args.out,
        read_metadata(args.checkpoint).to_dict(),
        provenance={"truncated_from_rank": settings.rank, "energy_kept": round(kept, 6)},
        dtype=dtype,
    )
    sizes = [(folder / ADAPTER_WEIGHTS).stat().st_size / 1e6 for folder in (args.checkpoint, args.out)]
    print(
        f"rank {settings.rank} -> {args.rank}: every product keeps >= {kept:.1%} of its energy; "
        f"{ADAPTER_WEIGHTS} {sizes[0]:.1f} MB -> {sizes[1]:.1f} MB ({dtype or torch.float32}); checkpoint: {args.out}"
    )


if __name__ == "__main__":
    main()
