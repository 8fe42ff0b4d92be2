"""SDPA with grouped-query attention packed into the query axis, for multi-query decode steps.

With a 4D mask, transformers' SDPA path repeats every key/value head ``num_heads / num_kv_heads`` times
(``repeat_kv``), copying the whole KV cache at every layer of every step; for a decode step of a few
queries that copy costs more than the attention itself.  ``transformers`` avoids it for one-query steps
by folding the query heads of a group into the query axis (``pack_gqa``); this does the same for ``Q``
queries: ``[B, H, Q, D] -> [B, H_kv, g*Q, D]``, the mask repeated ``g`` times along the query axis.
Exactly the same dot products; the keys/values are read in place.

Used only inside :func:`packed_gqa`, which switches a model whose attention is ``sdpa`` to it for the
duration of a MARS decode and restores it afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "mars_packed_sdpa"


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    groups = query.shape[1] // key.shape[1]
    if groups == 1 or attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, q_len, dim = query.shape
    packed = query.reshape(batch, key.shape[1], groups * q_len, dim)
    mask = attention_mask.repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )
    out = out.reshape(batch, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous()
    return out, None


AttentionInterface.register(NAME, packed_sdpa_attention)


@contextmanager
def packed_gqa(model):
    """Run ``model`` with :func:`packed_sdpa_attention` if it uses SDPA with grouped KV heads."""
    config = model.config
    current = getattr(config, "_attn_implementation", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    grouped = getattr(text, "num_key_value_heads", None) not in (None, getattr(text, "num_attention_heads", None))
    if current != "sdpa" or not grouped or text is not config:
        yield
        return
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = current
