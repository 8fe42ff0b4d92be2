"""The decoders the benchmarks time, by name: the AR baselines, MARS under each cache strategy, Jacobi, lossless
verified decoding and its variants, and verified decoding drafting from prompt lookup or a draft model.

A :class:`Variant` is a row of a benchmark's table: the DecodingSettings fields it sets itself (every other field
comes from the run's settings).  :func:`variants` lists the rows a :class:`DecoderChoice` asks for, AR baselines
first.  No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Variant:
    name: str
    kwargs: dict[str, Any]
    is_ar: bool = False  # an AR baseline candidate (exactly greedy AR, one token per forward)
    fixed_threshold: float | None = None  # decoders whose output is exact run at the reference threshold
    eager: bool = False  # run with the decode fast path off (F.linear): the baseline without it


# the project's engine at threshold 1.0 is exactly greedy AR with a per-row KV cache (finished rows leave)
AR_CURSOR = Variant("ar-cursor", dict(decoder="mars", cache="cursor"), is_ar=True, fixed_threshold=1.0)
# every lossless row: the MARS engine verifying its drafts, per-row KV cache
VERIFIED = dict(decoder="mars", cache="cursor", verify=True)
DRAFT_SOURCE_ROWS = ("lookup", "lookup+masks", "model", "model+masks")
# Sweeps of one verify setting: flag -> (DecodingSettings field, how its rows' names spell it).  Each value is
# a row `mars-verify-<spelling><value>`; `--verify-rows` combines several fields in one row.
VERIFY_SWEEPS = {
    "--verify-draft-thresholds": ("draft_threshold", "dt"),
    "--verify-windows": ("window", "w"),
    "--verify-chains": ("chain_drafts", "chain-"),
}
VERIFY_SPELLING = dict(VERIFY_SWEEPS.values())


@dataclass(frozen=True)
class DecoderChoice:
    """Which decoders run beside the AR baselines (``ar-hf`` and ``ar-cursor`` always run)."""

    caches: tuple[str, ...] = ("none", "block", "cursor")  # a MARS row per cache strategy
    ar_static: bool = False  # transformers generate with its static cache as an AR baseline candidate
    eager_baselines: bool = False  # every AR decoder again with the decode fast path off
    full_window: bool = False  # cursor with the masks appended even at threshold 1.0
    block_window: bool = False  # cache=block with window='cache_block'
    jacobi: bool = False
    verify: bool = False  # lossless verified decoding, one row per fallback and per extra setting
    verify_fallbacks: tuple[str, ...] = ("none",)
    verify_rows: tuple[dict[str, Any], ...] = ()  # the lossless verify rows' own settings (checked)
    verify_tau: bool = False  # verified decoding at every threshold (lossy below 1.0)
    draft_sources: tuple[str, ...] = ()  # entries of DRAFT_SOURCE_ROWS
    draft_model: str | None = None  # the draft model of the `model` draft rows


def variants(choice: DecoderChoice) -> list[Variant]:
    """AR baselines first (the fastest of them in each run is the baseline every speedup is against:
    any speed-up that applies to AR goes to AR too), then the MARS decoders."""
    out = [Variant("ar-hf", dict(decoder="ar"), is_ar=True, fixed_threshold=1.0)]
    if choice.ar_static:
        out.append(Variant("ar-hf-static", dict(decoder="ar", ar_cache="static"), is_ar=True, fixed_threshold=1.0))
    out.append(AR_CURSOR)
    if choice.eager_baselines:  # the AR decoders without the fast path, to show what it gives AR
        for v in list(out):
            out.append(Variant(f"{v.name}-eager", v.kwargs, is_ar=True, fixed_threshold=1.0, eager=True))
    for cache in choice.caches:
        out.append(Variant(f"mars-{cache}", dict(decoder="mars", cache=cache)))
    if choice.full_window:
        out.append(Variant("mars-cursor+masks", dict(decoder="mars", cache="cursor", full_window=True)))
    if choice.block_window:
        out.append(Variant("mars-block-fill", dict(decoder="mars", cache="block", window="cache_block")))
    if choice.jacobi:
        out.append(Variant("jacobi-cursor", dict(decoder="jacobi", cache="cursor")))
    if choice.verify:
        out += verify_variants(choice)
    if choice.verify_tau:  # verified drafts plus the masks that meet each threshold: lossy below 1.0
        out.append(Variant("mars-verify-tau", dict(VERIFIED)))
    return out + [draft_variant(entry, choice.draft_model) for entry in choice.draft_sources]


def verify_variants(choice: DecoderChoice) -> list[Variant]:
    """Lossless verified decoding: a row per fallback, then the same decoder with other settings, side by side."""
    out = []
    for fallback in choice.verify_fallbacks:
        name = f"mars-verify{'' if fallback == 'none' else '-' + fallback}"
        out.append(Variant(name, {**VERIFIED, "fallback": fallback}, fixed_threshold=1.0))
    for overrides in choice.verify_rows:
        out.append(Variant(verify_row_name(overrides), {**VERIFIED, **overrides}, fixed_threshold=1.0))
    return out


def verify_row_name(overrides: dict) -> str:
    """``{"window": 3, "draft_threshold": 0.3}`` -> ``mars-verify-w3-dt0.3``."""
    parts = [
        f"{VERIFY_SPELLING.get(k, k + '=')}{format(v, 'g') if isinstance(v, float) else v}"
        for k, v in overrides.items()
    ]
    return "-".join(["mars-verify", *parts])


def draft_variant(entry: str, draft_model: str | None) -> Variant:
    """A verified decoder drafting from prompt lookup or a draft model: ``lookup``/``model`` alone (window 1,
    plain speculative decoding) or ``+masks`` (the checkpoint's masks draft too, as ``chain_drafts`` places them:
    with its default, on a CPU, on the steps the other source has no draft for; on an accelerator after every
    step's drafts, extending them)."""
    source = entry.split("+")[0]
    kwargs = {**VERIFIED, "draft_source": source}
    if source == "model":
        kwargs["draft_model"] = draft_model
    if not entry.endswith("+masks"):
        kwargs["window"] = 1
    return Variant(f"verify-{entry}", kwargs, fixed_threshold=1.0)
