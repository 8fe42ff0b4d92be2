"""A lean decoder forward for Llama-family models (Llama, Qwen2, Mistral): the same ops as transformers', without
its per-module Python.

On a 2-core CPU a decode step of SmolLM2-135M spends tens of milliseconds outside its arithmetic: module
calls, hooks, output capturing, keyword plumbing and the attention-interface lookup, 30 layers deep.  This
forward walks the layers itself and calls exactly the tensor ops transformers' modules call, in the same
order and dtypes (RMSNorm in fp32, RoPE with the model's own rotary module, SwiGLU), with the linear layers
and the attention through the decode fast path (``fastpath.attention``: ``mars::decode_attention`` for a decode
step's few query columns and prefills of up to 1024, SDPA with grouped KV heads otherwise; the model's own
attention takes the same under the fast path, :mod:`mars.decoding.attention`).  Its logits are bit-identical to
the model's own forward under the fast path (tested), so everything proven about that forward holds for it.

:func:`lean_decoder` also mirrors a gated adapter (:mod:`mars.adapters`): its gate from the input ids, the
mask-embedding delta and each LoRA layer's ``B(A(h) * gate) * scaling``, op for op.  It returns None (and the
caller runs the model's own forward) for anything it does not mirror exactly: other architectures, attention other
than SDPA, q/k norms, hooks (accelerate offload), activations other than SiLU, tensor-parallel pretraining splits.

A step on the per-row cache (every step of the engine's cursor cache, at any batch size; the projections of
steps wider than the kernel takes, ``fastpath.beyond_kernel``, through ``F.linear``, as in the Python loop) runs
the same loop in C++ (``mars.decoding.kernels``' ``DecoderStep``: the same ATen ops in the same order,
bit-identical, tested) instead of Python, which saves the interpreter's share of every step.
``MARS_DECODER_STEP=0`` turns it off.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from mars.decoding.kernels import KernelUnavailable

from .fastpath import (
    attention,
    attention_width,
    beyond_kernel,
    computed_rows,
    down_linear,
    enabled_by_env,
    fused_linears,
    kernel_takes,
    linear,
    lowrank_linear,
    packed_lowrank,
    streamed_factor,
)

log = logging.getLogger(__name__)

# Off switch for the C++ decoder pass (mars.decoding.kernels' DecoderStep); the Python loop below then runs every step.
NATIVE_ENV = "MARS_DECODER_STEP"

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SDPA = ("sdpa", "mars_sdpa")


def lean_reason(model) -> str | None:
    """Why :class:`LeanDecoder` cannot mirror ``model``'s forward, or None when it can."""
    name = type(model).__name__
    if name not in ARCHITECTURES:
        return f"architecture {name} (lean forward: {', '.join(ARCHITECTURES)})"
    config = model.config
    if getattr(config, "_attn_implementation", None) not in SDPA:
        return f"attention {config._attn_implementation!r} (lean forward: sdpa)"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {config.hidden_act!r} (lean forward: silu)"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return "sliding-window layers"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "rotary_emb") or type(getattr(model, "lm_head", None)) is not torch.nn.Linear:
        return "unexpected module layout"
    gate = getattr(model, "mars_gate", None)
    if gate is not None and not gate.gated:
        return "an unmerged (ungated) LoRA adapter"
    for module in model.modules():  # (2,500 modules with an adapter: asked before every generate, so kept cheap)
        if "_hf_hook" in module.__dict__:  # accelerate's (not hasattr: nn.Module raises and catches for a miss)
            return f"a forward hook on {type(module).__name__}"
        if not (module._forward_hooks or module._forward_pre_hooks):
            continue
        hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
        if gate is None or not all(_is_gate_hook(h, gate) for h in hooks):  # the gated adapter's are mirrored
            return f"a forward hook on {type(module).__name__}"
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projections += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        for p in projections:
            reason = _projection_reason(p, gate)
            if reason:
                return reason
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return "q/k norms"
    return None


def _is_gate_hook(hook, gate) -> bool:
    return getattr(hook, "__self__", None) is gate


def _projection_reason(p, gate) -> str | None:
    """None when ``p`` is a plain ``nn.Linear``, or a gated LoRA layer this forward mirrors exactly."""
    if type(p) is torch.nn.Linear:
        return None
    if gate is None or p not in gate.lora_layers:
        return "a projection that is not a plain nn.Linear (quantized or adapted)"
    if type(p.get_base_layer()) is not torch.nn.Linear or list(p.lora_A) != ["default"]:
        return "a LoRA layer with another base layer or several adapters"
    if type(p.lora_dropout["default"]) is not torch.nn.Identity or p.use_dora.get("default"):
        return "LoRA dropout or DoRA"
    return None


class _Group:
    """Projections of one input (``names`` of ``parent``): their base weights and biases and, for the gated
    LoRA layers among them, the low-rank factors and scalings (None and 0 for the others)."""

    def __init__(self, parent, names: tuple[str, ...]):
        self.modules = [getattr(parent, n) for n in names]
        bases = [m.get_base_layer() if hasattr(m, "get_base_layer") else m for m in self.modules]
        self.weights = [b.weight for b in bases]
        self.biases = [b.bias for b in bases]
        adapted = [m is not b for m, b in zip(self.modules, bases)]
        self.lora = None
        self._fused_lora = None
        if any(adapted):
            self.lora = (
                [m.lora_A["default"].weight if a else None for m, a in zip(self.modules, adapted)],
                [m.lora_B["default"].weight if a else None for m, a in zip(self.modules, adapted)],
                [float(m.scaling["default"]) if a else 0.0 for m, a in zip(self.modules, adapted)],
            )

    def fused_lora(self):
        """:attr:`lora` as :func:`~mars.decoding.fastpath.fused_linears` takes it (up factors packed, once), or
        None where the kernel does not take the factors (autograd, not float32 on the CPU)."""
        if self._fused_lora is None:
            down, up, scalings = self.lora
            factors = [f for f in (*down, *up) if f is not None]
            if torch.is_grad_enabled() or any(f.dtype != torch.float32 or f.device.type != "cpu" for f in factors):
                return None
            self._fused_lora = (
                [None if a is None else streamed_factor(a) for a in down],
                [None if b is None else packed_lowrank(b) for b in up],
                scalings,
            )
        return self._fused_lora


class LeanDecoder:
    """``hidden = LeanDecoder(model)(input_ids, position_ids, attention_mask, cache)``: the final normed hidden
    states ``[batch, columns, hidden]``, as ``model.model(...).last_hidden_state``."""

    def __init__(self, model):
        base = model.model
        self.gate = getattr(model, "mars_gate", None)  # a gated adapter (mars.adapters), mirrored here
        self.gate_columns: torch.Tensor | None = None  # [batch, columns, 1]: 1.0 at mask columns
        self.mask_rows: torch.Tensor | None = None  # the mask columns among the rows the kernel computes
        self.embed, self.rotary, self.norm = base.embed_tokens, base.rotary_emb, base.norm
        config = model.config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.layers = [
            (
                layer.input_layernorm,
                layer.self_attn,
                layer.post_attention_layernorm,
                # the kernel's arguments per group of projections of one input, looked up once, not per step
                [
                    _Group(layer.self_attn, ("q_proj", "k_proj", "v_proj")),
                    _Group(layer.self_attn, ("o_proj",)),
                    _Group(layer.mlp, ("gate_proj", "up_proj")),
                    _Group(layer.mlp, ("down_proj",)),
                ],
            )
            for layer in base.layers[: config.num_hidden_layers]
        ]
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self._native = None  # the C++ pass (built at the first step it can take); False: not here

    def _native_step(self):
        """The C++ decoder pass over this model's weights, or None where it is off or cannot be built."""
        if self._native is None:
            on = enabled_by_env(NATIVE_ENV)  # a bad value is refused at every step, not remembered as off
            self._native = False
            if on:
                try:
                    self._native = self._build_native()
                except KernelUnavailable as err:
                    log.info("C++ decoder step not used (%s); the Python loop runs", err)
        return None if self._native is False else self._native

    def _build_native(self):
        from mars.decoding.kernels import decoder_step_class

        norms, eps, scales, weights, biases, lora_a, lora_b, scalings = [], [], [], [], [], [], [], []
        adapted = any(g.lora is not None for *_, groups in self.layers for g in groups)
        for norm1, attn, norm2, groups in self.layers:
            norms += [norm1.weight, norm2.weight]
            eps += [float(norm1.variance_epsilon), float(norm2.variance_epsilon)]
            scales.append(float(attn.scaling))
            for g in groups:
                weights += g.weights
                biases += g.biases
                if adapted:
                    a, b, s = (
                        g.lora if g.lora is not None else ([None] * len(g.weights),) * 2 + ([0.0] * len(g.weights),)
                    )
                    lora_a += a
                    lora_b += b
                    scalings += s
        factors = [f for f in (*lora_a, *lora_b) if f is not None]
        if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (*norms, *weights, *factors)):
            return False
        norms.append(self.norm.weight)
        eps.append(float(self.norm.variance_epsilon))
        # the factors as the kernel streams them, shared with the Python loop
        streamed = [None if a is None else streamed_factor(a) for a in lora_a]
        packed = [None if b is None else packed_lowrank(b) for b in lora_b]
        step = decoder_step_class()
        return step(norms, eps, scales, weights, biases, streamed, packed, scalings, self.head_dim)

    @staticmethod
    def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:  # LlamaRMSNorm.forward, op for op
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + norm.variance_epsilon)
        return norm.weight * h.to(dtype)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def _project_group(self, h: torch.Tensor, group: _Group) -> list[torch.Tensor]:
        """Projections of one input (q/k/v, gate/up, or one alone) in one pass of the kernel, the gated LoRA
        terms included; each one on its own where the fused kernel does not apply.  Same results either way."""
        lora = None
        if self.gate_columns is not None and group.lora is not None:
            lora = group.fused_lora()
            if lora is None:
                return [self._project(h, m) for m in group.modules]
        outputs = fused_linears(h, group.weights, group.biases, lora, self.mask_rows)
        if outputs is None:
            return [self._project(h, m) for m in group.modules]
        return outputs

    def _project(self, h: torch.Tensor, module) -> torch.Tensor:
        """A projection; a gated LoRA layer adds ``B(A(h) * gate) * scaling`` as its peft forward does with the
        adapter's gate hook: op for op where the kernel does not take the factors, else only at the mask
        columns (the factors' products through the kernel give each column the same bits at any width, and the
        other columns add zeros), so a prefill wider than the kernel pays the adapter at its masks alone."""
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        y = linear(h, base.weight, base.bias)
        if self.gate_columns is None or base is module:
            return y
        down, up, scaling = module.lora_A["default"].weight, module.lora_B["default"].weight, module.scaling["default"]
        if not (kernel_takes(h, down) and kernel_takes(h, up) and computed_rows(tuple(h.shape[:-1])) is None):
            a = down_linear(h, down) * self.gate_columns
            return y + lowrank_linear(a, up) * scaling
        at_masks = h.reshape(-1, h.shape[-1]).index_select(0, self.mask_rows)
        delta = lowrank_linear(down_linear(at_masks, down), up) * scaling
        return y.view(-1, y.shape[-1]).index_add(0, self.mask_rows, delta).view(y.shape)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # the embedding's weights directly: the module may carry the gated adapter's hook, mirrored here
        x = F.embedding(input_ids, self.embed.weight)
        self.gate_columns = self.mask_rows = None
        if self.gate is not None:
            where = input_ids == self.gate.mask_token_id
            if bool(where.any()):  # as MaskGate.before_decoder: no mask token, no adapter at all
                self.gate_columns = where.unsqueeze(-1).to(x.dtype)
                rows = computed_rows(tuple(input_ids.shape))
                flat = where.reshape(-1) if rows is None else where.reshape(-1).index_select(0, rows)
                self.mask_rows = flat.nonzero().squeeze(1)
                if self.gate.delta is not None:
                    x = x + self.gate_columns * self.gate.delta.to(x.dtype)
        return x

    def _native_fits(self, x: torch.Tensor, cache) -> bool:
        """Whether this step is one the C++ pass takes: a step on the per-row cache (one row or several, each
        written at its own positions), fp32 without autograd."""
        return (
            getattr(cache, "write_positions", None) is not None
            and x.dtype == torch.float32
            and not torch.is_grad_enabled()
        )

    def __call__(self, input_ids, position_ids, attention_mask, cache=None) -> torch.Tensor:
        x = self._embed(input_ids)
        cos, sin = self.rotary(x, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        native = self._native_step() if self._native_fits(x, cache) else None
        if native is not None:
            keys, values = cache.step_buffers(x, self.kv_heads, self.head_dim)
            mask_rows = self.mask_rows if self.gate_columns is not None else None
            start, length = cache.single_row_start, cache.kv_length
            positions = cache.write_positions if start is None else None  # None: one row, one run (a copy)
            rows = computed_rows(tuple(x.shape[:2]))
            dense = rows is None and beyond_kernel(x.shape[0] * x.shape[1])  # wider than the kernel: F.linear
            cached = (keys, values, start or 0, length)
            return native.step(
                x, cos, sin, attention_mask, *cached, mask_rows, positions, rows, dense, attention_width()
            )
        batch, columns = input_ids.shape
        shape = (batch, columns, -1, self.head_dim)
        rotate = self._rotate_half
        for i, (norm1, attn, norm2, (qkv, o, gate_up, down)) in enumerate(self.layers):
            h = self._rms_norm(norm1, x)
            q, k, v = self._project_group(h, qkv)
            q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
            q = (q * cos) + (rotate(q) * sin)
            k = (k * cos) + (rotate(k) * sin)
            if cache is not None:
                k, v = cache.layers[i].update(k, v)
            a = attention(q, k, v, attention_mask, attn.scaling)
            a = a.transpose(1, 2).contiguous().reshape(batch, columns, -1).contiguous()
            x = x + self._project_group(a, o)[0]
            h = self._rms_norm(norm2, x)
            gate, up = self._project_group(h, gate_up)
            x = x + self._project_group(F.silu(gate) * up, down)[0]
        return self._rms_norm(self.norm, x)


def lean_decoder(model) -> LeanDecoder | None:
    reason = lean_reason(model)
    if reason is not None:
        log.info("lean decode forward not used (%s); the model's own forward runs", reason)
        return None
    return LeanDecoder(model)
