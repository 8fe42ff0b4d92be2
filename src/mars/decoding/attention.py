"""The attention every decode runs: SDPA with grouped-query attention done by the kernel (``enable_gqa``), and
inside a fast-path block (:func:`mars.decoding.fastpath.fast_linear`) a decode step's attention through
``mars::decode_attention``.

With a mask, transformers' SDPA path repeats every key/value head ``num_heads / num_kv_heads`` times
(``repeat_kv``) unless the step has a single query: it copies the whole KV cache at every layer of every
multi-query step (MARS windows, verify drafts, prefill), and for a decode step of a few queries that copy
costs more than the attention itself.  ``scaled_dot_product_attention(..., enable_gqa=True)`` reads the
grouped keys/values in place: the same dot products, bit-identical outputs, without the copy.

Under the fast path the attention of a step of up to 1024 query columns goes through the same function the
lean forward calls (:func:`mars.decoding.fastpath.attention`), so the model's own forward and the lean
forward agree bit for bit there too.

Used inside :func:`mars_attention`, which switches a model whose attention is ``sdpa`` to it for the
duration of a decode (MARS engine and the AR baseline's ``generate``) and restores it afterwards.  Calls
it does not cover (position biases, soft-capping, paged caches, dropout; no mask with several queries, which
means causal) go to transformers' own SDPA function unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import fastpath

NAME = "mars_sdpa"


def mars_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    grouped = query.shape[1] != key.shape[1]
    extras = any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "cache"))
    masked = attention_mask is not None and attention_mask.dim() == 4
    if (
        fastpath.attention_on()
        and not extras
        and dropout == 0.0
        and (masked or (attention_mask is None and query.shape[2] == 1))
    ):
        if masked:
            attention_mask = attention_mask[:, :, :, : key.shape[-2]]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return fastpath.attention(query, key, value, attention_mask, scale).transpose(1, 2).contiguous(), None
    if not grouped or not masked or extras:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, mars_sdpa_attention)
# the masks transformers builds for it (AR generate with left padding) are SDPA's; without this entry an
# unknown implementation gets no padding mask at all
AttentionMaskInterface.register(NAME, sdpa_mask)


@contextmanager
def mars_attention(model):
    """Run ``model`` with :func:`mars_sdpa_attention` if it uses SDPA."""
    config = model.config
    current = getattr(config, "_attn_implementation", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if current != "sdpa" or text is not config:
        yield
        return
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = current
