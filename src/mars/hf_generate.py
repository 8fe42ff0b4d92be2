"""MARS decoding for ``transformers``' ``model.generate(..., custom_generate=<folder>, trust_remote_code=True)``.

Every exported MARS folder (training's ``hf/``, a gated adapter's folder, ``python -m mars.integrations.export``'s)
carries this file as ``custom_generate/generate.py`` (:mod:`mars.custom_generate_files`); ``transformers`` runs its
:func:`generate` in place of the built-in one.  It needs ``torch`` and ``transformers`` only.

Modes (greedy only):

* **verify** (the default, ``threshold`` 1.0 or unset): lossless self-speculation.  Each forward carries the
  text's newest token, the drafts and ``block_size - 1`` mask tokens.  The output at the newest token and at
  each draft is the model's exact greedy prediction for the next position, so the leading drafts that equal
  those predictions are kept, followed by the prediction after them (the correction, or the bonus when all
  drafts passed): the output is token for token that of plain greedy ``generate``.  When every draft passed,
  the masks' predictions (they follow the right text) are the next forward's drafts.
* **thresholded** (``threshold`` below 1.0): the paper's sliding window.  Each forward carries the tokens not
  yet in the cache and ``block_size - 1`` masks; the predictions are accepted left to right while the top
  probability stays at or above ``threshold`` (at least one).  Faster, not lossless.  Confidences use the
  checkpoint's per-depth mask temperatures when the export recorded them (``mars_mask_temperatures``).

Rows decode one after another, each with its own cache and without padding inside the model, so a row's output
is its batch-of-one greedy output.  Extra arguments: ``threshold``, ``block_size`` (default: the checkpoint's
``mars_block_size``), ``mask_token_id`` (default: the config's ``mask_token_id``).  The statistics (forwards,
generated tokens, tokens per forward, accepted drafts per position) are set on ``model.mars_generate_stats``
after every call, and with ``return_dict_in_generate=True`` the output carries them as fields.

A MARS gated adapter acts only where the input is the mask token; plain ``peft`` applies it everywhere, so a
model carrying LoRA layers without the MARS gate is refused: load such a checkpoint with
``mars.models.load_model``, which installs the gate, and call this on its ``.model``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import os

import torch
from transformers import DynamicCache, GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

# generation settings that would make plain greedy ``generate`` differ from the model's argmax: refused, so that
# "identical to greedy generate" stays true of whatever this returns
_LOGIT_CHANGING = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "force_words_ids": None,
    "min_length": 0,
    "min_new_tokens": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "sequence_bias": None,
    "exponential_decay_length_penalty": None,
    "guidance_scale": None,
}


@dataclasses.dataclass
class MarsGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus the decoding statistics of the call (batch totals)."""

    forwards: int | None = None
    generated_tokens: int | None = None
    tokens_per_forward: float | None = None
    accepted_per_position: list[float] | None = None  # verify: share of steps whose draft at position k passed
    mode: str | None = None


def _mask_token_id(model, given) -> int:
    config = model.config
    mask = given if given is not None else getattr(config, "mask_token_id", None)
    if mask is None and getattr(model, "mars_gate", None) is not None:
        mask = int(model.mars_gate.mask_token_id)  # a gated adapter loaded by mars.models.load_model
    if mask is None:
        raise ValueError(
            f"{type(model).__name__} ({getattr(config, '_name_or_path', '') or 'unnamed'}) has no mask token: "
            "config.json names no mask_token_id, so it is not a MARS checkpoint this decoder can use. Export a "
            "MARS checkpoint with `python -m mars.integrations.export <checkpoint> <out>` (it writes mask_token_id), "
            "or pass mask_token_id=<id> to generate()"
        )
    vocab = model.get_input_embeddings().weight.shape[0]
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < vocab:
        raise ValueError(f"mask_token_id must be a token id in [0, {vocab}), got {mask!r}")
    return mask


def _check_gate(model) -> None:
    gated = getattr(model, "mars_gate", None) is not None
    if getattr(model.config, "mars_gated_lora", None) and not gated:
        raise ValueError(
            "this folder is a MARS gated adapter exported for vLLM: transformers loads its base weights only, "
            "without the adapter (mars_gated_lora.safetensors) or its gate. Load the adapter folder with "
            "mars.models.load_model(<adapter folder>) and call generate on its .model"
        )
    lora = any(hasattr(m, "lora_A") for m in model.modules())
    if lora and not gated:
        raise ValueError(
            "this model carries LoRA layers without the MARS gate: plain peft applies a gated MARS adapter at "
            "every position, so the context would no longer be the base model's. Load the adapter folder with "
            "mars.models.load_model(<adapter folder>) (it installs the gate) and call generate on its .model"
        )


def _settings(model, generation_config, kwargs):
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    unused = config.update(**kwargs)
    if config.do_sample:
        raise ValueError("MARS custom_generate decodes greedily: pass do_sample=False (sampling is not supported)")
    for name, plain in (("num_beams", 1), ("num_return_sequences", 1)):
        if (getattr(config, name, None) or 1) != plain:
            raise ValueError(f"MARS custom_generate supports {name}=1 only, got {getattr(config, name)!r}")
    for name, plain in _LOGIT_CHANGING.items():
        value = getattr(config, name, plain)
        if value not in (plain, None) and not (name == "min_length" and value == 0):
            raise ValueError(
                f"MARS custom_generate does not apply {name}={value!r} (it changes greedy decoding); leave it unset"
            )
    if config.output_scores or config.output_logits or config.output_attentions or config.output_hidden_states:
        raise ValueError("MARS custom_generate returns no scores, logits, attentions or hidden states")
    return config, unused


def _budget(config: GenerationConfig, prompt_length: int) -> int:
    if config.max_new_tokens is not None:
        return int(config.max_new_tokens)
    if config.max_length is not None:
        return max(0, int(config.max_length) - prompt_length)
    return 20  # transformers' own default max_length


def _eos_ids(config: GenerationConfig) -> list[int]:
    eos = config.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _mask_temperatures(model, width: int) -> list[float]:
    """One divisor per window position: 1.0 for the exact AR column, the checkpoint's per-depth mask
    temperatures after it (the deepest repeated), 1.0 everywhere without a recorded calibration."""
    recorded = getattr(model.config, "mars_mask_temperatures", None) or []
    out = [1.0]
    for depth in range(1, width):
        out.append(float(recorded[min(depth, len(recorded)) - 1]) if recorded else 1.0)
    return out


class _Row:
    """One row's decoding state: its cache, the real tokens not yet in it, its drafts."""

    def __init__(self, model, prompt: list[int]):
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.cached = 0
        self.pending = list(prompt)
        self.drafts: list[int] = []

    def forward(self, tokens: list[int], keep: int) -> torch.Tensor:
        """Logits ``[keep, vocab]`` of the last ``keep`` of ``tokens`` fed after the cached prefix."""
        device = self.model.get_input_embeddings().weight.device
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        positions = torch.arange(self.cached, self.cached + len(tokens), device=device).unsqueeze(0)
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            use_cache=True,
            **{cache_keyword(self.model): self.cache},
            **_keep(self.model, keep),
        )
        return out.logits[0, -keep:].float()

    def commit(self, length: int) -> None:
        """Keep the first ``length`` positions of the cache (the real tokens computed with the right prefix)."""
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)  # a negative count removes that many (transformers 4.x and 5.x alike)
        self.cached = length


def cache_keyword(model) -> str:
    """The name ``model.forward`` takes its KV cache by (``cache`` from transformers 5.24, ``past_key_values`` before)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _keep(model, keep: int) -> dict:
    params = inspect.signature(model.forward).parameters
    if "logits_to_keep" in params:
        return {"logits_to_keep": keep}
    if "num_logits_to_keep" in params:
        return {"num_logits_to_keep": keep}
    return {}


def _verify_step(row: _Row, left: int, *, mask_id: int, width: int, stats: dict) -> list[int]:
    """One verify forward: the newest token, the drafts that fit in ``left`` and, while room remains after them,
    ``width - 1`` masks.  Returns the passed drafts and the prediction after them; the masks' predictions become
    the next drafts when every draft passed."""
    drafts = row.drafts[: left - 1]
    masks = width - 1 if left > len(drafts) + 1 else 0
    fed = row.pending + drafts + [mask_id] * masks
    logits = row.forward(fed, 1 + len(drafts) + masks)
    greedy = logits[: 1 + len(drafts)].argmax(-1).tolist()
    passed = 0
    while passed < len(drafts) and drafts[passed] == greedy[passed]:
        passed += 1
    for k in range(len(drafts)):
        stats["offered"][k] = stats["offered"].get(k, 0) + 1
        stats["passed"][k] = stats["passed"].get(k, 0) + (k < passed)
    new = drafts[:passed] + [greedy[passed]]
    row.commit(row.cached + len(row.pending) + passed)
    if passed == len(drafts) and masks:
        guesses = logits[1 + len(drafts) :].clone()
        guesses[:, mask_id] = float("-inf")  # the mask is an input placeholder, never a draft
        row.drafts = guesses.argmax(-1).tolist()
    else:
        row.drafts = []
    row.pending = [new[-1]]
    return new


def _threshold_step(
    row: _Row, left: int, *, mask_id: int, width: int, threshold: float, divisors: torch.Tensor
) -> list[int]:
    """One thresholded forward: the pending tokens and up to ``width - 1`` masks; returns the predictions
    accepted left to right while their confidence stays at or above ``threshold`` (at least one)."""
    masks = min(width - 1, left - 1)
    fed = row.pending + [mask_id] * masks
    logits = row.forward(fed, 1 + masks)
    logits[:, mask_id] = float("-inf")  # never emitted (as in the MARS engine's thresholded mode)
    tokens = logits.argmax(-1)
    confidence = torch.softmax(logits / divisors[: 1 + masks].unsqueeze(-1), -1).gather(-1, tokens[:, None])
    meets = (confidence.squeeze(-1) >= threshold).tolist()
    count = 1  # the first prediction is the exact AR token: always accepted
    while count < len(meets) and meets[count]:
        count += 1
    new = tokens[:count].tolist()
    # the accepted tokens came from mask inputs: they are fed again, as real tokens, next forward
    row.commit(row.cached + len(row.pending))
    row.pending = list(new)
    return new


def _decode_row(model, prompt, *, budget, eos, mask_id, width, threshold, stats, streamer) -> list[int]:
    """Up to ``budget`` greedy tokens after ``prompt``, one forward a step, ending after the first ``eos`` token."""
    row = _Row(model, prompt)
    out: list[int] = []
    verify = threshold is None or threshold >= 1.0
    divisors = torch.tensor(_mask_temperatures(model, width)) if not verify else None
    while len(out) < budget:
        left = budget - len(out)
        if verify:
            new = _verify_step(row, left, mask_id=mask_id, width=width, stats=stats)
        else:
            new = _threshold_step(row, left, mask_id=mask_id, width=width, threshold=threshold, divisors=divisors)
        stats["forwards"] += 1
        stop = next((i for i, t in enumerate(new) if t in eos), None)
        new = new[: left if stop is None else min(left, stop + 1)]
        out += new
        if streamer is not None:
            streamer.put(torch.tensor(new))
        if stop is not None:
            break
    stats["tokens"] += len(out)
    return out


def _batch(input_ids: torch.LongTensor | None) -> torch.LongTensor:
    """``input_ids`` as a ``[batch, length]`` tensor (a single row gains its batch dimension)."""
    if input_ids is None:
        raise ValueError("MARS custom_generate needs input_ids (a [batch, length] tensor of token ids)")
    return input_ids.unsqueeze(0) if input_ids.dim() == 1 else input_ids


def _check_arguments(model, threshold, block_size, logits_processor, stopping_criteria, assistant_model, kwargs):
    """Refuse the arguments this decoder does not honour (popping the unsupported ones from ``kwargs``); returns
    the window width, ``block_size`` or the checkpoint's ``mars_block_size``."""
    if threshold is not None and (isinstance(threshold, bool) or not 0 < float(threshold) <= 1.0):
        raise ValueError(f"threshold must be in (0, 1] (1.0 or unset: lossless verify), got {threshold!r}")
    width = block_size if block_size is not None else getattr(model.config, "mars_block_size", None) or 4
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {width!r}")
    for name, given in (("logits_processor", logits_processor), ("stopping_criteria", stopping_criteria)):
        if given:
            raise ValueError(f"MARS custom_generate does not take {name}")
    if assistant_model is not None:
        raise ValueError("MARS custom_generate drafts from the model's own masks: assistant_model is not supported")
    for ignored in ("synced_gpus", "prefix_allowed_tokens_fn", "negative_prompt_ids", "negative_prompt_attention_mask"):
        if kwargs.pop(ignored, None) is not None:
            raise ValueError(f"MARS custom_generate does not support {ignored}")
    return width


def _generation_config(model, generation_config, kwargs) -> GenerationConfig:
    """The call's generation settings: ``generation_config`` (or the model's) updated with ``kwargs``, refused
    when a setting is one this decoder does not know or would not apply."""
    for passthrough in ("use_cache", "tokenizer", "position_ids", "cache", "past_key_values"):
        kwargs.pop(passthrough, None)
    config, unused = _settings(model, generation_config, kwargs)
    if unused:
        raise ValueError(f"MARS custom_generate got arguments it does not know: {sorted(unused)}")
    return config


def _decode_batch(model, input_ids, attention_mask, config, *, eos, mask_id, width, threshold, stats, streamer):
    """Each row's generated tokens, decoded one row after another from its tokens under ``attention_mask``."""
    rows = input_ids.tolist()
    keep = attention_mask.bool().tolist() if attention_mask is not None else [[True] * len(r) for r in rows]
    if streamer is not None:
        if len(rows) > 1:
            raise ValueError("a streamer takes one row: pass a batch of one")
        streamer.put(input_ids[0].cpu())
    generated = []
    for row, real in zip(rows, keep):
        prompt = [t for t, r in zip(row, real) if r]
        if not prompt:
            raise ValueError("a row of input_ids has no token under its attention_mask")
        budget = _budget(config, len(row))
        generated.append(
            _decode_row(
                model,
                prompt,
                budget=budget,
                eos=eos,
                mask_id=mask_id,
                width=width,
                threshold=threshold,
                stats=stats,
                streamer=streamer,
            )
        )
    if streamer is not None:
        streamer.end()
    return generated


def _sequences(input_ids: torch.LongTensor, generated: list[list[int]], pad: int) -> torch.LongTensor:
    """The prompts followed by their generated tokens, the rows that stopped early padded with ``pad``."""
    longest = max(map(len, generated))
    tail = torch.full((input_ids.shape[0], longest), pad, dtype=input_ids.dtype, device=input_ids.device)
    for b, new in enumerate(generated):
        tail[b, : len(new)] = torch.tensor(new, dtype=input_ids.dtype)
    return torch.cat([input_ids, tail], dim=1)


def _summary(stats: dict, threshold: float | None) -> dict:
    """The call's statistics as :class:`MarsGenerateOutput`'s fields (batch totals)."""
    verify = threshold is None or threshold >= 1.0
    positions = range(max(stats["offered"], default=-1) + 1)
    return {
        "mode": "verify" if verify else f"threshold={threshold}",
        "forwards": stats["forwards"],
        "generated_tokens": stats["tokens"],
        "tokens_per_forward": stats["tokens"] / max(1, stats["forwards"]),
        "accepted_per_position": [stats["passed"][k] / stats["offered"][k] for k in positions] if verify else None,
    }


@torch.no_grad()
def generate(
    model,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.LongTensor | None = None,
    generation_config: GenerationConfig | None = None,
    threshold: float | None = None,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    inputs: torch.LongTensor | None = None,
    logits_processor=None,
    stopping_criteria=None,
    streamer=None,
    assistant_model=None,
    **kwargs,
):
    """Greedy MARS decoding (see the module docstring); returns what plain ``generate`` returns: the sequences
    ``[batch, prompt + generated]`` (rows that stop early padded with ``pad_token_id``), or with
    ``return_dict_in_generate=True`` a :class:`MarsGenerateOutput`."""
    input_ids = _batch(inputs if input_ids is None else input_ids)
    width = _check_arguments(model, threshold, block_size, logits_processor, stopping_criteria, assistant_model, kwargs)
    mask_id = _mask_token_id(model, mask_token_id)
    _check_gate(model)
    config = _generation_config(model, generation_config, kwargs)
    threshold = None if threshold is None else float(threshold)
    eos = _eos_ids(config)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    stats = {"forwards": 0, "tokens": 0, "offered": {}, "passed": {}}
    generated = _decode_batch(
        model,
        input_ids,
        attention_mask,
        config,
        eos=eos,
        mask_id=mask_id,
        width=width,
        threshold=threshold,
        stats=stats,
        streamer=streamer,
    )
    sequences = _sequences(input_ids, generated, pad)
    summary = _summary(stats, threshold)
    model.mars_generate_stats = summary
    if os.environ.get("MARS_GENERATE_VERBOSE"):
        print(f"mars generate: {summary}")
    if config.return_dict_in_generate:
        return MarsGenerateOutput(sequences=sequences, **summary)
    return sequences
