"""``python -m mars.integrations.export CHECKPOINT OUT``: a MARS checkpoint as a folder that vLLM loads as a
parallel drafter, and that ``transformers`` decodes with MARS verify through ``custom_generate``.

Layouts written (atomically: ``OUT`` appears complete or not at all):

* **full fine-tuned checkpoint** (a folder with ``config.json`` and ``mars_config.json``): a copy of it (weights
  hard-linked where the filesystem allows) whose ``config.json`` also carries ``mask_token_id`` (the key vLLM's
  parallel drafting reads, ``get_parallel_drafting_token_id``), ``mars_block_size`` and, for a calibrated
  checkpoint, ``mars_mask_temperatures``.
* **gated adapter** (a folder with ``mars_adapter.json``): the base model's weights, unchanged, plus
  ``mars_gated_lora.safetensors`` (each LoRA factor pair with its scaling folded in, and the mask-embedding
  delta), and a ``config.json`` whose ``architectures`` names the out-of-tree vLLM class
  (:mod:`mars.integrations.vllm_gated`, registered by the ``vllm`` extra's plugin) that applies the LoRA delta
  exactly where the input token is the mask token.  ``--merge`` instead folds the adapter into every weight (a
  plain HF folder; the gate is gone, so the context columns stop being the base model's).

Every layout carries ``custom_generate/generate.py`` and the ``config.json`` keys it reads
(:mod:`mars.custom_generate_files`).

vLLM's drafter input for a step is ``[verified tokens | bonus | K-1 masks]`` at consecutive positions, and its
drafts are the outputs at the bonus and at each mask: the output at the bonus predicts the next token, the one
at the k-th mask the token k+1 places after the bonus -- MARS's own layout (the output at mask k predicts the
token k+1 places after the last real token), so no change is needed at export; ``K`` is at most the block size.

``--target`` checks the drafter against the model it will draft for: their tokenizers must map the same tokens
to the same ids (the drafter's own mask token aside), else the export is refused naming both; vLLM also needs
equal embedding sizes, so a drafter with fewer rows than the target gets zero rows appended (no token maps to
them, and a draft that names one is simply rejected).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GATED_WEIGHTS = "mars_gated_lora.safetensors"
GATED_KEY = "mars_gated_lora"  # config.json: the adapter's shape, read by the vLLM class
LORA_PREFIX = "mars_gated_lora."  # its tensors' names, which vLLM's loader hands to the class beside the base's
# base architecture -> the vLLM class that gates the adapter (mars.integrations.vllm_gated)
GATED_ARCHITECTURES = {
    "LlamaForCausalLM": "MarsGatedLlamaForCausalLM",
    "Qwen2ForCausalLM": "MarsGatedQwen2ForCausalLM",
}


class ExportError(ValueError):
    """A checkpoint that cannot be exported as asked (no mask token, another vocabulary, ...)."""


@dataclass(frozen=True)
class Source:
    folder: Path
    kind: str  # full | gated
    mask_token: str
    mask_token_id: int
    block_size: int
    metadata: dict[str, Any]
    adapter: dict[str, Any] | None = None


def inspect_checkpoint(checkpoint: str | os.PathLike) -> Source:
    """What ``checkpoint`` is, read from its small files only (no model loads): refused when it is not a MARS
    checkpoint or names no mask token."""
    from mars.adapters import ADAPTER_META, read_adapter_meta
    from mars.metadata import METADATA_FILE, read_metadata

    folder = Path(checkpoint)
    if not folder.is_dir():
        raise ExportError(f"{folder}: no such folder (expected a MARS checkpoint: a train.py export, .../hf)")
    meta = read_metadata(folder)
    adapter = read_adapter_meta(folder) if (folder / ADAPTER_META).is_file() else None
    if meta is None:
        raise ExportError(
            f"{folder} has no {METADATA_FILE}, so it names no mask token and is not a MARS checkpoint: export a "
            "checkpoint trained with train.py (its hf/ folder), or train one first"
        )
    data = meta.to_dict()
    mask, mask_id = data.get("mask_token"), data.get("mask_token_id")
    if not mask or mask_id is None:
        raise ExportError(f"{folder / METADATA_FILE} names no mask token (mask_token, mask_token_id): not exportable")
    if adapter is None and not (folder / "config.json").is_file():
        raise ExportError(f"{folder} has neither config.json (full weights) nor {ADAPTER_META} (a gated adapter)")
    kind = "gated" if adapter is not None else "full"
    return Source(folder, kind, str(mask), int(mask_id), int(data["block_size"]), data, adapter)


# ------------------------------------------------------------------------------------------
# Drafter against target
# ------------------------------------------------------------------------------------------
def check_same_vocabulary(draft_tokenizer, target_tokenizer, *, draft: str, target: str, mask_token: str) -> None:
    """Refuse a drafter whose tokenizer maps any token to another id than the target's (its mask token aside,
    which the target need not know), naming both."""
    mine, theirs = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if mask_token not in theirs:
        mine = {t: i for t, i in mine.items() if t != mask_token}
    differ = sorted(t for t in set(mine) | set(theirs) if mine.get(t) != theirs.get(t))
    if differ:
        shown = ", ".join(f"{t!r}: {mine.get(t)} vs {theirs.get(t)}" for t in differ[:5])
        raise ExportError(
            f"the drafter {draft} and the target {target} have different vocabularies ({len(mine)} vs "
            f"{len(theirs)} tokens; {len(differ)} differ, e.g. {shown}): a parallel drafter must share the "
            "target's tokenizer; train the MARS drafter from a model of the target's family"
        )


def _rows(config: dict[str, Any]) -> int:
    return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))


def target_rows(target: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(target).vocab_size)


def _check_target(source: Source, target: str, tokenizer_folder: Path, draft_config: dict[str, Any]) -> int | None:
    """The embedding rows to pad the drafter to (None: as it is), after the vocabulary check."""
    from transformers import AutoTokenizer

    check_same_vocabulary(
        AutoTokenizer.from_pretrained(tokenizer_folder),
        AutoTokenizer.from_pretrained(target),
        draft=str(source.folder),
        target=target,
        mask_token=source.mask_token,
    )
    mine, theirs = _rows(draft_config), target_rows(target)
    if source.mask_token_id >= theirs:
        raise ExportError(
            f"the drafter {source.folder}'s mask token id {source.mask_token_id} is outside the target {target}'s "
            f"{theirs} embedding rows: choose a mask token inside the target's vocabulary"
        )
    if mine > theirs:
        raise ExportError(
            f"the drafter {source.folder} has {mine} embedding rows, more than the target {target}'s {theirs}: "
            "vLLM needs equal vocabulary sizes and its drafts would name ids the target lacks"
        )
    return theirs if mine < theirs else None


# ------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------
def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _pad_rows(model, rows: int) -> None:
    """Append zero rows to the input embedding (and an untied head) up to ``rows``."""
    import torch

    with torch.no_grad():
        old = model.get_input_embeddings().weight.shape[0]
        model.resize_token_embeddings(rows, mean_resizing=False)
        model.get_input_embeddings().weight[old:].zero_()
        head = model.get_output_embeddings()
        if head is not None and head.weight is not model.get_input_embeddings().weight:
            head.weight[old:].zero_()


def export_full(source: Source, out: Path, *, target: str | None = None) -> Path:
    from mars.custom_generate_files import write_config_keys, write_custom_generate
    from mars.persistence import atomic_dir

    config = json.loads((source.folder / "config.json").read_text())
    pad = _check_target(source, target, source.folder, config) if target else None
    with atomic_dir(out) as tmp:
        if pad is None:
            for path in source.folder.iterdir():
                if path.is_file():  # custom_generate/ is written afresh below
                    _link_or_copy(path, tmp / path.name)
        else:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            model = AutoModelForCausalLM.from_pretrained(source.folder, dtype="auto")
            _pad_rows(model, pad)
            model.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(source.folder).save_pretrained(tmp)
            shutil.copy2(source.folder / "mars_config.json", tmp / "mars_config.json")
        write_config_keys(tmp, source.metadata)
        write_custom_generate(tmp)
    log.info("exported %s (full weights) to %s", source.folder, out)
    return out


def gated_lora_tensors(adapter_folder: Path, settings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The adapter's tensors under the names the vLLM class reads -- ``mars_gated_lora.layers.<i>.<module>.A``
    ``[r, in]`` and ``.B`` ``[out, r]`` with the LoRA scaling folded into ``B`` (fp32), and
    ``mars_gated_lora.mask_embedding_delta`` -- and the shape record for ``config.json``."""
    import re

    import torch
    from safetensors.torch import load_file

    from mars.adapters import ADAPTER_WEIGHTS, MASK_DELTA_KEY

    state = load_file(str(adapter_folder / ADAPTER_WEIGHTS))
    rank = int(settings["rank"])
    alpha = settings.get("alpha")
    scaling = float(alpha if alpha is not None else rank) / rank
    out: dict[str, torch.Tensor] = {}
    layers: set[int] = set()
    modules: set[str] = set()
    pattern = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
    for key, tensor in state.items():
        if key == MASK_DELTA_KEY:
            out[LORA_PREFIX + "mask_embedding_delta"] = tensor.float().contiguous()
            continue
        match = pattern.match(key)
        if match is None:
            raise ExportError(f"{adapter_folder / ADAPTER_WEIGHTS}: unexpected tensor {key!r} in a gated adapter")
        layer, module, factor = int(match.group(1)), match.group(2), match.group(3)
        layers.add(layer)
        modules.add(module)
        value = tensor.float() * (scaling if factor == "B" else 1.0)
        out[f"{LORA_PREFIX}layers.{layer}.{module}.{factor}"] = value.contiguous()
    record = {
        "rank": rank,
        "layers": sorted(layers),
        "modules": sorted(modules),
        "mask_embedding": LORA_PREFIX + "mask_embedding_delta" in out,
    }
    return out, record


def _gated_model(source: Source, adapter: dict[str, Any], merge: bool):
    """The model a gated export writes: the adapter loaded with its gate (``merge``), or the base model it was
    trained on, refused when the base loads here with another digest."""
    from mars.adapters import base_digest
    from mars.models import load_model

    base = adapter.get("base_model") or source.metadata.get("base_model")
    if merge:
        return load_model(str(source.folder), calibration=False).model
    loaded = load_model(str(base), tiny=adapter.get("base_tiny"), dtype="float32")
    if base_digest(loaded.model) != adapter.get("base_digest"):
        raise ExportError(f"{source.folder} was not trained on {base!r} as it loads here (its base digest differs)")
    return loaded.model


def _gated_architecture(source: Source, model, merge: bool) -> str:
    """The model's architecture, refused for a gated folder when the vLLM gated class does not cover it."""
    architecture = (model.config.architectures or [type(model).__name__])[0]
    if not merge and architecture not in GATED_ARCHITECTURES:
        raise ExportError(
            f"{source.folder}: the gated vLLM class covers {sorted(GATED_ARCHITECTURES)}, not {architecture}; "
            "export with --merge for a plain folder (the gate is lost), or train a full fine-tuned checkpoint"
        )
    return architecture


def _write_gated_lora(folder: Path, source: Source, adapter: dict[str, Any], architecture: str) -> dict[str, Any]:
    """``mars_gated_lora.safetensors`` in ``folder`` (listed in a sharded base's index); returns the
    ``config.json`` keys that name the vLLM gated class and record the adapter's shape."""
    from safetensors.torch import save_file

    tensors, record = gated_lora_tensors(source.folder, adapter["settings"])
    save_file(tensors, str(folder / GATED_WEIGHTS))
    _index_gated_weights(folder, tensors)
    return {"architectures": [GATED_ARCHITECTURES[architecture]], GATED_KEY: record}


def export_gated(source: Source, out: Path, *, target: str | None = None, merge: bool = False) -> Path:
    """A gated adapter as the vLLM gated folder (or, ``merge``, full weights with the adapter folded in)."""
    from mars.custom_generate_files import write_config_keys, write_custom_generate
    from mars.metadata import write_metadata
    from mars.persistence import atomic_dir

    adapter = source.adapter or {}
    model = _gated_model(source, adapter, merge)
    architecture = _gated_architecture(source, model, merge)
    pad = _check_target(source, target, source.folder, model.config.to_dict()) if target else None
    if merge:
        _merge_gated(model)
    if pad is not None:
        _pad_rows(model, pad)
    meta = dict(source.metadata)
    meta.pop("adapter", None)
    meta["num_parameters"] = sum(p.numel() for p in model.parameters())
    meta["exported_as"] = "merged" if merge else "gated_vllm"
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(source.folder).save_pretrained(tmp)
        from mars.metadata import MarsMetadata

        write_metadata(tmp, MarsMetadata.from_dict(meta, where=f"metadata of {out}"))
        gated = {} if merge else _write_gated_lora(tmp, source, adapter, architecture)
        write_config_keys(tmp, source.metadata, **gated)
        write_custom_generate(tmp)
    log.info("exported %s (gated adapter, %s) to %s", source.folder, "merged" if merge else "gated", out)
    return out


def _index_gated_weights(folder: Path, tensors: dict[str, Any]) -> None:
    """A sharded base lists its files in ``model.safetensors.index.json``, and vLLM's loader reads only the files
    listed there: the adapter's file joins the list."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data.setdefault("weight_map", {}).update({name: GATED_WEIGHTS for name in tensors})
        index.write_text(json.dumps(data, indent=2) + "\n")


def _merge_gated(model) -> None:
    """Fold a gated adapter into every column's weights (the gate is dropped: a deliberate loss)."""
    from dataclasses import replace

    from mars.adapters import merge_adapter

    model.mars_adapter = replace(model.mars_adapter, kind="lora")
    model.mars_gate.gated = False
    merge_adapter(model)


def export_for_vllm(
    checkpoint: str | os.PathLike, out: str | os.PathLike, *, target: str | None = None, merge: bool = False
) -> Path:
    """The one entry point: a full fine-tuned checkpoint or a gated adapter, see the module docstring."""
    source = inspect_checkpoint(checkpoint)
    out = Path(out)
    if out.resolve() == source.folder.resolve():
        raise ExportError(f"the output folder {out} is the checkpoint itself: choose another folder")
    if source.kind == "full":
        if merge:
            raise ExportError(f"--merge is for gated adapters; {source.folder} holds full weights already")
        return export_full(source, out, target=target)
    return export_gated(source, out, target=target, merge=merge)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m mars.integrations.export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a MARS checkpoint: a full fine-tuned hf/ folder or a gated adapter folder")
    p.add_argument("out", help="the folder to write (replaced when it exists)")
    p.add_argument("--target", help="the model it drafts for (hub id or folder): vocabulary check and row padding")
    p.add_argument("--merge", action="store_true", help="gated adapter: fold it into full weights (loses the gate)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = export_for_vllm(args.checkpoint, args.out, target=args.target, merge=args.merge)
    except ExportError as err:
        p.exit(2, f"error: {err}\n")
    print(f"exported: {out}")


if __name__ == "__main__":
    main()
