"""SDPA with grouped-query attention done by the kernel (``enable_gqa``), for every decode step.

With a mask, transformers' SDPA path repeats every key/value head ``num_heads / num_kv_heads`` times
(``repeat_kv``) unless the step has a single query: it copies the whole KV cache at every layer of every
multi-query step (MARS windows, verify drafts, prefill), and for a decode step of a few queries that copy
costs more than the attention itself.  ``scaled_dot_product_attention(..., enable_gqa=True)`` reads the
grouped keys/values in place; the same dot products (measured on SmolLM2-135M's 9/3 heads, fp32, one
thread: 36-190 us per layer against 67-2,800 us with the repeat, outputs bit-identical).

Used inside :func:`gqa_attention`, which switches a model whose attention is ``sdpa`` to it for the
duration of a decode (MARS engine and the AR baseline's ``generate``) and restores it afterwards.  Calls
it does not cover (no mask, position biases, soft-capping, paged caches, ungrouped heads) go to
transformers' own SDPA function unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "mars_gqa_sdpa"


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    grouped = query.shape[1] != key.shape[1]
    plain = (
        attention_mask is not None
        and attention_mask.dim() == 4
        and not any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "cache"))
    )
    if not grouped or not plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, gqa_sdpa_attention)
# the masks transformers builds for it (AR generate with left padding) are SDPA's; without this entry an
# unknown implementation gets no padding mask at all
AttentionMaskInterface.register(NAME, sdpa_mask)


@contextmanager
def gqa_attention(model):
    """Run ``model`` with :func:`gqa_sdpa_attention` if it uses SDPA with grouped KV heads."""
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
