"""One model forward that returns logits only at the columns the decoder reads.

The LM head is a large matmul (49k x 576 for SmolLM2, 152k x 3584 for Qwen2.5-7B); running it on every
input column (prompt, recomputed block, padding) would waste a large share of each step, so the
decoder gathers the hidden states of the window columns first and applies the head to those only.
Models whose head is more than a linear layer (logit soft-capping, scaling) fall back to the full
forward and gather the logits.
"""

from __future__ import annotations

import functools

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from .fastpath import enabled_by_env, fast_linear, linear, only_columns, step_width, usable
from .huge_pages import place_weights
from .kv import RaggedKVCache
from .lean import lean_decoder


@functools.cache
def warm_vector_math() -> None:
    """The process's first ``torch.cos`` and ``sin``, once, before any decoding, on as many elements as a short
    prompt's rotary embedding (split over the threads as it is).  A process's first call can round differently
    from every later one, which would move the first prompt's prefill logits through the rotary embedding; made
    here first, it leaves every prompt's prefill with the same bits.  Its own results are thrown away."""
    angles = torch.linspace(0.0, 64.0, 4096)
    torch.cos(angles)
    torch.sin(angles)


class ModelRunner:
    """``fast``: route the model's linear layers through :mod:`mars.decoding.fastpath` during each
    forward (None: on unless ``MARS_FAST_PATH=0``)."""

    def __init__(self, model: PreTrainedModel, fast: bool | None = None):
        self.model = model
        self.fast = fast
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = config
        base = getattr(model, getattr(model, "base_model_prefix", ""), None)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        special_head = any(
            getattr(config, name, None) not in (None, 1.0, 0.0)
            for name in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
        )
        self.base = base if (base is not None and base is not model and head is not None and not special_head) else None
        self.head = head
        self.device = next(model.parameters()).device
        place_weights(model)  # once per model: every step streams the weights (mars.decoding.huge_pages)
        warm_vector_math()
        self.num_layers = config.num_hidden_layers
        self.context_length = getattr(config, "max_position_embeddings", None)
        out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.vocab_size = int(out.weight.shape[0]) if out is not None else int(config.vocab_size)
        self._lean = None  # the lean forward (mars.decoding.lean), built at the first fast step; False: not possible
        self._kernel_usable: bool | None = None  # fastpath.usable(model), asked once (it walks every module)
        # SDPA models take the step's mask additive (same result; see logits_at)
        self.additive_mask = getattr(model.config, "_attn_implementation", None) == "sdpa"

    def _lean_forward(self):
        if self._lean is None:
            self._lean = lean_decoder(self.model) or False
        return self._lean or None

    def fast_path(self) -> bool:
        """The fast path for this step: asked for (``fast``, else ``MARS_FAST_PATH``) and usable here."""
        if not (enabled_by_env() if self.fast is None else self.fast):
            return False
        if self._kernel_usable is None:
            self._kernel_usable = usable(self.model)
        return self._kernel_usable

    def logits_at(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        columns: torch.Tensor,
        cache: Cache | None = None,
        live: torch.Tensor | None = None,
        live_columns: torch.Tensor | None = None,
        widths: tuple[int, int, int] | None = None,
    ) -> torch.Tensor:
        """Logits ``[batch, len(columns[b]), vocab]`` at the input ``columns`` (``[batch, P]``).

        ``live`` (``[batch, input columns]``) and ``live_columns`` (``[batch, P]``), optional: which input
        columns and which of ``columns`` the caller reads (padding of a batch of unequal rows is not);
        under the fast path the others are not computed (their logits are zeros).  ``widths``, optional: the widths
        of the step's forward and of its LM head against the fast path's kernel, and the queries per row against its
        attention kernel (:func:`~mars.decoding.fastpath.step_width`; None: the columns each computes)."""
        if attention_mask.dtype == torch.bool and self.additive_mask:
            # SDPA turns a boolean mask into an additive one in every layer (4 ops each); once per step here
            dtype = self.model.dtype
            additive = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
            attention_mask = additive.masked_fill_(~attention_mask, float("-inf"))
        kwargs = dict(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=cache is not None,
        )
        fast = self.fast_path()
        width, head_width, queries = widths if widths is not None else (None, None, None)
        lean = None
        if fast and self.base is not None and (cache is None or isinstance(cache, RaggedKVCache)):
            lean = self._lean_forward()
        if lean is not None:  # calls the kernel itself: no module patching per step
            with only_columns(live), step_width(width, queries):
                hidden = lean(input_ids, position_ids, attention_mask, cache)
            picked = hidden.gather(1, columns.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
            with only_columns(live_columns), step_width(head_width):
                return linear(picked, self.head.weight, self.head.bias)
        return self._module_logits(kwargs, columns, fast, live, live_columns, width, head_width, queries)

    def _module_logits(self, kwargs, columns, fast, live, live_columns, width, head_width, queries) -> torch.Tensor:
        """:meth:`logits_at` through the model's own modules, called with ``kwargs`` (their linear layers on the
        fast path's kernel while ``fast``): the base model and the head at ``columns`` only, where the head is a
        plain linear layer; else the whole model, its logits gathered at ``columns``."""
        with fast_linear(self.model, fast) as fast:
            if not fast:
                live = live_columns = None
            if self.base is not None:
                with only_columns(live), step_width(width, queries):
                    hidden = self.base(**kwargs).last_hidden_state
                picked = hidden.gather(1, columns.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
                with only_columns(live_columns), step_width(head_width):
                    return self.head(picked)
            with only_columns(live), step_width(width, queries):
                logits = self.model(**kwargs).logits
        return logits.gather(1, columns.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
