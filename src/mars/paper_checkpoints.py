"""The paper's own checkpoints (``Xalphinions/MARS-Qwen2.5-0.5B-blk4`` and the others): what their format is and
what it maps to, read from ``config.json`` alone (no torch, no weights).

The paper's code saves its models under model types of its own (``a2d-qwen2``, ``a2d-qwen3``, ``a2d-qwen3-it``,
with architectures ``A2DQwen2LMHeadModel``, ...), registered with transformers only when its ``dllm`` package is
imported.  Each is the plain Qwen2/Qwen3 causal LM with the same weights under the same names; the one change is the
attention mask its model builds when none is given (bidirectional).  MARS decoding always passes its own causal
mask, so the plain architecture computes exactly what the paper's model does here.  The mask token is the
tokenizer's ``<|mask|>`` (a special token the paper adds in a spare embedding row).  The block size is not part
of the format: a checkpoint says it when its ``config.json`` (or a ``mars_config.json`` beside it) has
``block_size``; otherwise it is the ``-blk<B>`` of the hub name, which the user names.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the paper's model type -> the plain transformers model type with the same weights
MODEL_TYPES = {"a2d-qwen2": "qwen2", "a2d-qwen3": "qwen3", "a2d-qwen3-it": "qwen3"}
ARCHITECTURES = {
    "A2DQwen2LMHeadModel": "Qwen2ForCausalLM",
    "A2DQwen3LMHeadModel": "Qwen3ForCausalLM",
    "A2DQwen3InstructLMHeadModel": "Qwen3ForCausalLM",
}
PREFIX = "a2d-"
MASK_TOKEN = "<|mask|>"


class PaperFormatError(ValueError):
    """A folder that claims the paper's format but cannot be read as it."""


@dataclass(frozen=True)
class PaperCheckpoint:
    """A checkpoint folder in the paper's format: its saved model type, the plain one, its block size if it says."""

    folder: Path
    model_type: str
    plain_type: str
    block_size: int | None

    def plain_config(self) -> dict[str, Any]:
        """``config.json`` as the plain architecture reads it: model type and architecture names mapped."""
        config = read_config(self.folder)
        config["model_type"] = self.plain_type
        config["architectures"] = [ARCHITECTURES.get(a, a) for a in config.get("architectures") or []] or [
            f"{self.plain_type.capitalize()}ForCausalLM"
        ]
        config.pop("auto_map", None)  # remote-code pointers to the paper's classes
        return config

    def metadata(self) -> dict[str, Any]:
        """What evaluation and serving read of a checkpoint before it loads (``mars.metadata.read_checkpoint``):
        MARS-trained, its mask token, its block size or None, and the format (which makes a missing block size an
        error instead of a default)."""
        return {
            "objective": "mars",
            "mask_token": MASK_TOKEN,
            "block_size": self.block_size,
            "paper_format": self.model_type,
        }


def read_config(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise PaperFormatError(f"{path} cannot be read as a model config ({err})") from None
    if not isinstance(config, dict):
        raise PaperFormatError(f"{path} is not a model config (a JSON object)")
    return config


def paper_checkpoint(folder: str | os.PathLike) -> PaperCheckpoint | None:
    """The folder as a paper checkpoint, or None when its ``config.json`` is of another model type (or there is
    none).  A model type of the paper's family that is not known here is refused, naming the known ones."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return None
    config = read_config(folder)
    model_type = str(config.get("model_type") or "")
    if not model_type.startswith(PREFIX):
        return None
    if model_type not in MODEL_TYPES:
        raise PaperFormatError(
            f"{folder / 'config.json'}: model_type {model_type!r} looks like the paper's format, but only "
            f"{sorted(MODEL_TYPES)} are known (each a plain {sorted(set(MODEL_TYPES.values()))} model)"
        )
    block = config.get("block_size")
    marker = folder / "mars_config.json"
    if block is None and marker.is_file():
        block = json.loads(marker.read_text(encoding="utf-8")).get("block_size")
    if block is not None and (not isinstance(block, int) or isinstance(block, bool) or block < 1):
        raise PaperFormatError(f"{folder / 'config.json'}: block_size must be an integer >= 1, got {block!r}")
    return PaperCheckpoint(folder, model_type, MODEL_TYPES[model_type], block)


def missing_block_size(meta: Any) -> str | None:
    """The message for a paper checkpoint whose block size is unknown (None when ``meta`` is no such checkpoint's
    or says its block size)."""
    if not isinstance(meta, dict) or not meta.get("paper_format") or meta.get("block_size"):
        return None
    return (
        f"the checkpoint is in the paper's format ({meta['paper_format']}) and does not record the block size it "
        "was trained with: name it with decoding.block_size=<B> (the -blk<B> of its hub name, e.g. "
        "Xalphinions/MARS-Qwen2.5-0.5B-blk4 -> decoding.block_size=4)"
    )


__all__ = [
    "ARCHITECTURES",
    "MASK_TOKEN",
    "MODEL_TYPES",
    "PaperCheckpoint",
    "PaperFormatError",
    "missing_block_size",
    "paper_checkpoint",
    "read_config",
]
