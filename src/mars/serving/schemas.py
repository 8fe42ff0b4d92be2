"""Request bodies of the OpenAI-compatible routes, the MARS extra fields, and OpenAI-style errors.

Unknown fields are refused (as the OpenAI API does) so that a misspelt knob (``treshold``) fails loudly
instead of being ignored; fields the API defines but this server does not implement are accepted only
at their neutral value (``n=1``, ``top_p=1``, no penalties, no logprobs) and refused otherwise, naming
the field.  MARS extras: ``threshold`` (the request's own tau, honoured inside the server's bounds),
``verify`` (lossless self-speculative decoding: exactly greedy output at more than one token per
forward) and ``return_token_ids`` (the generated ids with each choice and each streamed chunk).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {
        400: "invalid_request_error",
        404: "not_found_error",
        429: "rate_limit_error",
        500: "server_error",
        503: "service_unavailable",
    }

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

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
    else:
        message = f"invalid value for {param}: {first.get('msg', 'invalid')}"
        if "input" in first and not isinstance(first["input"], (dict, list)):
            message += f" (got {first['input']!r})"
    return APIError(400, message, param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # MARS extras
    threshold: float | None = None
    verify: bool = False
    return_token_ids: bool = False  # add each choice's generated token ids (``token_ids``)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else value
        if stops is not None:
            if len(stops) > 4:
                raise ValueError("at most 4 stop sequences")
            if any(not s for s in stops):
                raise ValueError("stop sequences must be non-empty strings")
        return stops

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
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

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
        if not p:
            raise APIError(400, "prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

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
