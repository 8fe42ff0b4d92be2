"""``--help`` of train.py, evaluate.py and serve.py: the config groups the entry point composes (not every folder
of ``conf/``: no ``trainer`` or ``objective`` for an evaluation, no ``benchmarks`` or ``decoding`` for training) and
each top-level key with its value and its help text from the entry point's pydantic schema
(:class:`~mars.training.config.TrainConfig`, :class:`~mars.evaluation.config.EvaluateConfig`,
:class:`~mars.serving.config.ServeConfig`).

Hydra prints ``hydra.help.template``; ``conf/hydra/help/<entry>.yaml`` sets it to ``${mars_help:<entry>}``, the
resolver registered here, which writes the text from the composed config (``_root_``) when ``--help`` asks for
it.  Hydra's own flags stay on ``--hydra-help``.
"""

from __future__ import annotations

import json

from omegaconf import DictConfig, OmegaConf

SCHEMAS = {
    "train": ("mars.training.config", "TrainConfig"),
    "evaluate": ("mars.evaluation.config", "EvaluateConfig"),
    "serve": ("mars.serving.config", "ServeConfig"),
}
TITLES = {
    "train": "python train.py (mars-train): MARS continued training, or plain AR SFT with objective=ar",
    "evaluate": "python evaluate.py (mars-eval): benchmark a (MARS) model at one threshold or a threshold sweep",
    "serve": "python serve.py (mars-serve): the OpenAI-compatible MARS server",
}
DOCS = {"train": "docs/training.md", "evaluate": "docs/evaluation.md", "serve": "docs/serving.md"}
NESTED = {"train": "optim.lr=1e-5", "evaluate": "decoding.block_size=8", "serve": "decoding.block_size=8"}
WIDTH = 110


def schema_of(entry: str):
    import importlib

    module, name = SCHEMAS[entry]
    return getattr(importlib.import_module(module), name)


def key_help(info) -> str:
    """A field's help text: its ``help`` (schema extra), else its ``description``, else the one declared inside
    a union (``Annotated[int, Field(description=...)] | None``)."""
    from typing import get_args

    from pydantic.fields import FieldInfo

    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if extra.get("help") or info.description:
        return str(extra.get("help") or info.description)
    stack = list(get_args(info.annotation))
    while stack:
        arg = stack.pop(0)
        if isinstance(arg, FieldInfo) and arg.description:
            return arg.description
        stack.extend(get_args(arg))
    return ""


def _group_options(group: str) -> list[str]:
    """The options of a config group on Hydra's search path (``--config-dir`` folders included)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    if GlobalHydra.instance().is_initialized():
        return sorted(GlobalHydra.instance().config_loader().get_group_options(group, ObjectType.CONFIG))
    from mars.paths import conf_dir

    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def _value(root: DictConfig, key: str) -> str:
    """The key's value as a short line (resolved where it can be; a mapping as its keys)."""
    try:
        value = OmegaConf.to_container(root[key], resolve=True) if OmegaConf.is_config(root[key]) else root[key]
    except Exception:  # an interpolation that cannot resolve here: show it as written
        value = OmegaConf.to_container(root, resolve=False).get(key)
    if isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {json.dumps(v, default=str)}" for k, v in value.items()) + "}"
    else:
        text = json.dumps(value, default=str)
    return text if len(text) <= 70 else text[:67] + "..."


def _wrap(text: str, indent: str) -> list[str]:
    import textwrap

    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent) or [indent]


def help_text(entry: str, root: DictConfig) -> str:
    """The help page of ``entry`` (evaluate | serve) for the composed config ``root``."""
    schema = schema_of(entry)
    choices = dict(OmegaConf.select(root, "hydra.runtime.choices", default={}) or {})
    groups = sorted(g for g in choices if not g.startswith("hydra") and "/" not in g)
    lines = [TITLES[entry], f"Override any key with key=value and pick a config with group=option ({DOCS[entry]}).", ""]
    lines += ["== Config groups (group=option; * the current one) ==", ""]
    for group in groups:
        options = ", ".join(o + ("*" if o == choices[group] else "") for o in _group_options(group))
        lines += _wrap(f"{group}: {options}" + ("" if choices[group] else " (none chosen)"), "")
        about = key_help(schema.model_fields[group]) if group in schema.model_fields else ""
        lines += _wrap(about, "    ") if about else []
    lines += ["", "== Keys (key=value) ==", ""]
    for key in root:
        if key in groups or key == "hydra" or key not in schema.model_fields:
            continue
        lines.append(f"{key} = {_value(root, key)}")
        about = key_help(schema.model_fields[key])
        lines += _wrap(about, "    ") if about else []
    lines.append("")
    lines += _wrap(
        f"Nested keys (e.g. {NESTED[entry]}) are listed with their values by --cfg job; Hydra's own flags "
        "(-m, --config-dir, --cfg, ...) by --hydra-help.",
        "",
    )
    return "\n".join(lines).replace("$", "$$") + "\n"  # Hydra substitutes $NAME placeholders in the template


def _resolve(entry: str, *, _root_: DictConfig) -> str:
    return help_text(str(entry), _root_)


def register_resolver() -> None:
    if not OmegaConf.has_resolver("mars_help"):
        OmegaConf.register_new_resolver("mars_help", _resolve)


register_resolver()

__all__ = ["help_text", "key_help", "register_resolver"]
