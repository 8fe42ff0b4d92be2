"""vLLM model classes for a MARS gated adapter: the base model, plus the LoRA delta exactly where the input token
is the mask token (the gate of :mod:`mars.adapters`), so context columns compute the base model and mask columns
the trained adapter.

Loaded by vLLM for a folder that ``python -m mars.integrations.export`` wrote from a gated adapter (its
``config.json`` names ``MarsGatedLlamaForCausalLM`` or ``MarsGatedQwen2ForCausalLM``; the ``vllm`` extra's
plugin, :mod:`mars.integrations.vllm_plugin`, registers them).  The base weights load through vLLM's own
loader; ``mars_gated_lora.safetensors`` holds each adapted projection's factors ``A`` ``[r, in]`` and ``B``
``[out, r]`` (scaling folded in) and the mask token's input-embedding delta.

vLLM fuses projections (``qkv_proj`` = q, k, v; ``gate_up_proj`` = gate, up), so the factors of a fused module are
stacked: ``A`` along the rank, ``B`` block-diagonal, one product pair per fused module.  The gate is one
``[tokens, 1]`` buffer, written in place from ``input_ids`` at the start of every forward (outside the compiled
decoder) and read by every adapted projection, so a compiled graph reads the current step's gate instead of
baking one in.  Tensor parallelism is not covered (the factors would need sharding): a drafter beside a target
with ``tensor_parallel_size > 1`` is refused at load.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

LORA_PREFIX = "mars_gated_lora."
CONFIG_KEY = "mars_gated_lora"
# fused vLLM module -> the HF projections stacked in it, in output order
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "o_proj": ("o_proj",),
    "down_proj": ("down_proj",),
}
PARENT = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}


class GatedLoraLinear(nn.Module):
    """A vLLM linear layer plus ``gate * B (A x)``: its output tuple ``(out, bias)`` is kept."""

    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor, gate: torch.Tensor):
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(a, requires_grad=False)
        self.lora_b = nn.Parameter(b, requires_grad=False)
        self.register_buffer("gate", gate, persistent=False)

    def forward(self, x: torch.Tensor):
        out, bias = self.base(x)
        low = (x.to(self.lora_a.dtype) @ self.lora_a.t()) * self.gate[: x.shape[0]]
        return out + (low @ self.lora_b.t()).to(out.dtype), bias


class GatedEmbedding(nn.Module):
    """The input embedding plus ``gate * delta`` (the mask token's learned input-embedding delta)."""

    def __init__(self, base: nn.Module, delta: torch.Tensor, gate: torch.Tensor):
        super().__init__()
        self.base = base
        self.delta = nn.Parameter(delta, requires_grad=False)
        self.register_buffer("gate", gate, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.base(input_ids)
        return out + (self.gate[: input_ids.shape[0]] * self.delta).to(out.dtype)


def _block_diagonal(blocks: list[torch.Tensor]) -> torch.Tensor:
    return torch.block_diag(*blocks)


class _MarsGatedMixin:
    """The gate and the adapter for a vLLM causal LM whose decoder is ``self.model`` (Llama-shaped)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._init_gate(vllm_config)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        self._set_gate(input_ids)
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return self._load_with_adapter(weights, super().load_weights)

    def _init_gate(self, vllm_config: VllmConfig) -> None:
        config = vllm_config.model_config.hf_config
        record = getattr(config, CONFIG_KEY, None)
        if not record:
            raise ValueError(
                f"{vllm_config.model_config.model}: config.json has no {CONFIG_KEY!r} record; export the gated "
                "adapter with `python -m mars.integrations.export <adapter folder> <out>`"
            )
        tp = vllm_config.parallel_config.tensor_parallel_size
        if tp != 1:
            raise ValueError(
                f"the MARS gated drafter runs with tensor_parallel_size=1 only (got {tp}): export the adapter with "
                "--merge for a plain drafter, or serve the target at tensor_parallel_size=1"
            )
        self.mars_record = dict(record)
        self.mars_mask_token_id = int(config.mask_token_id)
        scheduler = vllm_config.scheduler_config
        spec = vllm_config.speculative_config
        slots = 1 + (spec.num_speculative_tokens or 0) * 2 if spec is not None else 1
        # the most tokens one forward carries: a full batch plus every request's bonus and mask slots
        capacity = int(scheduler.max_num_batched_tokens) + int(scheduler.max_num_seqs) * slots
        dtype = vllm_config.model_config.dtype
        self.register_buffer("mars_gate", torch.zeros(capacity, 1, dtype=dtype), persistent=False)

    def _set_gate(self, input_ids: torch.Tensor | None) -> None:
        if input_ids is None:
            raise ValueError("the MARS gated model needs input_ids (its gate reads the mask token's columns)")
        n = input_ids.shape[0]
        if n > self.mars_gate.shape[0]:
            raise ValueError(f"a forward of {n} tokens exceeds the gate's {self.mars_gate.shape[0]} slots")
        self.mars_gate[:n].copy_((input_ids == self.mars_mask_token_id).unsqueeze(-1).to(self.mars_gate.dtype))

    def _attach_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        decoder = self.model
        gate = self.mars_gate
        device = gate.device
        for layer in self.mars_record["layers"]:
            block = decoder.layers[layer]
            for fused, parts in FUSED.items():
                parent = getattr(block, PARENT[fused])
                base = getattr(parent, fused)
                present = [f"layers.{layer}.{p}.A" in tensors for p in parts]
                if not any(present):
                    continue
                sizes = _output_sizes(base, len(parts))
                a_blocks, b_blocks = [], []
                for part, size in zip(parts, sizes):
                    a = tensors.get(f"layers.{layer}.{part}.A")
                    b = tensors.get(f"layers.{layer}.{part}.B")
                    if a is None:  # a projection the adapter leaves alone inside a fused module
                        rank = self.mars_record["rank"]
                        a = torch.zeros(rank, base.input_size)
                        b = torch.zeros(size, rank)
                    if b.shape[0] != size or a.shape[1] != base.input_size:
                        raise ValueError(
                            f"layer {layer} {part}: adapter factors {tuple(b.shape)} x {tuple(a.shape)} do not fit "
                            f"the base projection ({size} x {base.input_size})"
                        )
                    a_blocks.append(a)
                    b_blocks.append(b)
                a = torch.cat(a_blocks, 0).to(device)
                b = _block_diagonal(b_blocks).to(device)
                setattr(parent, fused, GatedLoraLinear(base, a, b, gate))
        delta = tensors.get("mask_embedding_delta")
        if delta is not None:
            decoder.embed_tokens = GatedEmbedding(decoder.embed_tokens, delta.to(device), gate)

    def _load_with_adapter(self, weights: Iterable[tuple[str, torch.Tensor]], load) -> set[str]:
        adapter: dict[str, torch.Tensor] = {}

        def base_weights():
            for name, tensor in weights:
                if name.startswith(LORA_PREFIX):
                    adapter[name[len(LORA_PREFIX) :]] = tensor.float().clone()
                else:
                    yield name, tensor

        loaded = load(base_weights())
        if not adapter:
            raise ValueError(
                f"no {LORA_PREFIX}* tensors were found beside the base weights: the folder lacks "
                "mars_gated_lora.safetensors (export the gated adapter again)"
            )
        self._attach_adapter(adapter)
        # the loader checks that every parameter came from the checkpoint: the adapter's did, from its own file
        ours = {name for name, _ in self.named_parameters() if name.endswith((".lora_a", ".lora_b", ".delta"))}
        return set(loaded) | ours


def _output_sizes(base: nn.Module, parts: int) -> list[int]:
    sizes = getattr(base, "output_sizes", None)
    if sizes is not None and len(sizes) == parts:
        return [int(s) for s in sizes]
    if parts == 3:  # QKVParallelLinear: q, then k and v
        q = base.num_heads * base.head_size
        kv = base.num_kv_heads * base.head_size
        return [q, kv, kv]
    return [int(base.output_size)]


class MarsGatedLlamaForCausalLM(_MarsGatedMixin, LlamaForCausalLM):
    """Llama with the MARS gated adapter (the embedded SmolLM2)."""


class MarsGatedQwen2ForCausalLM(_MarsGatedMixin, Qwen2ForCausalLM):
    """Qwen2 with the MARS gated adapter."""
