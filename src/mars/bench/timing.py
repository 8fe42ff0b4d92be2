"""The timing loop every throughput figure comes from: each batch of prompts through every decoder back to back, in
an order that rotates from batch to batch and from repeat to repeat, so that load drift on a shared machine hits
all of them alike; decoders whose output does not depend on the threshold are timed once per repeat.

:func:`run_one` decodes one batch with one :class:`~mars.bench.decoders.Variant`; :func:`interleave` is one repeat;
:func:`time_decoders` every repeat at one batch size, by threshold and decoder, each entry a :func:`combine` of
its batches, ready for :mod:`mars.bench.tables`.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from mars.bench.decoders import Variant
from mars.decoding.settings import DecodingSettings
from mars.decoding.stats import acceptance_figures, sum_by_position
from mars.hardware import apply_process_defaults

apply_process_defaults()  # the OpenMP wait before torch loads libgomp (mars.hardware says why)

from tqdm.auto import tqdm  # noqa: E402


@dataclass(frozen=True)
class DecodeSetup:
    """What every timed decoder of a run shares: its DecodingSettings (each variant replaces its own fields) and
    whether prompts go through the tokenizer's chat template."""

    settings: DecodingSettings
    chat_template: bool

    @classmethod
    def of(cls, setup: DecodeSetup | Mapping) -> DecodeSetup:
        """``setup``, or a mapping of its two fields as one."""
        return setup if isinstance(setup, cls) else cls(**setup)

    def warm(self, max_new_tokens: int = 8) -> DecodeSetup:
        """The same with short outputs: warm-up runs (allocator, kernels, tokenizer caches)."""
        return DecodeSetup(self.settings.replace(max_new_tokens=max_new_tokens), self.chat_template)


def run_one(model, tokenizer, prompts, setup: DecodeSetup, variant: Variant, threshold: float) -> dict:
    """Decode one batch of ``prompts`` with ``variant`` (at its fixed threshold, else ``threshold``): its tokens,
    forwards, seconds, time to first token, outputs, per-row tokens per forward and draft statistics."""
    from mars.decoding import generate

    threshold = variant.fixed_threshold if variant.fixed_threshold is not None else threshold
    settings = setup.settings.replace(**variant.kwargs, threshold=threshold)
    if not settings.verify and settings.tree not in ("auto", "chain"):
        settings = settings.replace(tree="auto")  # a tree shape lays out verify's drafts: the AR rows have none
    with fast_path_off(variant.eager):
        res = generate(model, tokenizer, prompts, chat_template=setup.chat_template, settings=settings)
    extra = res.stats.extra
    return dict(
        tokens=res.stats.generated_tokens,
        forwards=res.stats.forwards,
        seconds=res.stats.seconds,
        first_token_seconds=res.stats.first_token_seconds,
        ids=list(res.token_ids),
        row_rates=[t / f for t, f in zip(res.stats.per_row_tokens, res.stats.per_row_forwards) if f],
        proposed=list(extra.get("drafts_proposed") or ()),
        accepted=list(extra.get("drafts_accepted") or ()),
        draft_steps=extra.get("num_drafts") or 0,
        tree=extra.get("tree"),  # verify's draft layout (tree="auto" chooses one per run)
    )


def combine(parts: list[dict]) -> dict:
    """One decoder's totals over the batches of a repeat, with its acceptance figures (verify)."""
    firsts = [p["first_token_seconds"] for p in parts]
    acceptance = acceptance_figures(
        sum_by_position(p["proposed"] for p in parts),
        sum_by_position(p["accepted"] for p in parts),
        sum(p["draft_steps"] for p in parts),
    )
    return dict(
        tokens=sum(p["tokens"] for p in parts),
        forwards=sum(p["forwards"] for p in parts),
        seconds=sum(p["seconds"] for p in parts),
        first_token_seconds=None if None in firsts else sum(firsts),
        batches=len(parts),
        ids=[ids for p in parts for ids in p["ids"]],
        row_tpf=statistics.mean(rate for p in parts for rate in p["row_rates"]),
        draft_acceptance=acceptance["draft_acceptance_rate"],
        acceptance=acceptance,
    )


@contextmanager
def fast_path_off(off: bool):
    """``MARS_FAST_PATH=0`` inside the block when ``off`` (the decoders read it at every call)."""
    if not off:
        yield
        return
    old = os.environ.get("MARS_FAST_PATH")
    os.environ["MARS_FAST_PATH"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MARS_FAST_PATH", None)
        else:
            os.environ["MARS_FAST_PATH"] = old


def warm_up(model, tokenizer, prompts, setup: DecodeSetup, variants: Sequence[Variant], threshold: float, times: int):
    """``times`` untimed short runs of every decoder on ``prompts``: allocator, kernels, tokenizer caches."""
    warm = setup.warm()
    for v in variants:
        for _ in range(times):
            run_one(model, tokenizer, prompts, warm, v, threshold)


def time_decoders(
    model, tokenizer, prompts, batch: int, setup: DecodeSetup | Mapping, vs, thresholds, repeats: int
) -> dict[float, dict[str, list[dict]]]:
    """Every decoder on ``prompts`` at this batch size, ``repeats`` times: ``runs[threshold][decoder]``, one
    :func:`combine` per repeat.

    Within a repeat every batch of prompts runs through all decoders back to back, in an order that rotates
    from batch to batch and repeat to repeat, so both sides of a speed-up span the same minutes: a shared or
    virtual host's memory bandwidth drifts within the minute, so a decoder timed over the whole prompt set in
    one block would catch a different minute from the next one's.  Decoders whose output does not depend on
    the threshold (the AR baselines, verified decoding) are timed once per batch size and repeat, not once
    per threshold."""
    setup = DecodeSetup.of(setup)
    fixed = [v for v in vs if v.fixed_threshold is not None]
    swept = [v for v in vs if v.fixed_threshold is None]
    runs: dict[float, dict[str, list[dict]]] = {t: {v.name: [] for v in vs} for t in thresholds}
    jobs = [(v, v.fixed_threshold, thresholds) for v in fixed]
    jobs += [(v, t, [t]) for t in thresholds for v in swept]
    batches = [prompts[start : start + batch] for start in range(0, len(prompts), batch)]
    for rep in range(repeats):
        desc = f"batch {batch}, repeat {rep + 1}/{repeats}"
        parts = interleave(model, tokenizer, batches, setup, [(v, t) for v, t, _ in jobs], rep, desc)
        for (v, threshold, sweep), part in zip(jobs, parts):
            r = combine(part)
            for t in sweep:
                runs[t][v.name].append(r)
            print(
                f"  threshold={threshold} batch={batch} rep={rep} {v.name}: {r['tokens']} tok "
                f"{r['tokens'] / r['seconds']:.1f} tok/s {r['tokens'] / r['forwards']:.2f} tok/fwd",
                flush=True,
            )
    return runs


def interleave(model, tokenizer, batches, setup: DecodeSetup, jobs, rep: int, desc: str) -> list[list[dict]]:
    """One repeat: each batch of prompts through every (decoder, threshold) job back to back, the first job
    rotating from batch to batch and from repeat to repeat (``rep``); per job, one :func:`run_one` result per
    batch."""
    parts: list[list[dict]] = [[] for _ in jobs]
    for b, batch_prompts in enumerate(tqdm(batches, desc=desc, unit="batch", leave=False)):
        turn = (rep + b) % len(jobs)
        for j in [*range(turn, len(jobs)), *range(turn)]:
            v, threshold = jobs[j]
            parts[j].append(run_one(model, tokenizer, batch_prompts, setup, v, threshold))
    return parts
