"""MARS multi-token decoding (plain PyTorch + transformers).

Entry point::

    from mars.decoding import generate
    result = generate(model, tokenizer, ["Hello"], block_size=4, threshold=0.9, chat_template=True)
    result.texts[0], result.token_ids[0], result.stats.tokens_per_forward

``generate(model, tokenizer, prompts, *, stop=None, mask_token_id=None, chat_template=False,
progress=False, settings=None, observers=(), **decoding)``: ``decoding`` is any field of :class:`DecodingSettings`
(``block_size=4, threshold=1.0, metric="probability", max_new_tokens=256, cache="cursor", window=None,
verify=False, draft_source="masks", lookup_ngram=3, ...``: each field's default and help are declared
there, ``DecodingSettings.help()`` lists them), or ``settings=`` one such object, never both.

- ``prompts``: list of strings or of token-id lists (ragged batches are fine); ``chat_template=True``
  wraps each string as one user turn with the generation prompt.
- ``threshold``: one number or one per prompt.  ``metric``: ``probability`` (accept while the chosen
  token's probability >= threshold), ``entropy`` (accept while entropy <= threshold, nats) or
  ``margin`` (top-1 minus top-2 probability >= threshold).  Threshold 1.0 (0 for entropy) is exactly
  greedy AR: such rows are capped at one token per step (a float softmax can round to 1.0).
- ``cache``: ``none`` (full forward each step: the paper's sliding window), ``block`` (the paper's
  block-level KV cache, prefix extended once per ``cache_block`` accepted tokens), ``cursor`` (each row
  advances with its own KV cache, no block synchronisation; finished rows leave the batch).
- ``window``: predictions per step; default ``block_size``.  ``window="cache_block"`` (with
  ``cache="block"``) lets the masks fill the rest of the cache block (the paper's block-level sampler).
- ``verify=True``: lossless self-speculation; the masks' predictions are drafts verified by the next
  forward, output identical to greedy AR (exact sampling at temperature > 0); ``draft_length``,
  ``draft_threshold``, ``fallback``, ``chain_drafts`` and ``verify_masks`` tune it (see :class:`DecodingSettings`).
- ``max_accept`` caps tokens accepted per step; ``temperature > 0`` samples (Gumbel-max, ``seed`` for
  reproducibility, one generator per row) with the same acceptance rule; ``stop``: stop strings.
- ``decoder``: ``mars`` (default), ``ar`` (``transformers`` ``generate``, KV cache, greedy) or
  ``jacobi`` (training-free Jacobi iteration on the same window), all with the same stop rules.
- ``settings``: a :class:`DecodingSettings` instead of the keywords (one validated object shared with
  the configs, the lm-eval adapter, the server and the benchmark CLIs); keywords beside it are refused.

Returns a :class:`GenerationResult`: ``texts`` and ``token_ids`` (generated only, up to and including
the EOS) per prompt in input order, ``finish_reasons`` (``eos`` | ``stop`` | ``length``) and ``stats``
(:class:`DecodeStats`).  For serving, :class:`DecodeEngine` takes requests between steps.

Importing this package is cheap: the torch-backed pieces load on first use, so configs can be
validated with :mod:`mars.decoding.settings` before torch is imported.
"""

from .settings import CACHES, DECODERS, METRICS, DecodingSettings

_LAZY = {
    "generate": ".api",
    "encode_prompts": ".api",
    "check_prompts": ".prompt_check",
    "DecodeEngine": ".engine",
    "StepEvent": ".step",
    "Request": ".rows",
    "Finished": ".rows",
    "RaggedKVCache": ".kv",
    "DecodeStats": ".stats",
    "GenerationResult": ".stats",
    "accept_counts": ".acceptance",
    "choose_tokens": ".acceptance",
    "cut_at_eos": ".acceptance",
    "exact_ar_rows": ".acceptance",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'mars.decoding' has no attribute {name!r}")


__all__ = ["CACHES", "DECODERS", "METRICS", "DecodingSettings", *_LAZY]
