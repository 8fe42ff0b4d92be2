"""Where the project's own files are: ``conf/`` (Hydra configs), ``eval/`` (lm-eval tasks and their helpers)
and ``data/`` (the committed training data, prompt sets, self-distilled answers and the reference adapter).

In a checkout, and in an editable install of one, they are the top-level folders users edit.  An installed
wheel carries the same files as package data under ``mars/bundle/`` (pyproject.toml maps the top-level
folders there, so each file has one copy in the repository), found through :mod:`importlib.resources`.
Both layouts keep the three folders side by side, so a path relative to one of them (the held-out task's
``../../../data/prompts/heldout.jsonl``) works in either.  They must be real folders (not a zip): Hydra's
config search path and lm-eval's ``include_path`` read folders.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path

# src/mars/paths.py -> the checkout's top level (in an installed wheel: site-packages' parent, never used)
CHECKOUT = Path(__file__).resolve().parents[2]
BUNDLE = "bundle"  # the folder under the installed package that holds conf/, eval/ and data/


def in_checkout() -> bool:
    """True when this module runs from a source checkout (``src/mars`` beside ``conf/train.yaml``)."""
    return (CHECKOUT / "conf" / "train.yaml").is_file() and (CHECKOUT / "src" / "mars").is_dir()


@cache
def project_root() -> Path:
    """The folder holding ``conf/``, ``eval/`` and ``data/``: the checkout, else the installed bundle."""
    if in_checkout():
        return CHECKOUT
    return Path(str(resources.files("mars").joinpath(BUNDLE)))


def conf_dir() -> Path:
    return project_root() / "conf"


def eval_dir() -> Path:
    return project_root() / "eval"


def data_dir() -> Path:
    return project_root() / "data"


BUNDLED = "bundled:"  # a path under data/ that ships with the package: ``bundled:adapters/<name>``


def bundled_path(value: str | None) -> str | None:
    """``bundled:<path>`` as the path of that file or folder under :func:`data_dir` (in a checkout or an installed
    wheel alike), any other value unchanged: how configs name the checkpoints the package ships."""
    if value is None or not str(value).startswith(BUNDLED):
        return value
    return str(data_dir() / str(value)[len(BUNDLED) :])


def main(argv: list[str] | None = None) -> None:
    """``python -m mars.paths [root|conf|eval|data]``: print that folder (e.g. for lm-eval's ``--include_path``)."""
    import sys

    folders = {"root": project_root, "conf": conf_dir, "eval": eval_dir, "data": data_dir}
    which = (sys.argv[1:] if argv is None else argv) or ["root"]
    if len(which) != 1 or which[0] not in folders:
        raise SystemExit(f"usage: python -m mars.paths [{'|'.join(folders)}], got {' '.join(which)!r}")
    print(folders[which[0]]())


if __name__ == "__main__":
    main()
