"""``generate``: the one entry point for MARS, AR and Jacobi decoding (validation and input prep)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .acceptance import exact_ar_rows, thresholds_tensor, validate_metric
from .attention import packed_gqa
from .baselines import generate_ar
from .engine import CACHES, EngineConfig, MultiTokenDecoder
from .forward import ModelRunner
from .stats import GenerationResult
from .stopping import StopStrings, eos_token_ids, finalize_row

DECODERS = ("mars", "ar", "jacobi")


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str] | Sequence[Sequence[int]], chat_template: bool
) -> list[list[int]]:
    """Strings are tokenized (wrapped as one user turn with ``chat_template``); id lists pass through."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
    out: list[list[int]] = []
    for i, p in enumerate(prompts):
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
        elif isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
            ids = [int(t) for t in p]
        else:
            raise ValueError(f"prompt {i} is neither a string nor a list of token ids: {type(p).__name__}")
        if not ids:
            raise ValueError(f"prompt {i} is empty after tokenization")
        out.append(ids)
    return out


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    block_size: int = 4,
    threshold: float | Sequence[float] = 1.0,
    metric: str = "probability",
    max_new_tokens: int = 256,
    cache: str = "cursor",
    cache_block: int = 32,
    window: int | str | None = None,
    temperature: float = 0.0,
    max_accept: int | None = None,
    stop: str | Sequence[str] | None = None,
    mask_token_id: int | None = None,
    chat_template: bool = False,
    decoder: str = "mars",
    seed: int | None = None,
    progress: bool = False,
    full_window: bool = False,
) -> GenerationResult:
    """Generate continuations of ``prompts``; see the package docstring for every argument.

    ``threshold`` may be one number or one per prompt.  A threshold of 1.0 (probability/margin) or 0
    (entropy) caps that row at one token per step, which makes the output exactly greedy AR.
    ``decoder="ar"`` runs ``transformers`` ``generate`` (KV cache, greedy) and ``decoder="jacobi"`` the
    training-free Jacobi iteration, both under the same stop rules and statistics.
    ``full_window=True`` appends the masks even when no row can accept them (threshold 1.0); it
    changes no output and exists to measure what the masks cost.
    """
    # ---- validation, before any model work ----
    if decoder not in DECODERS:
        raise ValueError(f"unknown decoder {decoder!r}; choose one of {list(DECODERS)}")
    validate_metric(metric)
    if cache not in CACHES:
        raise ValueError(f"unknown cache strategy {cache!r}; choose one of {list(CACHES)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if isinstance(cache_block, bool) or not isinstance(cache_block, int) or cache_block < 1:
        raise ValueError(f"cache_block must be an integer >= 1, got {cache_block!r}")
    if max_accept is not None and (isinstance(max_accept, bool) or not isinstance(max_accept, int) or max_accept < 1):
        raise ValueError(f"max_accept must be None or an integer >= 1, got {max_accept!r}")
    if not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if window is None:
        window = block_size
    if window == "cache_block":
        if cache != "block":
            raise ValueError("window='cache_block' (masks fill the rest of the cache block) needs cache='block'")
    elif isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1, None (= block_size) or 'cache_block', got {window!r}")
    ids = encode_prompts(tokenizer, prompts, chat_template)
    thresholds = thresholds_tensor(threshold, len(ids), metric)
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if context is not None:
        longest = max(range(len(ids)), key=lambda i: len(ids[i]))
        if len(ids[longest]) >= context:
            raise ValueError(
                f"prompt {longest} has {len(ids[longest])} tokens, longer than the model's context of "
                f"{context} tokens (at least one position must remain for generation)"
            )
    if decoder == "mars" and mask_token_id is None:
        mask_token_id = tokenizer.mask_token_id
        if mask_token_id is None:
            raise ValueError(
                "no mask token: the tokenizer has none and mask_token_id was not given; load the model with "
                "mars.models.load_model (which assigns one) or pass mask_token_id="
            )
    vocab = model.get_input_embeddings().weight.shape[0]
    if mask_token_id is not None and not 0 <= int(mask_token_id) < vocab:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the embedding matrix ({vocab} rows)")
    eos_ids = eos_token_ids(model, tokenizer)
    stops = StopStrings(tokenizer, stop)

    # ---- decoding ----
    if decoder == "ar":
        raw, stats = generate_ar(
            model, tokenizer, ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids, stops=stops, temperature=temperature
        )
    else:
        runner = ModelRunner(model)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=runner.device).manual_seed(seed)
        cfg = EngineConfig(
            cache=cache,
            window=window,
            cache_block=cache_block,
            metric=metric,
            max_new_tokens=max_new_tokens,
            max_accept=max_accept,
            temperature=float(temperature),
            proposal="jacobi" if decoder == "jacobi" else "mask",
            full_window=full_window,
        )
        ar_rows = exact_ar_rows(thresholds, metric) if decoder == "mars" else torch.zeros(len(ids), dtype=torch.bool)
        engine = MultiTokenDecoder(
            runner,
            cfg,
            mask_token_id if mask_token_id is not None else eos_ids[0],
            eos_ids,
            stops,
            generator=generator,
            progress=progress,
        )
        with torch.inference_mode(), packed_gqa(model):
            raw, stats = engine.run(ids, thresholds, ar_rows)

    texts, token_ids, reasons = [], [], []
    for row in raw:
        row_ids, text, reason = finalize_row(row, eos_ids, stops, max_new_tokens)
        token_ids.append(row_ids)
        texts.append(text)
        reasons.append(reason)
    stats.per_row_tokens = [len(r) for r in token_ids]
    stats.generated_tokens = sum(stats.per_row_tokens)
    if decoder == "ar":
        stats.per_row_forwards = list(stats.per_row_tokens)  # AR needs one forward per token
    stats.extra.update(_settings(decoder, cache, window, block_size, metric, threshold, max_accept, temperature))
    return GenerationResult(texts=texts, token_ids=token_ids, stats=stats, finish_reasons=reasons)


def _settings(decoder, cache, window, block_size, metric, threshold, max_accept, temperature) -> dict[str, Any]:
    return {
        "cache": cache if decoder != "ar" else "hf-dynamic",
        "window": window,
        "block_size": block_size,
        "metric": metric,
        "threshold": threshold if not isinstance(threshold, (list, tuple)) else list(threshold),
        "max_accept": max_accept,
        "temperature": temperature,
    }
