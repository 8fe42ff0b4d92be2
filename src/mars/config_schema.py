"""Declared config schemas: each run config (train, evaluate, serve) is checked by one pydantic model that
states every key's type and allowed range, and every refusal names the key, what it allows and what it got
(``optim.lr must be a number > 0, got -1``).

The YAML files under ``conf/`` hold the values: the defaults a user reads and overrides.  A schema holds
types, ranges and the checks across keys, so no default is written twice; a field has a default here only
where its YAML does not always give the key (``None``: "not set").  Sections are strict (``1`` is not
``true``, ``4.0`` is not an integer), a :class:`Section` refuses keys it does not declare, and an
:class:`OpenSection` passes undeclared keys on to whoever consumes them (Lightning's ``Trainer`` takes the
rest of ``trainer``).  The objects a section builds (``Objective``, ``AdapterSettings``, ``DecodingSettings``)
keep their own checks: :func:`built_by` runs them as the field's validator.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

import annotated_types as at
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, InstanceOf, ValidationError
from pydantic.fields import FieldInfo

M = TypeVar("M", bound="Section")


class ConfigError(ValueError):
    """A config value its schema does not allow; the message names the key."""


class Section(BaseModel):
    """A config section whose keys are all declared: an undeclared key is refused, not ignored."""

    # NaN and infinity are refused like any value out of range: no key of a run means either (a NaN lr or
    # budget trains forever or not at all), as the server's request schemas refuse them
    model_config = ConfigDict(strict=True, extra="forbid", arbitrary_types_allowed=True, allow_inf_nan=False)
    # the section's key when it is checked on its own by validated() (prefixes the messages); built
    # directly (``Section(**values)``) it raises pydantic's own ValidationError, also a ValueError
    section: ClassVar[str] = ""


class OpenSection(Section):
    """A section that declares the keys it checks and keeps the others for their consumer."""

    model_config = ConfigDict(extra="allow")


def validated(schema: type[M], data: Any, where: str | None = None) -> M:
    """``data`` (a plain mapping) checked against ``schema``; a :class:`ConfigError` naming each bad key
    otherwise.  ``where`` prefixes the keys (default: the schema's ``section``)."""
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise ConfigError(render(err, schema, schema.section if where is None else where)) from None


def built_by(cls: type, build: Callable[[Mapping[str, Any]], Any]) -> Any:
    """A field holding a ``cls`` object made from its config mapping by ``build`` (the object's own checks,
    e.g. ``Objective(**mapping)``); an instance passes as it is."""

    def make(value: Any) -> Any:
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"must be a mapping of {cls.__name__} settings")
        return build(value)

    return Annotated[InstanceOf[cls], BeforeValidator(make)]


def _dtype_name(name: str) -> str:
    from mars.hardware import validate_dtype

    return validate_dtype(name)


DtypeName = Annotated[str, AfterValidator(_dtype_name)]  # auto | float32 | bfloat16 | float16


def known_keys(cls: type, mapping: Mapping[str, Any], section: str, ignore: tuple[str, ...] = ()) -> dict[str, Any]:
    """``mapping`` as keyword arguments of the dataclass ``cls``; an unknown key is refused naming the known."""
    fields = set(getattr(cls, "__dataclass_fields__", {}))
    values = {k: v for k, v in mapping.items() if k not in ignore}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"unknown {section} setting(s) {unknown}; known: {sorted(fields)}")
    return values


# ------------------------------------------------------------------------------------------
# Messages
# ------------------------------------------------------------------------------------------
def render(err: ValidationError, schema: type[BaseModel], where: str = "") -> str:
    """One sentence per bad key (a union's failed alternatives are one key, said once)."""
    messages = [_message(e, schema, where) for e in err.errors()]
    return "; ".join(dict.fromkeys(messages))


def _message(error: dict[str, Any], schema: type[BaseModel], where: str) -> str:
    key, info = _locate(schema, error["loc"], extra=error["type"] == "extra_forbidden")
    key = ".".join(p for p in (where, key) if p)
    secret = info is not None and info.repr is False  # never echo it (an API key)
    got = f", got a value of type {type(error['input']).__name__}" if secret else f", got {error['input']!r}"
    if error["type"] == "extra_forbidden":
        return f"{key} is not a known setting{_known(schema, error['loc'])}"
    if error["type"] == "finite_number":
        return f"{key} must be a finite number{_range_of(info)}{got}"
    if error["type"] == "missing":
        return f"{key} is missing (it must be {_allowed(info)})" if info else f"{key} is missing"
    if error["type"] in ("value_error", "assertion_error"):
        text = str(error.get("ctx", {}).get("error", error["msg"]))
        if text.startswith("must "):
            return f"{key} {text}{got}"
        names_key = not key or text.startswith(key) or f"{key}=" in text or f"{key}." in text
        return text if names_key else f"{key}: {text}"
    if info is None:
        return f"{key}: {error['msg'][:1].lower()}{error['msg'][1:]}{got}"
    return f"{key} must be {_allowed(info)}{got}"


def _locate(schema: type[BaseModel], loc: tuple, extra: bool = False) -> tuple[str, FieldInfo | None]:
    """The dotted key and the declared field of an error location (union tags and list indexes end it)."""
    parts: list[str] = []
    info, model = None, schema
    for part in loc:
        if isinstance(part, int) and parts:
            parts[-1] += f"[{part}]"  # a list item: the field's description is the list's
            info, model = None, None
            continue
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            break
        info = model.model_fields[part]
        parts.append(part)
        model = _section_of(info.annotation)
    if extra and loc and loc[-1] not in parts:
        parts.append(str(loc[-1]))
    return ".".join(parts), info


def _section_of(annotation: Any) -> type[BaseModel] | None:
    for arg in (annotation, *get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _known(schema: type[BaseModel], loc: tuple) -> str:
    model = schema
    for part in loc[:-1]:
        info = model.model_fields.get(part) if isinstance(part, str) else None
        model = _section_of(info.annotation) if info else None
        if model is None:
            return ""
    return f"; known: {sorted(model.model_fields)}"


def _allowed(info: FieldInfo) -> str:
    text = _describe(info.annotation, list(info.metadata))
    description = info.description or _inner_description(info.annotation)
    return f"{text} ({description})" if description else text


def _inner_description(annotation: Any) -> str | None:
    """The description of a field declared inside a union (``Annotated[int, Field(...)] | None``)."""
    for arg in get_args(annotation):
        if isinstance(arg, FieldInfo) and arg.description:
            return arg.description
        found = _inner_description(arg)
        if found:
            return found
    return None


_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping"}


def _describe(annotation: Any, metadata: list[Any]) -> str:
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = get_args(annotation)
        kinds = [_describe(a, metadata) for a in args if a is not type(None)]
        return " or ".join(kinds) + (" or null" if type(None) in args else "")
    if origin is Annotated:
        base, *extras = get_args(annotation)
        inner = [m for e in extras for m in (e.metadata if isinstance(e, FieldInfo) else [e])]
        return _describe(base, [*metadata, *inner])
    if origin is Literal:
        return f"one of {list(get_args(annotation))}"
    if origin in (list, tuple) or annotation in (list, tuple):
        return "a non-empty list" if _min_length(metadata) else "a list"
    if origin in (dict, Mapping, typing.Mapping) or (
        isinstance(annotation, type) and issubclass(annotation, BaseModel)
    ):
        return "a mapping"
    kind = _KINDS.get(annotation, getattr(annotation, "__name__", str(annotation)))
    if annotation is str and _min_length(metadata):
        return "a non-empty string"
    return _with_range(kind, metadata)


def _range_of(info: FieldInfo | None) -> str:
    """`` > 0`` / `` in [0, 1)``: the range a numeric field declares, or nothing."""
    if info is None:
        return ""
    text = _describe(info.annotation, list(info.metadata))
    for kind in ("a number", "an integer"):
        text = text.removeprefix(kind)
    return "" if text.startswith(" or ") else text if text[:1] in ("", " ") else f" {text}"


def _min_length(metadata: list[Any]) -> int:
    return max([m.min_length for m in metadata if isinstance(m, at.MinLen)] or [0])


def _with_range(kind: str, metadata: list[Any]) -> str:
    lo = next((("[", m.ge) for m in metadata if isinstance(m, at.Ge)), None) or next(
        (("(", m.gt) for m in metadata if isinstance(m, at.Gt)), None
    )
    hi = next(((m.le, "]") for m in metadata if isinstance(m, at.Le)), None) or next(
        ((m.lt, ")") for m in metadata if isinstance(m, at.Lt)), None
    )
    if lo and hi:  # "in [0, 1)" says it is a number; integers say so
        span = f"in {lo[0]}{lo[1]}, {hi[0]}{hi[1]}"
        return f"an integer {span}" if kind == "an integer" else span
    if lo:
        return f"{kind} {'>=' if lo[0] == '[' else '>'} {lo[1]}"
    if hi:
        return f"{kind} {'<=' if hi[1] == ']' else '<'} {hi[0]}"
    return kind


def about(text: str) -> Any:
    """A key's help text, as the entry points' ``--help`` prints it (mars.cli.help): kept apart from the
    field's ``description``, which refusals quote, so that a refusal stays one short sentence."""
    from pydantic import Field

    return Field(json_schema_extra={"help": text})


__all__ = [
    "ConfigError",
    "Section",
    "OpenSection",
    "validated",
    "built_by",
    "known_keys",
    "render",
    "DtypeName",
    "about",
]
