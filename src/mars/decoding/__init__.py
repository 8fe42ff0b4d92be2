"""MARS multi-token decoding (plain PyTorch + transformers).

Entry point::

    from mars.decoding import generate
    result = generate(model, tokenizer, ["Hello"], block_size=4, threshold=0.9, chat_template=True)
    result.texts[0], result.token_ids[0], result.stats.tokens_per_forward

``generate(model, tokenizer, prompts, *, block_size=4, threshold=1.0, metric="probability",
max_new_tokens=256, cache="cursor", cache_block=32, window=None, temperature=0.0, max_accept=None,
stop=None, mask_token_id=None, chat_template=False, decoder="mars", seed=None, progress=False)``

- ``prompts``: list of strings or of token-id lists (ragged batches are fine); ``chat_template=True``
  wraps each string as one user turn with the generation prompt.
- ``threshold``: one number or one per prompt.  ``metric``: ``probability`` (accept while the chosen
  token's probability >= threshold), ``entropy`` (accept while entropy <= threshold, nats) or
  ``margin`` (top-1 minus top-2 probability >= threshold).  Threshold 1.0 (0 for entropy) is exactly
  greedy AR: such rows are capped at one token per step (a float softmax can round to 1.0).
- ``cache``: ``none`` (full forward each step: the paper's sliding window), ``block`` (the paper's
  block-level KV cache, prefix extended once per ``cache_block`` accepted tokens), ``cursor`` (each row
  advances with its own KV cache, no block synchronisation; finished rows leave the batch).
- ``window``: predictions per step; default ``block_size`` (the training block), for which all caches
  compute exactly what the sliding window computes.  ``window="cache_block"`` (with ``cache="block"``)
  lets the masks fill the rest of the cache block (the paper's block-level sampler; changes outputs).
- ``max_accept`` caps tokens accepted per step; ``temperature > 0`` samples (Gumbel-max, ``seed`` for
  reproducibility) with the same acceptance rule; ``stop``: stop strings (text cut before them).
- ``mask_token_id`` defaults to ``tokenizer.mask_token_id``.
- ``decoder``: ``mars`` (default), ``ar`` (``transformers`` ``generate``, KV cache, greedy) or
  ``jacobi`` (training-free Jacobi iteration on the same window), all with the same stop rules.

Returns a :class:`GenerationResult`: ``texts`` and ``token_ids`` (generated only, up to and including
the EOS) per prompt in input order, ``finish_reasons`` (``eos`` | ``stop`` | ``length``) and ``stats``
(:class:`DecodeStats`: ``forwards``, ``generated_tokens``, ``tokens_per_forward``, ``seconds``,
``tokens_per_second``, ``per_row_tokens``, ``per_row_forwards``, ``mean_row_tokens_per_forward``).
"""

from .acceptance import METRICS, accept_counts, choose_tokens, cut_at_eos, exact_ar_rows
from .api import DECODERS, encode_prompts, generate
from .engine import CACHES
from .kv import RaggedKVCache
from .stats import DecodeStats, GenerationResult

__all__ = [
    "CACHES",
    "DECODERS",
    "METRICS",
    "DecodeStats",
    "GenerationResult",
    "RaggedKVCache",
    "accept_counts",
    "choose_tokens",
    "cut_at_eos",
    "encode_prompts",
    "exact_ar_rows",
    "generate",
]
