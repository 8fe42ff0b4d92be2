"""One command-line style for the benchmark tools (every ``mars-bench <tool>``).

Every benchmark builds its parser here: the same formatter and description, the same shared flags
(``--model``, ``--checkpoint``, ``--dtype``, ``--device``, ``--threads``, ``--repeats``, ``--warmup``,
``--out``), comma-separated lists parsed and checked the same way, prompt files read by one reader
(:mod:`mars.prompt_files`, its refusals naming the flag), and the decoding flags derived from
:class:`~mars.decoding.settings.DecodingSettings`' fields: each field ``foo_bar`` is ``--foo-bar``,
with the help text, default and allowed values declared once in the dataclass.  A field added there is
a flag of every benchmark that takes decoding options, without further code.

No torch import: a bad flag is refused before any model loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from mars.decoding.settings import DecodingSettings
from mars.hardware import DTYPES
from mars.prompt_files import PROMPT_FIELDS, PromptFileError, PromptRow, read_prompt_file

DEFAULT_MODEL = "embedded:smollm2-135m"


def parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser: ``doc``'s first paragraph as the description, defaults shown in ``--help``."""
    description = (doc or "").strip().split("\n\n")[0]
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=_Formatter)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults appended to every help line (no flag repeats its default in prose)."""


# ---------------------------------------------------------------------------------------- shared flags
def add_model(
    p: argparse.ArgumentParser,
    default: str = DEFAULT_MODEL,
    checkpoint: bool = True,
    model_help: str = "embedded:smollm2-135m, a hub id or a local directory",
    checkpoint_help: str = "MARS checkpoint directory (overrides --model)",
) -> None:
    p.add_argument("--model", default=default, help=model_help)
    if checkpoint:
        p.add_argument("--checkpoint", default=None, help=checkpoint_help)


def add_dtype(p: argparse.ArgumentParser, default: str = "auto") -> None:
    p.add_argument(
        "--dtype",
        default=default,
        choices=list(DTYPES),
        help="auto: bf16 on GPUs; float32 on CPUs (the fp32 decode fast path beats bf16 there), bf16 only where it is "
        "native (AVX512-BF16/AMX) and the fast path cannot run",
    )


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")


def add_timing(p: argparse.ArgumentParser, repeats: int, warmup: int) -> None:
    p.add_argument("--repeats", type=int, default=repeats, help="timed runs per configuration (median reported)")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed runs before timing")


def add_out(p: argparse.ArgumentParser, default: str | None, help: str = "output directory") -> None:
    p.add_argument("--out", default=default, help=help)


def comma_list(text: str, flag: str, cast: Callable[[str], Any] = str, allowed: Iterable | None = None) -> list:
    """``"1,4,8"`` as a list, each item cast and (with ``allowed``) checked; a bad item fails naming the flag."""
    try:
        items = [cast(x.strip()) for x in str(text).split(",") if x.strip()]
    except ValueError as err:
        raise SystemExit(f"{flag} takes a comma-separated list, got {text!r}: {err}") from None
    if not items:
        raise SystemExit(f"{flag} must not be empty")
    allowed = list(allowed) if allowed is not None else None
    bad = [x for x in items if allowed is not None and x not in allowed]
    if bad:
        raise SystemExit(f"{flag}: unknown {bad}; choose from {allowed}")
    return items


def positive_ints(text: str, flag: str) -> list[int]:
    """``"1,4,8"`` as positive integers (batch sizes, column counts)."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"{flag} takes comma-separated positive integers, got {text!r}")
    return values


def prompt_rows(
    path: str | os.PathLike,
    flag: str,
    fields: Sequence[str] = PROMPT_FIELDS,
    require: Mapping[str, str] | None = None,
) -> list[PromptRow]:
    """The rows of the prompt file a flag names (:func:`mars.prompt_files.read_prompt_file`): a bad line, or a file
    without a prompt, refused naming the flag, the file and the line."""
    try:
        rows = read_prompt_file(path, fields, require)
    except PromptFileError as err:
        raise SystemExit(f"{flag} {err}") from None
    if not rows:
        raise SystemExit(f"{flag} {path}: no prompts (one JSON object per line)")
    return rows


# ------------------------------------------------------------------------------------- decoding flags
def decoding_fields(include: Sequence[str] | None = None, exclude: Sequence[str] = ()) -> list[dataclasses.Field]:
    """DecodingSettings' fields as flags: ``include`` (in that order) or every field not in ``exclude``."""
    fields = {f.name: f for f in dataclasses.fields(DecodingSettings)}
    unknown = sorted((set(include or ()) | set(exclude)) - set(fields))
    if unknown:
        raise ValueError(f"not DecodingSettings fields: {unknown}")
    names = list(include) if include is not None else [n for n in fields if n not in exclude]
    return [fields[n] for n in names]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_decoding(
    p: argparse.ArgumentParser,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    defaults: Mapping[str, Any] | None = None,
    title: str = "decoding settings (mars.decoding.DecodingSettings)",
) -> list[str]:
    """One flag per DecodingSettings field (see :func:`decoding_fields`), default from the dataclass unless
    ``defaults`` names a benchmark's own (e.g. shorter outputs); returns the field names added."""
    defaults = dict(defaults or {})
    hints = typing.get_type_hints(DecodingSettings)
    group = p.add_argument_group(title)
    names = []
    for f in decoding_fields(include, exclude):
        default = defaults.pop(f.name, f.default)
        # argparse %-formats help strings: a literal "5%" in a field's help would break --help
        text = f.metadata.get("help", "").replace("%", "%%")
        if hints[f.name] is bool:
            group.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            choices = f.metadata.get("choices")
            group.add_argument(
                flag(f.name),
                dest=f.name,
                default=default,
                type=_converter(f.name, hints[f.name]),
                choices=list(choices) if choices else None,
                metavar=None if choices else f.name.upper(),
                help=text,
            )
        names.append(f.name)
    if defaults:
        raise ValueError(f"defaults for fields that are not flags here: {sorted(defaults)}")
    return names


def _converter(name: str, hint: Any) -> Callable[[str], Any]:
    """Text to the field's type: ``int``/``float`` where the type allows, ``none`` for optional fields,
    else the string (a name); anything else is refused naming the flag's field."""
    kinds = typing.get_args(hint) or (hint,)

    def convert(text: str) -> Any:
        if type(None) in kinds and text.strip().lower() in ("none", "null"):
            return None
        for kind in (int, float):
            if kind in kinds:
                try:
                    return kind(text)
                except ValueError:
                    pass
        if str in kinds:
            return text
        allowed = " or ".join(k.__name__ for k in kinds)
        raise argparse.ArgumentTypeError(f"{name} takes {allowed}, got {text!r}")

    convert.__name__ = name  # argparse names it in "invalid <name> value"
    return convert


def decoding_values(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The decoding flags' values, by field name (``None`` where a field's default is computed later)."""
    return {name: getattr(args, name) for name in names}


def check_settings(flag_text: str, **values: Any) -> DecodingSettings:
    """DecodingSettings from flag values, its error (which names the field and the allowed values) as the
    command's exit message before any model loads."""
    try:
        return DecodingSettings(**{k: v for k, v in values.items() if v is not None})
    except ValueError as err:
        raise SystemExit(f"{flag_text}: {err}") from None
