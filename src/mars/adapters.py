"""Low-rank adapters for MARS training: peft's LoRA layers injected in place, optionally gated to mask columns.

* ``gated_lora`` (Samragh et al., "Your LLM Knows the Future", arXiv 2507.11851): the adapters act only at
  columns whose input token is the mask token.  Every column holding a real token runs the frozen base
  weights, so threshold 1.0 and lossless verify mode are bit-identical to the base model, the clean stream of
  a training step needs no gradient (a cheaper step), and the trained artifact is an adapter of a few MB
  that :func:`mars.models.load_model` applies to its base.  The gate is computed once per forward from the
  ``input_ids`` (a pre-hook on the decoder), so every caller -- the decoding engine, verify mode, the
  server, evaluation, ``transformers`` ``generate`` -- gets the right weights at the right columns without
  knowing about the adapter; a forward with no mask token switches the adapters off altogether.
* ``lora``: ordinary LoRA on every column, trained with the AR loss beside the mask loss and merged into the
  weights at export (a vanilla checkpoint again, no new parameters).

Both can also learn the mask token's input embedding (``mask_embedding``): a delta added where the input is
the mask token.  The head row of the mask token is untouched (tied embeddings stay tied), so real columns'
logits do not change.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

ADAPTER_KINDS = ("none", "gated_lora", "lora")
ADAPTER_META = "mars_adapter.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MASK_DELTA_KEY = "mars.mask_embedding_delta"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdapterError(ValueError):
    """An adapter that cannot be used with this model: another base, another block size, applied twice."""


@dataclass(frozen=True)
class AdapterSettings:
    kind: str = "none"  # none (full fine-tuning) | gated_lora | lora
    rank: int = 32
    alpha: float | None = None  # lora_alpha; None = rank (scaling 1)
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    # adapt only the top N decoder layers (None = all): with mask_embedding off the backward pass stops there
    top_layers: int | None = None
    mask_embedding: bool = True  # learn a delta for the mask token's input embedding
    # training only: start from a saved adapter's weights (warm_start_adapter), not from a fresh LoRA init
    init_from: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ADAPTER_KINDS:
            raise ValueError(f"adapter.kind must be one of {ADAPTER_KINDS}, got {self.kind!r}")
        if not _is_int(self.rank) or self.rank < 1:
            raise ValueError(f"adapter.rank must be an integer >= 1, got {self.rank!r}")
        if self.alpha is not None and (not _is_number(self.alpha) or self.alpha <= 0):
            raise ValueError(f"adapter.alpha must be a number > 0 or null (= rank), got {self.alpha!r}")
        if not _is_number(self.dropout) or not 0 <= self.dropout < 1:
            raise ValueError(f"adapter.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules or not all(isinstance(t, str) and t for t in self.target_modules):
            raise ValueError(
                f"adapter.target_modules must be a non-empty list of module names, got {self.target_modules!r}"
            )
        if self.top_layers is not None and (not _is_int(self.top_layers) or self.top_layers < 1):
            raise ValueError(
                f"adapter.top_layers must be null (all layers) or an integer >= 1, got {self.top_layers!r}"
            )
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from.strip()):
            raise ValueError(f"adapter.init_from must be null or an adapter folder, got {self.init_from!r}")
        if self.init_from is not None and self.kind == "none":
            raise ValueError(
                "adapter.init_from starts an adapter from a saved one: it needs adapter.kind gated_lora or lora"
            )
        object.__setattr__(self, "target_modules", tuple(self.target_modules))

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> AdapterSettings:
        data = dict(data or {})
        data.pop("name", None)  # the config group's label
        unknown = set(data) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"unknown adapter settings {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**data)

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    @property
    def gated(self) -> bool:
        return self.kind == "gated_lora"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ------------------------------------------------------------------------------------------
# The gate
# ------------------------------------------------------------------------------------------
@dataclass(eq=False)
class MaskGate:
    """Where the adapters act in the current forward: ``active`` is ``[batch, seq, 1]`` (1.0 at mask columns)
    or None when the input holds no mask token (adapters off: exactly the base computation)."""

    mask_token_id: int
    lora_layers: list[nn.Module]
    gated: bool
    delta: nn.Parameter | None = None
    active: torch.Tensor | None = None
    handles: list[Any] = field(default_factory=list)

    def before_decoder(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            if kwargs.get("inputs_embeds") is not None:
                raise ValueError(
                    "a model with a mask adapter needs input_ids (the gate reads the mask token's columns)"
                )
            return None
        where = ids == self.mask_token_id
        any_mask = bool(where.any())
        self.active = where.unsqueeze(-1).to(self._dtype()) if any_mask else None
        if self.gated:
            for layer in self.lora_layers:
                layer._disable_adapters = not any_mask  # peft's flag; enable_adapters() would also freeze them
        return None

    def _dtype(self) -> torch.dtype:
        return self.delta.dtype if self.delta is not None else torch.float32

    def after_lora_a(self, module, inputs, output):
        """Gate the rank-r activations: ``B(A(x) * g) = B(A(x)) * g`` at r/out_features of the cost."""
        if self.active is None:
            return output
        return output * self.active.reshape(*output.shape[:-1], 1).to(output.dtype)

    def after_embedding(self, module, inputs, output):
        if self.active is None or self.delta is None:
            return output
        gate = self.active.reshape(*output.shape[:-1], 1).to(output.dtype)
        return output + gate * self.delta.to(output.dtype)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _decoder(model: nn.Module) -> nn.Module:
    inner = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(inner, nn.Module) or inner is model:
        raise AdapterError(f"{type(model).__name__} has no inner decoder model to gate")
    return inner


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def has_adapter(model: nn.Module) -> bool:
    return getattr(model, "mars_gate", None) is not None or bool(_lora_layers(model))


# ------------------------------------------------------------------------------------------
# Attach, save, load, merge
# ------------------------------------------------------------------------------------------
def lora_config(settings: AdapterSettings, num_layers: int):
    from peft import LoraConfig

    layers = None
    if settings.top_layers is not None:
        first = max(0, num_layers - settings.top_layers)
        layers = list(range(first, num_layers))
    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha if settings.alpha is not None else settings.rank,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        layers_to_transform=layers,
        bias="none",
    )


def attach_adapter(model: nn.Module, settings: AdapterSettings, mask_token_id: int) -> MaskGate:
    """Inject fresh LoRA layers into ``model`` (in place), freeze everything else, install the gate.
    Returns the gate (also ``model.mars_gate``); trainable parameters are the LoRA matrices and the delta."""
    from peft import inject_adapter_in_model

    if not settings.enabled:
        raise ValueError("attach_adapter needs adapter.kind gated_lora or lora")
    if has_adapter(model):
        raise AdapterError("this model already carries an adapter: an adapter is applied once, to its base model")
    if getattr(model, "mars_base_digest", None) is None:
        # taken now, in the precision the base was loaded in: bf16-true training casts the whole model later,
        # and an adapter must record the base it will be loaded onto, not the cast copy it trained beside
        model.mars_base_digest = base_digest(model)
    for p in model.parameters():
        p.requires_grad_(False)
    inject_adapter_in_model(lora_config(settings, model.config.num_hidden_layers), model)
    layers = _lora_layers(model)
    if not layers:
        raise AdapterError(
            f"no module of {type(model).__name__} matches adapter.target_modules={settings.target_modules}"
        )
    for layer in layers:
        for name, p in layer.named_parameters():
            p.requires_grad_("lora_" in name)
    embed = model.get_input_embeddings()
    delta = None
    if settings.mask_embedding:
        delta = nn.Parameter(torch.zeros(embed.weight.shape[1], dtype=embed.weight.dtype, device=embed.weight.device))
    gate = MaskGate(int(mask_token_id), layers, settings.gated, delta)
    _install(model, gate, settings)
    return gate


def _install(model: nn.Module, gate: MaskGate, settings: AdapterSettings) -> None:
    gate.handles.append(_decoder(model).register_forward_pre_hook(gate.before_decoder, with_kwargs=True))
    if settings.gated:
        for layer in gate.lora_layers:
            for module in layer.lora_A.values():
                gate.handles.append(module.register_forward_hook(gate.after_lora_a))
    if gate.delta is not None:
        gate.handles.append(model.get_input_embeddings().register_forward_hook(gate.after_embedding))
        # a registered parameter: optimizers, state dicts and .to() see it like any other
        model.register_parameter("mars_mask_embedding_delta", gate.delta)
    model.mars_gate = gate
    model.mars_adapter = settings


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's own tensors (LoRA matrices in peft's key format, plus the mask-embedding delta)."""
    from peft import get_peft_model_state_dict

    state = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    gate = getattr(model, "mars_gate", None)
    if gate is not None and gate.delta is not None:
        state[MASK_DELTA_KEY] = gate.delta.detach().cpu().contiguous()
    return state


def base_digest(model: nn.Module) -> str:
    """A digest of every base weight (tensor by tensor, in name order; adapters excluded), so an adapter
    is never applied to a model it was not trained on."""
    h = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        if "lora_" in name or name == "mars_mask_embedding_delta":
            continue
        name = name.replace(".base_layer.", ".")
        h.update(name.encode())
        t = tensor.detach().cpu().contiguous()
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def recorded_base_digest(model: nn.Module) -> str:
    """The digest of ``model``'s base as it was when the adapter was attached (before any cast)."""
    return getattr(model, "mars_base_digest", None) or base_digest(model)


def write_adapter(model: nn.Module, folder: Path, meta: dict[str, Any], dtype: torch.dtype | None = None) -> None:
    """``adapter_config.json`` + ``adapter_model.safetensors`` (peft's format; its tensors in ``dtype`` when
    given) + ``mars_adapter.json`` (kind, base model and its weights' digest, block size, mask token, the
    adapter's parameter count) into an existing ``folder``."""
    from safetensors.torch import save_file

    settings: AdapterSettings = model.mars_adapter
    config = lora_config(settings, model.config.num_hidden_layers)
    config.base_model_name_or_path = None  # transformers must not load it ungated on its own
    config.save_pretrained(folder)
    state = adapter_state_dict(model)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    save_file(state, folder / ADAPTER_WEIGHTS)
    meta = {**meta, "adapter_parameters": sum(t.numel() for t in state.values())}
    (folder / ADAPTER_META).write_text(json.dumps({"settings": asdict(settings), **meta}, indent=2) + "\n")


def save_adapter(model: nn.Module, folder: str | os.PathLike, meta: dict[str, Any]) -> Path:
    """:func:`write_adapter` into ``folder``, atomically (it appears complete or not at all)."""
    from mars.persistence import atomic_dir

    with atomic_dir(folder) as tmp:
        write_adapter(model, Path(tmp), meta)
    return Path(folder)


def read_adapter_meta(folder: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(folder) / ADAPTER_META
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise AdapterError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("settings"), dict):
        raise AdapterError(f"{path}: no 'settings' object")
    return meta


def check_adapter_files(folder: str | os.PathLike, meta: dict[str, Any]) -> Path:
    """Refuse, before any model loads, an adapter whose base cannot be checked (no ``base_digest``: it would
    be applied to any base without a word) or whose weights file is missing or truncated (naming the file).
    Returns the weights file."""
    from mars.persistence import check_safetensors

    digest = meta.get("base_digest")
    if not isinstance(digest, str) or not digest.strip():
        raise AdapterError(
            f"{Path(folder) / ADAPTER_META} records no base_digest (got {digest!r}), so the base model it was "
            "trained on cannot be checked and it could be applied to another base; export it again from its "
            "training run (train.py writes the digest)"
        )
    weights = Path(folder) / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise AdapterError(f"{folder} has no {ADAPTER_WEIGHTS}: the adapter's weights are missing")
    try:
        check_safetensors(weights)
    except ValueError as err:
        raise AdapterError(str(err)) from None
    return weights


def _check_complete(folder: str | os.PathLike, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every tensor the adapter's settings give the model is in the file: a missing one would stay at its
    initial value (``lora_B`` at zero: that layer silently unadapted)."""
    missing = sorted(set(adapter_state_dict(model)) - set(state))
    if missing:
        raise AdapterError(
            f"{Path(folder) / ADAPTER_WEIGHTS} lacks {len(missing)} of the adapter's tensors, e.g. {missing[:6]}: "
            "the file is incomplete or was written for other adapter settings (mars_adapter.json)"
        )


def _check_adapter_fits(
    model: nn.Module,
    folder: str | os.PathLike,
    meta: dict[str, Any],
    mask_token_id: int,
    block_size: int | None,
    model_label: str,
) -> str:
    """Refuse the adapter recorded by ``meta`` for a ``model`` that already carries one, that is not its base
    (weights digest), or whose block size or mask token id differ from the adapter's; returns the base digest."""
    if has_adapter(model):
        raise AdapterError(
            f"the model already carries an adapter; {folder} must be applied to its base model "
            f"({meta.get('base_model')}), not to a checkpoint that already has it"
        )
    have = base_digest(model)
    _check_same_base(folder, meta, have, mask_token_id, block_size, model_label)
    return have


def _check_same_base(
    folder: str | os.PathLike,
    meta: dict[str, Any],
    have: str,
    mask_token_id: int,
    block_size: int | None,
    model_label: str,
) -> None:
    """Refuse the adapter recorded by ``meta`` for a base of weights digest ``have`` that is not its own, or whose
    block size or mask token id differ from the adapter's."""
    want = meta["base_digest"]
    if want != have:
        raise AdapterError(
            f"{folder} was trained on base model {meta.get('base_model')!r} (weights digest {want}); "
            f"{model_label} it is being applied to has digest {have}: another base model"
        )
    if block_size is not None and meta.get("block_size") not in (None, block_size):
        raise AdapterError(f"{folder} was trained with block size {meta.get('block_size')}, not {block_size}")
    if meta.get("mask_token_id") not in (None, mask_token_id):
        raise AdapterError(
            f"{folder} uses mask token id {meta.get('mask_token_id')}; this tokenizer's is {mask_token_id}"
        )


def _load_adapter_weights(model: nn.Module, folder: str | os.PathLike, weights: Path, gate: MaskGate) -> None:
    """The adapter's saved weights into the LoRA layers just attached, and its mask-embedding delta into ``gate``;
    refused when they do not fit the model or its settings."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(weights))
    _check_complete(folder, model, state)
    delta = state.pop(MASK_DELTA_KEY, None)
    result = set_peft_model_state_dict(model, state)
    if getattr(result, "unexpected_keys", None):
        raise AdapterError(f"{folder}: adapter weights that do not fit this model: {result.unexpected_keys[:5]}")
    if delta is not None:
        if gate.delta is None:
            raise AdapterError(f"{folder}: a mask-embedding delta but settings.mask_embedding is false")
        gate.delta.data.copy_(delta.to(gate.delta.dtype))


def load_adapter(
    model: nn.Module,
    folder: str | os.PathLike,
    mask_token_id: int,
    *,
    block_size: int | None = None,
    model_label: str = "the model",
):
    """Apply the adapter in ``folder`` to ``model`` (its base), after checking that it belongs to it."""
    meta = read_adapter_meta(folder)
    if meta is None:
        raise AdapterError(f"{folder} holds no {ADAPTER_META}: not a MARS adapter")
    settings = AdapterSettings.from_dict(meta["settings"])
    weights = check_adapter_files(folder, meta)
    digest = _check_adapter_fits(model, folder, meta, mask_token_id, block_size, model_label)
    model.mars_base_digest = digest  # checked above: attach_adapter need not read the weights again
    gate = attach_adapter(model, settings, mask_token_id)
    _load_adapter_weights(model, folder, weights, gate)
    for p in model.parameters():
        p.requires_grad_(False)
    return gate


def _scaling(settings: AdapterSettings) -> float:
    """peft's LoRA scale: alpha / rank (alpha null: 1)."""
    return (settings.alpha if settings.alpha is not None else settings.rank) / settings.rank


def warm_start_adapter(model: nn.Module, folder: str | os.PathLike, block_size: int | None = None) -> None:
    """Set the fresh adapter attached to ``model`` to the one saved in ``folder``: the same kind, targets and
    layers, at the same or a higher rank.  Each layer keeps the saved product at the saved scale (``B[:, :r0]``
    rescaled to the new alpha / rank); the extra directions start as fresh LoRA ones do (A random, B zero), so
    the model predicts exactly what the saved adapter does and every direction can still learn.  What it is
    for: a long training run continued, piece by piece, on machines that keep only committed files (the small
    adapter), not its optimizer states."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    settings: AdapterSettings | None = getattr(model, "mars_adapter", None)
    if settings is None:
        raise AdapterError("warm_start_adapter: attach an adapter first")
    meta = read_adapter_meta(folder)
    if meta is None:
        raise AdapterError(f"adapter.init_from={folder} holds no {ADAPTER_META}: not a MARS adapter")
    saved = AdapterSettings.from_dict(meta["settings"])
    differ = [
        f"{k}: {getattr(saved, k)!r} there, {getattr(settings, k)!r} here"
        for k in ("kind", "target_modules", "top_layers", "mask_embedding")
        if getattr(saved, k) != getattr(settings, k)
    ]
    if saved.rank > settings.rank:
        differ.append(f"rank: {saved.rank} there, above {settings.rank} here")
    if differ:
        raise AdapterError(f"adapter.init_from={folder} does not fit this run's adapter ({'; '.join(differ)})")
    weights = check_adapter_files(folder, meta)
    gate: MaskGate = model.mars_gate
    _check_same_base(folder, meta, recorded_base_digest(model), gate.mask_token_id, block_size, "the run's model")
    state = load_file(str(weights))
    _check_complete(folder, model, state)
    delta = state.pop(MASK_DELTA_KEY, None)
    fresh = get_peft_model_state_dict(model)
    start = {}
    for key, new in fresh.items():
        old = state[key].to(new.dtype)
        new = new.detach().clone()
        if ".lora_A." in key:
            new[: old.shape[0]] = old
        else:  # lora_B: the saved product at the saved scale
            new.zero_()[:, : old.shape[1]] = old * (_scaling(saved) / _scaling(settings))
        start[key] = new
    set_peft_model_state_dict(model, start)
    if delta is not None:
        gate.delta.data.copy_(delta.to(gate.delta.dtype))


def truncate_adapter_rank(model: nn.Module, rank: int) -> float:
    """Replace each gated LoRA layer's factors by the best rank-``rank`` approximation of their product
    (its top singular directions), for decoding: a step with masks then reads and multiplies ``rank`` instead
    of ``r`` rows of factors per projection.  The gate keeps the base model's columns exact, so threshold 1.0
    and verify mode are unchanged; the masks' predictions move (slightly, where the product is nearly low-rank).
    Returns the smallest share of a product's energy (squared singular values) that any layer keeps.  The
    model's adapter settings follow (``rank``, and ``alpha`` so that peft's scaling alpha / rank is unchanged),
    so it saves as a rank-``rank`` adapter (``python -m mars.training.adapter_rank``)."""
    settings: AdapterSettings | None = getattr(model, "mars_adapter", None)
    if settings is None:
        raise AdapterError("truncate_adapter_rank: the model carries no MARS adapter")
    if not settings.gated:
        raise AdapterError("truncate_adapter_rank: only a gated adapter (an ungated one changes every column)")
    if not _is_int(rank) or rank < 1:
        raise AdapterError(f"truncate_adapter_rank: rank must be an integer >= 1, got {rank!r}")
    if rank >= settings.rank:
        return 1.0
    kept = 1.0
    with torch.no_grad():
        for layer in _lora_layers(model):
            down, up = layer.lora_A["default"], layer.lora_B["default"]
            # B A = (Qb Rb)(Qa Ra)^T: the SVD of the small r x r core gives the product's, in float64
            qb, rb = torch.linalg.qr(up.weight.double())
            qa, ra = torch.linalg.qr(down.weight.double().T)
            u, sv, vh = torch.linalg.svd(rb @ ra.T)
            energy = sv.square()
            kept = min(kept, float(energy[:rank].sum() / energy.sum().clamp_min(1e-300)))
            root = sv[:rank].sqrt()
            dtype = down.weight.dtype
            # replace the weights in place: the gate's hooks sit on these modules
            up.weight = nn.Parameter(((qb @ u[:, :rank]) * root).to(dtype).contiguous(), requires_grad=False)
            down.weight = nn.Parameter((root[:, None] * (vh[:rank] @ qa.T)).to(dtype).contiguous(), requires_grad=False)
            up.in_features = down.out_features = rank
            layer.r["default"] = rank
    model.mars_adapter = replace(settings, rank=rank, alpha=_scaling(settings) * rank)
    return kept


def merge_adapter(model: nn.Module) -> nn.Module:
    """Fold an ungated LoRA (and the mask-embedding delta) into the weights and remove every trace of the
    adapter: the result is the plain architecture with the base parameter count."""
    settings: AdapterSettings | None = getattr(model, "mars_adapter", None)
    if settings is None:
        return model
    if settings.gated:
        raise AdapterError("a gated adapter cannot be merged: it acts at mask columns only")
    gate: MaskGate = model.mars_gate
    with torch.no_grad():
        for layer in _lora_layers(model):
            layer._disable_adapters = False
            layer.merge()
        if gate.delta is not None:
            model.get_input_embeddings().weight[gate.mask_token_id] += gate.delta.to(
                model.get_input_embeddings().weight.dtype
            )
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if child in gate.lora_layers:
                setattr(module, child_name, child.get_base_layer())
    gate.remove()
    if "mars_mask_embedding_delta" in model._parameters:
        del model._parameters["mars_mask_embedding_delta"]
    for attr in ("mars_gate", "mars_adapter", "peft_config", "_hf_peft_config_loaded"):
        if hasattr(model, attr):
            try:
                delattr(model, attr)
            except AttributeError:
                pass
    return model
