"""The AR baseline: ``transformers`` ``generate`` with its KV cache, under the same stop rules."""

from __future__ import annotations

import time

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from .attention import mars_attention
from .fastpath import fast_linear
from .forward import warm_vector_math
from .huge_pages import place_weights
from .stats import DecodeStats
from .stopping import StopStrings


def generate_ar(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_ids: list[int],
    stops: StopStrings,
    temperature: float = 0.0,
    cache_implementation: str = "dynamic",
    suppress_ids: list[int] | None = None,
) -> tuple[list[list[int]], DecodeStats]:
    """Greedy (or plain-sampling) AR decoding of left-padded ``prompts``; returns the raw generated
    ids per row (the caller applies the shared stop rules) and statistics (one forward per step).
    ``suppress_ids`` (the mask token) are never generated: transformers sets their logits to -inf, as
    the MARS engine does, so the baseline and MARS at threshold 1.0 stay token-for-token equal."""
    device = next(model.parameters()).device
    place_weights(model)  # the weights in huge pages, as the MARS engine streams them
    warm_vector_math()  # as the MARS engine does: a process's first cos can round differently
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    input_ids, attention = _left_padded(prompts, pad_id)
    config = _plain_generation_config(
        max_new_tokens, eos_ids, pad_id, stops, temperature, cache_implementation, suppress_ids
    )
    out, seconds, first_token_seconds = _timed_generate(
        model, input_ids, attention, config, device=device, tokenizer=tokenizer if stops else None
    )
    new = out[:, input_ids.shape[1] :].cpu()
    raw = [row.tolist() for row in new]
    stats = DecodeStats(
        forwards=new.shape[1],  # one forward per generated step
        generated_tokens=0,
        seconds=seconds,
        per_row_tokens=[],
        per_row_forwards=[],
        decoder="ar",
        extra={"ar_cache": f"hf-{cache_implementation}"},
        first_token_seconds=first_token_seconds,
    )
    return raw, stats


def _timed_generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    config: GenerationConfig,
    *,
    device: torch.device,
    tokenizer: PreTrainedTokenizerBase | None,
) -> tuple[torch.Tensor, float, float | None]:
    """``model.generate``'s output ids (prompt and new tokens), its wall-clock seconds (the device synchronised)
    and the seconds to its first new token (``tokenizer`` serves ``config``'s stop strings).  The copy of the
    inputs to ``device`` is timed too."""
    start = time.perf_counter()
    first_token = _FirstToken(start)
    # the same fast path and attention as the MARS engine, so that the baseline gets every speed-up
    with torch.inference_mode(), fast_linear(model), mars_attention(model):
        out = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            generation_config=config,
            tokenizer=tokenizer,
            streamer=first_token,
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start, first_token.seconds


class _FirstToken(BaseStreamer):
    """When ``generate`` hands over its first new tokens (its first call is the prompt), for the time to first
    token; nothing else."""

    def __init__(self, start: float):
        self.start, self.seconds, self.calls = start, None, 0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.seconds = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def _left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one left-padded id tensor and its attention mask (1 on real tokens)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        input_ids[b, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attention[b, width - len(p) :] = 1
    return input_ids, attention


def _plain_generation_config(
    max_new_tokens: int,
    eos_ids: list[int],
    pad_id: int,
    stops: StopStrings,
    temperature: float,
    cache_implementation: str,
    suppress_ids: list[int] | None,
) -> GenerationConfig:
    """A fresh config so that nothing in the checkpoint's generation defaults (repetition penalty,
    top-k, ...) makes the baseline differ from plain greedy decoding."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=None,
        top_p=None,
        num_beams=1,
        eos_token_id=list(eos_ids),
        pad_token_id=pad_id,
        use_cache=True,
        cache_implementation=None if cache_implementation == "dynamic" else cache_implementation,
        stop_strings=list(stops.strings) or None,
        suppress_tokens=list(suppress_ids) if suppress_ids else None,
    )
