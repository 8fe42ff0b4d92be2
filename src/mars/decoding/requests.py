"""A request for the engine: its prompt, its stop strings and its settings (the engine's, with the per-request
fields a caller changes, validated once)."""

from __future__ import annotations

from collections.abc import Sequence

from .rows import Request
from .settings import DecodingSettings, is_exact_threshold, tree_shape
from .stopping import StopStrings


def new_request(
    engine: DecodingSettings,
    tokenizer,
    prompt_ids: Sequence[int],
    stop: str | Sequence[str] | StopStrings | None,
    id,
    settings: DecodingSettings | None,
    options: dict,
) -> Request:
    """A request on an engine decoding with ``engine`` (see :meth:`DecodeEngine.make_request`); stop strings need
    the engine's ``tokenizer``."""
    s = request_settings(engine, settings, options)
    if not isinstance(stop, StopStrings) and stop is not None:
        if tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer")
        stop = StopStrings(tokenizer, stop)
    if isinstance(stop, StopStrings) and not stop:
        stop = None
    kwargs = {} if id is None else {"id": id}
    exact = is_exact_threshold(s.threshold, s.metric)
    ids = [int(t) for t in prompt_ids]
    return Request(ids, s.threshold, s.max_new_tokens, stop, s.temperature, s.seed, s.verify, exact, s, **kwargs)


def request_settings(engine: DecodingSettings, settings: DecodingSettings | None, options: dict) -> DecodingSettings:
    """The settings of one request on an engine decoding with ``engine``: ``settings`` as given (validated already;
    they may differ from the engine's in the per-request fields only), else the engine's with ``options``, the
    per-request fields a caller set (``None``: the engine's), validated together."""
    allowed = DecodingSettings.per_request_fields()
    if settings is not None:
        if options:
            raise ValueError(f"make_request got settings= and {sorted(options)}: pass one or the other")
        fixed = [k for k in DecodingSettings.field_names() if k not in allowed]
        differ = [k for k in fixed if getattr(settings, k) != getattr(engine, k)]
        if differ:
            raise ValueError(f"a request may not change the engine's {differ}; per request: {list(allowed)}")
        return settings
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{unknown} cannot be set per request; per-request settings: {list(allowed)}")
    given = {k: v for k, v in options.items() if v is not None}
    tree = given.get("tree", "chain")
    if tree not in ("chain", "auto", engine.tree) and tree_shape(tree) != tree_shape(engine.tree):
        raise ValueError(
            f"tree={tree!r}: this engine drafts tree={engine.tree!r} for its rows; a request may verify "
            "along a chain (tree='chain') or with the engine's own"
        )
    # one validation for the request: the threshold for the metric, what verify allows, the budget...
    return engine.replace(**given) if given else engine
