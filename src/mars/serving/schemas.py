"""Request bodies of the OpenAI-compatible routes, the MARS extra fields, and OpenAI-style errors.

Unknown fields are refused (as the OpenAI API does) so that a misspelt knob (``treshold``) fails loudly
instead of being ignored; fields the API defines but this server does not implement are accepted only
at their neutral value (``n=1``, ``top_p=1``, no penalties, no logprobs) and refused otherwise, naming
the field.

Types are strict (pydantic strict mode), with the rules ``mars.decoding.generate`` and
:class:`~mars.decoding.settings.DecodingSettings` apply: a number is a JSON number (``true`` or ``"0.9"`` is
not a threshold), an integer is a JSON integer (``true`` is not a budget), a flag is ``true``/``false``
(``"yes"`` is not), token ids are integers (``["1", 2]`` is not a prompt), and no NaN or infinity.  The
``seed`` is range-checked against what the sampler's ``torch.Generator.manual_seed`` accepts, so a seed
that would raise inside the batched step is a 400 here instead.

MARS extras: the per-request fields of :class:`~mars.decoding.settings.DecodingSettings`
(:class:`RequestOptions`, derived from the dataclass: ``threshold``, the request's own threshold,
honoured inside the server's bounds; ``verify``, self-speculative decoding: without a threshold lossless,
exactly greedy output at more than one token per forward, with one also the masks that meet it;
``lookup_ngram``; and whatever field is declared ``per_request`` there) and ``return_token_ids`` (the
generated ids with each choice and each streamed chunk).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from mars.decoding.settings import DecodingSettings

# torch.Generator.manual_seed takes any integer in [-2**63, 2**64 - 1] (negative ones are mapped to
# 2**64 + seed) and raises outside it; the sampler of a row is seeded with the request's seed.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_STOPS = 4
# a request body larger than this is refused (413) before it is read (serve.yaml's max_body_bytes)
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
# the strict, closed shape of every request object (fields are checked, never coerced)
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        415: "invalid_request_error",
        429: "rate_limit_error",
        500: "server_error",
        503: "service_unavailable",
    }

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})
        if status in (429, 503):
            self.headers.setdefault("Retry-After", "1")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "error"),
                "param": self.param,
                "code": self.code,
            }
        }


def from_validation_error(err: ValidationError) -> APIError:
    """The first problem of a pydantic error as a 400 naming the field (``messages.0.content``)."""
    first = err.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        message = f"unrecognized request argument supplied: {param}"
    elif kind == "missing":
        message = f"missing required field: {param}"
    elif kind == "value_error" and "error" in first.get("ctx", {}):
        message = str(first["ctx"]["error"])  # our own validators' messages name the field and the value
    else:
        message = f"invalid value for {param}: {first.get('msg', 'invalid')}"
        if "input" in first:
            message += f" (got {_shown(first['input'])})"
    return APIError(400, message, param)


def _shown(value: Any, limit: int = 80) -> str:
    """A value as the client wrote it (JSON), cut short: a message never echoes a megabyte back."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kind(value: Any) -> str:
    return (
        "null"
        if value is None
        else {bool: "boolean", int: "integer", float: "number", str: "string"}.get(
            type(value), type(value).__name__.replace("dict", "object").replace("list", "array")
        )
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_prompt(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    """A completion prompt: a string, a list of strings, a list of token ids or a list of such lists;
    nothing is converted (``["1", 2]`` is refused, not read as token ids)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if not value:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, str) for x in value):
            return value
        if all(_is_token_id(x) for x in value):
            return value
        if all(isinstance(x, list) and all(_is_token_id(t) for t in x) for x in value):
            return value
        kinds = sorted({_kind(x) if not isinstance(x, list) else "array" for x in value})
        got = f"an array of {' and '.join(kinds)} values"
    else:
        got = f"{_kind(value)} {_shown(value)}"
    raise ValueError(
        "prompt must be a string, an array of strings, an array of token ids (integers) or an array of "
        f"arrays of token ids; got {got}"
    )


def check_stop(value: Any) -> list[str] | None:
    """``stop``: a string or up to 4 of them, each non-empty (the rule of ``generate``'s ``stop``)."""
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"stop must be a string or an array of strings, got {_shown(value)}")
    if len(stops) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
    if any(not s for s in stops):
        raise ValueError("stop sequences must be non-empty strings")
    return stops


# Per-request settings the OpenAI API already names (with its own bounds): its name for each.
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "temperature": "temperature", "seed": "seed"}


def request_options_model(settings_cls: type = DecodingSettings) -> type[BaseModel]:
    """The per-request override type of ``settings_cls``: its fields declared ``per_request`` (and not named
    by the OpenAI API), each optional (``null``: the server's setting), strict, typed and described as the
    dataclass declares them.  Their ranges are checked by the settings class itself, once."""
    hints = typing.get_type_hints(settings_cls)
    fields = {
        f.name: (hints[f.name] | None, Field(default=None, description=f.metadata.get("help")))
        for f in dataclasses.fields(settings_cls)
        if f.metadata.get("per_request") and f.name not in OPENAI_NAMES
    }
    return create_model("RequestOptions", __config__=STRICT, **fields)


# The MARS per-request options: a field declared per_request in DecodingSettings is one here, no further code.
RequestOptions = request_options_model()


def decoding_overrides(body: BaseModel) -> dict[str, Any]:
    """The request's DecodingSettings overrides, by field name (the OpenAI-named ones translated; the
    budget is left to the caller, which checks it against the context)."""
    names = {**{name: name for name in RequestOptions.model_fields}, "temperature": "temperature", "seed": "seed"}
    return {field: getattr(body, attr) for attr, field in names.items() if getattr(body, attr, None) is not None}


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class _Common(RequestOptions):
    model_config = STRICT

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = None  # str | list[str], checked by check_stop (one clear message instead of a union's two)
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # MARS extras: RequestOptions' fields (from DecodingSettings), and
    return_token_ids: bool = False  # add each choice's generated token ids (``token_ids``)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        return check_stop(value)

    @field_validator("seed")
    @classmethod
    def _seed(cls, value):
        if value is not None and not SEED_MIN <= value <= SEED_MAX:
            raise ValueError(
                f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (what the sampler's generator accepts), "
                f"got {value}"
            )
        return value

    def unsupported(self) -> None:
        """Refuse API features this server does not implement, naming the field."""
        if self.n not in (None, 1):
            raise APIError(400, "only n=1 is supported (decoding is greedy unless temperature > 0)", "n")
        if self.top_p not in (None, 1, 1.0):
            raise APIError(400, "top_p is not supported (only 1.0); use temperature", "top_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported (only 0)", name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")


class CompletionRequest(_Common):
    prompt: Any  # str | list[str] | list[int] | list[list[int]], checked by check_prompt
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        return check_prompt(value)

    def unsupported(self) -> None:
        super().unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported", "echo")
        if self.logprobs is not None:
            raise APIError(400, "logprobs are not supported", "logprobs")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported (only 1)", "best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(_is_token_id(x) for x in p):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: Any  # str | list[ContentPart], checked below
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value):
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(
            isinstance(p, dict) and set(p) == {"type", "text"} and p["type"] == "text" and isinstance(p["text"], str)
            for p in value
        ):
            return [ContentPart(type="text", text=p["text"]) for p in value]
        raise ValueError(
            'content must be a string or an array of text parts ({"type": "text", "text": "..."}), '
            f"got {_shown(value)}"
        )

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", "logprobs")
        if self.top_logprobs:
            raise APIError(400, "top_logprobs are not supported", "top_logprobs")
        if self.response_format not in (None, {"type": "text"}):
            raise APIError(400, "only response_format {'type': 'text'} is supported", "response_format")
        if self.tools:
            raise APIError(400, "tools are not supported", "tools")
        if self.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice is not supported", "tool_choice")

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def budget_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def chat(self) -> list[dict[str, str]]:
        # "developer" is the newer name of "system"; chat templates know "system"
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]
