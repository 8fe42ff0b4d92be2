"""What an exported MARS folder carries so that ``transformers`` decodes it with MARS verify through
``model.generate(..., custom_generate=<folder>, trust_remote_code=True)``: ``custom_generate/generate.py`` (a copy of
:mod:`mars.hf_generate`) and, in ``config.json``, the keys that decoder reads -- ``mask_token_id`` (also the key
vLLM's parallel drafting reads), ``mars_block_size`` and, for a calibrated checkpoint, ``mars_mask_temperatures``.

Training's export (:mod:`mars.training.export`) and ``python -m mars.integrations.export`` both write them here, so
every exported folder carries the same decoder.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DECODER = Path(__file__).with_name("hf_generate.py")


def config_keys(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` keys of a MARS checkpoint whose ``mars_config.json`` holds ``metadata``."""
    keys: dict[str, Any] = {
        "mask_token_id": int(metadata["mask_token_id"]),
        "mars_block_size": int(metadata["block_size"]),
    }
    temperatures = (metadata.get("calibration") or {}).get("temperatures")
    if temperatures:
        keys["mars_mask_temperatures"] = [float(t) for t in temperatures]
    return keys


def write_config_keys(folder: Path, metadata: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """Add :func:`config_keys` (and ``extra``) to ``folder/config.json``; returns the whole config."""
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    config.update(config_keys(metadata), **extra)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config


def write_custom_generate(folder: Path) -> Path:
    """``folder/custom_generate/generate.py``: the MARS decoder ``transformers`` runs for ``custom_generate``."""
    target = Path(folder) / "custom_generate" / "generate.py"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(DECODER, target)
    return target
