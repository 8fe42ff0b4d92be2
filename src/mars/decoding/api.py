"""``generate``: the one entry point for MARS, AR and Jacobi decoding (validation, input prep, and a
thin loop over :class:`~mars.decoding.engine.DecodeEngine`)."""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .acceptance import never_emitted
from .baselines import generate_ar
from .engine import DecodeEngine
from .forward import ModelRunner
from .prompt_check import check_prompts
from .settings import DECODERS, DecodingSettings, reference_threshold
from .stats import DecodeStats, GenerationResult, acceptance_figures, sum_by_position
from .step import StepReport
from .stopping import StopStrings, eos_token_ids, finalize_row

__all__ = ["DECODERS", "encode_prompts", "generate", "check_prompts"]


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str] | Sequence[Sequence[int]], chat_template: bool
) -> list[list[int]]:
    """Strings are tokenized (wrapped as one user turn with ``chat_template``); id lists pass through (their
    length and ids are checked against the model by :func:`~mars.decoding.prompt_check.check_prompts`)."""
    if isinstance(prompts, (str, bytes, bytearray)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
    out: list[list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, (bytes, bytearray)):
            # bytes are a sequence of ints: without this check they would be read as token ids
            raise ValueError(f"prompt {i} is bytes; decode it to a str first (bytes would be read as token ids)")
        if isinstance(p, str):
            if chat_template:
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
                )
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                ids = tokenizer(p)["input_ids"]
        elif isinstance(p, torch.Tensor):
            ids = [int(t) for t in p.reshape(-1).tolist()]
        elif isinstance(p, Sequence) and all(_is_token_id(t) for t in p):
            ids = [int(t) for t in p]
        else:
            raise ValueError(f"prompt {i} is neither a string nor a list of token ids: {type(p).__name__}")
        out.append(ids)
    return out


def _is_token_id(value) -> bool:
    # bool is an int subclass: [True, 5] must not be read as the ids [1, 5]
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    stop: str | Sequence[str] | None = None,
    mask_token_id: int | None = None,
    chat_template: bool = False,
    progress: bool = False,
    settings: DecodingSettings | None = None,
    observers: Sequence[Callable[[StepReport], None]] = (),
    **decoding: Any,
) -> GenerationResult:
    """Generate continuations of ``prompts``; see the package docstring for every argument.

    How to decode is one :class:`DecodingSettings`: pass it as ``settings=``, or pass its fields as
    keywords (``block_size=4, threshold=0.9, ...``; every field of the dataclass is a keyword, with its
    default and help text declared there), which build it once, validated before any model work.  Not
    both: a keyword beside ``settings=`` is refused rather than silently ignored.  ``threshold`` may be
    one number or one per prompt.  A threshold of 1.0 (probability/margin) or 0 (entropy) caps that row
    at one token per step, which makes the output exactly greedy AR.  ``verify=True`` drafts with the
    masks (or ``draft_source="model"``/``"lookup"``) and verifies in the next forward: the output is
    exactly greedy AR at more than one token per forward.  ``decoder="ar"`` runs ``transformers``
    ``generate`` (KV cache, greedy) and ``decoder="jacobi"`` the training-free Jacobi iteration, all
    under the same stop rules and statistics.  ``full_window=True`` appends the masks even when no row
    can accept them.  ``observers``: called after every engine step with its
    :class:`~mars.decoding.step.StepReport` (:attr:`DecodeEngine.observers`; not with ``decoder="ar"``).
    """
    threshold = decoding.get("threshold", settings.threshold if settings is not None else 1.0)
    per_row = isinstance(threshold, (list, tuple))
    settings = _one_settings(settings, decoding, per_row)
    if observers and settings.decoder == "ar":
        raise ValueError(
            "observers watch the engine's steps, and decoder='ar' runs transformers' generate without the engine; "
            "pass decoder='mars' with threshold=1.0 for greedy AR in the engine"
        )
    row_thresholds = threshold if per_row else settings.threshold
    ids, rows, mask_token_id, eos_ids, stops = _prepare(
        model, tokenizer, prompts, settings, row_thresholds, mask_token_id, chat_template, stop
    )
    if settings.decoder == "ar":
        raw, reasons, masks, stats = _run_ar(model, tokenizer, ids, settings, mask_token_id, eos_ids, stops)
    else:
        raw, reasons, masks, stats = _run_engine(
            model, tokenizer, ids, rows, settings, mask_token_id, eos_ids, stops, progress, observers
        )
    return _result(raw, reasons, masks, stats, settings, eos_ids, stops, row_thresholds)


def _one_settings(settings: DecodingSettings | None, decoding: dict[str, Any], per_row: bool) -> DecodingSettings:
    """``settings=`` as given, else the decoding keywords as one validated object; never both.  A
    per-prompt threshold list stays beside either (the settings keep the reference threshold)."""
    unknown = sorted(set(decoding) - set(DecodingSettings.field_names()))
    if unknown:
        raise TypeError(
            f"generate() got unexpected keyword(s) {unknown}; decoding keywords are the fields of "
            f"DecodingSettings: {sorted(DecodingSettings.field_names())}"
        )
    if settings is not None:
        if not isinstance(settings, DecodingSettings):
            raise ValueError(f"settings must be a DecodingSettings, got {type(settings).__name__}")
        given = sorted(k for k in decoding if not (k == "threshold" and per_row))
        if given:
            raise ValueError(
                f"generate() got settings= and the decoding keyword(s) {given}: pass one or the other "
                f"(e.g. settings.replace({given[0]}=...))"
            )
        return settings
    keywords = dict(decoding)
    if per_row:
        keywords["threshold"] = reference_threshold(keywords.get("metric", "probability"))
    return DecodingSettings(**keywords)


def _prepare(model, tokenizer, prompts, s: DecodingSettings, thresholds, mask_token_id, chat_template, stop):
    """Everything checked before any model work: prompt ids, one threshold per row, the mask token,
    room in the context, EOS ids and stop strings."""
    s.check_every_row()  # (a server verifies per request: its engine's settings allow what these refuse)
    ids = encode_prompts(tokenizer, prompts, chat_template)
    rows = _row_settings(s, thresholds, len(ids))
    mask_token_id = _mask_token(model, tokenizer, s, mask_token_id)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = model.get_input_embeddings().weight.shape[0]
    check_prompts(ids, vocab, getattr(config, "max_position_embeddings", None), s.max_new_tokens)
    return ids, rows, mask_token_id, eos_token_ids(model, tokenizer), StopStrings(tokenizer, stop)


def _row_settings(s: DecodingSettings, thresholds, batch: int) -> list[DecodingSettings]:
    """One settings object per prompt: ``s`` itself, or with a per-prompt threshold each (validated there,
    once: the engine takes them as they are)."""
    if not isinstance(thresholds, (list, tuple)):
        return [s] * batch
    if len(thresholds) != batch:
        raise ValueError(f"got {len(thresholds)} thresholds for {batch} prompts; give one number or one per prompt")
    return [s.replace(threshold=t) for t in thresholds]


def _run_ar(model, tokenizer, ids, s: DecodingSettings, mask_token_id, eos_ids, stops):
    """transformers' ``generate`` (KV cache): raw ids and statistics, no engine reasons or mask flags."""
    raw, stats = generate_ar(
        model,
        tokenizer,
        ids,
        max_new_tokens=s.max_new_tokens,
        eos_ids=eos_ids,
        stops=stops,
        temperature=s.temperature,
        cache_implementation=s.ar_cache,
        suppress_ids=never_emitted(mask_token_id, eos_ids),  # the mask token is never an output token
    )
    return raw, [None] * len(ids), None, stats


def _mask_token(model, tokenizer, s: DecodingSettings, mask_token_id: int | None) -> int | None:
    """The mask token id (given, else the tokenizer's), checked against the decoder and the embeddings."""
    mask_token_id = mask_token_id if mask_token_id is not None else tokenizer.mask_token_id
    if s.decoder == "mars" and mask_token_id is None:
        raise ValueError(
            "no mask token: the tokenizer has none and mask_token_id was not given; load the model with "
            "mars.models.load_model (which assigns one) or pass mask_token_id="
        )
    vocab = model.get_input_embeddings().weight.shape[0]
    if mask_token_id is not None and not 0 <= int(mask_token_id) < vocab:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the embedding matrix ({vocab} rows)")
    return mask_token_id


def _result(raw, reasons, masks, stats, s: DecodingSettings, eos_ids, stops, threshold) -> GenerationResult:
    """Rows finalised under the shared stop rules, with their statistics."""
    texts, token_ids, finish = [], [], []
    for row, engine_reason in zip(raw, reasons):
        row_ids, text, reason = finalize_row(row, eos_ids, stops, s.max_new_tokens)
        token_ids.append(row_ids)
        texts.append(text)
        finish.append(engine_reason if engine_reason in ("cancelled", "error") else reason)
    stats.per_row_tokens = [len(r) for r in token_ids]
    stats.generated_tokens = sum(stats.per_row_tokens)
    if s.decoder == "ar":
        stats.per_row_forwards = list(stats.per_row_tokens)  # AR needs one forward per token
    stats.extra.update(_settings(s, threshold))
    from_mask = None if masks is None else [m[: len(t)] for m, t in zip(masks, token_ids)]
    return GenerationResult(texts=texts, token_ids=token_ids, stats=stats, finish_reasons=finish, from_mask=from_mask)


def _run_engine(
    model, tokenizer, ids, row_settings, s: DecodingSettings, mask_token_id, eos_ids, stops, progress, observers
):
    """Admit every prompt, step until all rows finished; raw ids, engine reasons and statistics."""
    runner = ModelRunner(model)
    mask = mask_token_id if mask_token_id is not None else eos_ids[0]
    engine = DecodeEngine(runner, s, mask, eos_ids, tokenizer)
    engine.observers.extend(observers)
    start = time.perf_counter()
    requests = [engine.make_request(p, stop=stops, settings=r) for p, r in zip(ids, row_settings)]
    engine.admit(requests)
    finished = {}
    first_token = None  # every row is prefilled, and gets its first token, in the first step
    bar = tqdm(total=len(requests), desc=f"{s.decoder}[{s.cache}]", leave=False, disable=not progress)
    while engine.live:
        for event in engine.step():
            if event.finished is not None:
                finished[event.request.id] = event.finished
                bar.update(1)
        first_token = first_token or time.perf_counter() - start
    bar.close()
    seconds = time.perf_counter() - start
    rows = [finished[r.id] for r in requests]
    stats = DecodeStats(
        forwards=engine.forwards,
        generated_tokens=0,
        seconds=seconds,
        per_row_tokens=[],
        per_row_forwards=[f.forwards for f in rows],
        decoder=s.decoder,
        first_token_seconds=first_token,
    )
    if any(r.verify for r in requests):
        stats.extra.update(draft_statistics(rows))
        stats.extra["draft_source"] = s.draft_source
        stats.extra["tree"] = engine.tree.label if engine.tree is not None else "chain"
        if s.draft_source == "model":
            stats.extra["draft_model_forwards"] = engine.drafter.forwards
    return [f.token_ids for f in rows], [f.reason for f in rows], [f.from_mask for f in rows], stats


def draft_statistics(rows) -> dict[str, Any]:
    """Drafts proposed and accepted per draft position, summed over rows, the acceptance rates, vLLM's
    figures (:func:`~mars.decoding.stats.acceptance_figures`) and each row's draft steps and accepted drafts."""
    proposed = sum_by_position(f.draft_proposed for f in rows)
    accepted = sum_by_position(f.draft_accepted for f in rows)
    return {
        "drafts_proposed": proposed,
        "drafts_accepted": accepted,
        "draft_acceptance_by_position": [a / p if p else None for a, p in zip(accepted, proposed)],
        "draft_acceptance": sum(accepted) / sum(proposed) if sum(proposed) else None,
        **acceptance_figures(proposed, accepted, sum(f.draft_steps for f in rows)),
        "per_row_num_drafts": [f.draft_steps for f in rows],
        "per_row_num_draft_tokens": [sum(f.draft_proposed) for f in rows],
        "per_row_num_accepted_tokens": [sum(f.draft_accepted) for f in rows],
    }


def _settings(s: DecodingSettings, threshold) -> dict[str, Any]:
    return {
        "cache": s.cache if s.decoder != "ar" else f"hf-{s.ar_cache}",
        "window": s.window if s.window is not None else s.block_size,
        "block_size": s.block_size,
        "metric": s.metric,
        "threshold": list(threshold) if isinstance(threshold, (list, tuple)) else threshold,
        "max_accept": s.max_accept,
        "temperature": s.temperature,
        "verify": s.verify,
        "draft_source": s.draft_source if s.verify else None,
    }
