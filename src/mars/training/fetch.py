"""``python -m mars.training.fetch --out <folder>``: the paper's data and base models, fetched once where the
Hugging Face hub is reachable, into a folder that nodes without the hub train from.

- ``<folder>/datasets/<hub id>/``: the split as ``datasets`` saves it (``save_to_disk``: Arrow shards, memory-mapped
  when read, nothing parsed again); ``data=dolci_local data.path=<folder>/datasets/allenai/Dolci-Instruct-SFT``.
- ``<folder>/models/<hub id>/``: the model repository's files; ``model.name_or_path=<folder>/models/<hub id>``.

A dataset folder appears only once it is written whole (a kill leaves nothing that passes for it) and is skipped
when there; a model download resumes where it stopped.  The command prints the overrides to train with.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mars.persistence import atomic_dir
from mars.training.data import DISK_MARKERS

DATASET = "allenai/Dolci-Instruct-SFT"
MODELS = ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct")


def dataset_folder(out: Path, hub_id: str) -> Path:
    return Path(out) / "datasets" / hub_id


def model_folder(out: Path, repo_id: str) -> Path:
    return Path(out) / "models" / repo_id


def save_dataset(dataset, folder: Path) -> Path:
    """``dataset`` (a ``datasets.Dataset``) saved to ``folder``, which appears only once it is whole."""
    with atomic_dir(folder) as tmp:
        dataset.save_to_disk(str(tmp))
    return folder


def fetch_dataset(hub_id: str, split: str, out: Path) -> Path:
    folder = dataset_folder(out, hub_id)
    if any((folder / m).is_file() for m in DISK_MARKERS):
        print(f"{hub_id}: already in {folder}")
        return folder
    import datasets

    print(f"{hub_id} ({split}): downloading ...", flush=True)
    return save_dataset(datasets.load_dataset(hub_id, split=split), folder)


def fetch_model(repo_id: str, out: Path) -> Path:
    from huggingface_hub import snapshot_download

    folder = model_folder(out, repo_id)
    print(f"{repo_id}: downloading into {folder} ...", flush=True)
    snapshot_download(repo_id, local_dir=str(folder))
    return folder


def train_overrides(out: Path, hub_id: str | None, models: list[str]) -> list[str]:
    """The overrides that train from the fetched folder (one line per model for its stage 1)."""
    data = f"data=dolci_local data.path={dataset_folder(out, hub_id)}" if hub_id else ""
    return [f"{data} model.name_or_path={model_folder(out, m)}".strip() for m in models] or [data]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m mars.training.fetch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, type=Path, help="the folder to write (shared storage of the cluster)")
    p.add_argument("--dataset", default=DATASET, help=f"hub dataset id (default {DATASET}); 'none' for no data")
    p.add_argument("--split", default="train")
    p.add_argument(
        "--model", action="append", dest="models", help=f"hub model id, repeatable (default: {', '.join(MODELS)})"
    )
    p.add_argument("--no-models", action="store_true", help="the data only")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hub_id = None if args.dataset.lower() == "none" else args.dataset
    models = [] if args.no_models else list(args.models or MODELS)
    if hub_id:
        fetch_dataset(hub_id, args.split, args.out)
    for repo in models:
        fetch_model(repo, args.out)
    print("train without the hub (stage 1; stage 2 starts from stage 1's export):")
    for line in train_overrides(args.out, hub_id, models):
        print(f"  python train.py experiment=paper_<size>/ar_sft {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
