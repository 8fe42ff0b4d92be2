"""What a timed run decodes with and where: the model (a named model or MARS checkpoint, or a random-weight model
with the real Qwen2.5 shapes), the process's threads and decode fast path, and the record of the machine it ran
on.  torch is imported inside the functions: importing this module loads no model library.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Mapping, Sequence
from typing import Any

ARCH_PRESETS: dict[str, dict[str, Any]] = {
    # Shapes of the released Qwen2.5-Instruct configs.
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}


def build_preset(preset: str, dtype: str, device: str):
    """A random-weight Qwen2.5 model of ``preset``'s shapes with the embedded tokenizer and a mask token (timing
    only; nothing downloads): (model, tokenizer, None)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from mars.models import _prepare_tokenizer, embedded_tokenizer, ensure_mask_token

    if preset not in ARCH_PRESETS:
        raise SystemExit(f"--arch-preset must be one of {sorted(ARCH_PRESETS)}, got {preset!r}")
    config = Qwen2Config(
        **ARCH_PRESETS[preset],
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):  # build in place: a 7B model in fp32 does not fit a small host
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    tokenizer = embedded_tokenizer()
    _prepare_tokenizer(tokenizer)
    ensure_mask_token(model, tokenizer)
    return model.eval(), tokenizer, None


def load(
    source: str, *, dtype: str, device: str = "cpu", arch_preset: str | None = None, adapter_rank: int | None = None
):
    """(model in eval mode, tokenizer, the checkpoint's metadata or None): ``arch_preset``'s random-weight model,
    else ``source`` (a model name, hub id or checkpoint folder, loaded as evaluation and serving load theirs), its
    gated adapter truncated to ``adapter_rank`` where given."""
    if arch_preset:
        return build_preset(arch_preset, dtype, device)
    from mars.decoding.loading import load_for_decoding

    loaded = load_for_decoding({"name_or_path": source}, dtype=dtype, device=device)
    if adapter_rank:
        from mars.adapters import truncate_adapter_rank

        kept = truncate_adapter_rank(loaded.model, adapter_rank)
        print(f"gated adapter truncated to rank {adapter_rank} (every product keeps >= {kept:.1%} of its energy)")
    return loaded.model.eval(), loaded.tokenizer, loaded.metadata


def apply_runtime(*, threads: int | None, device: str, dtype: str, fast_path: bool = True) -> str:
    """Before the model loads: torch's threads (``threads``; None or 0: ``$MARS_THREADS``, else every CPU), the
    fast-path switch (``fast_path=False``: ``MARS_FAST_PATH=0`` for the process); returns the dtype name ``dtype``
    (``auto`` among them) resolves to on ``device``."""
    from mars.decoding.fastpath import decode_dtype_name
    from mars.hardware import configure_threads

    try:
        configure_threads(threads or None)
    except ValueError as err:
        raise SystemExit(f"--threads: {err}") from err
    if not fast_path:
        os.environ["MARS_FAST_PATH"] = "0"
    return decode_dtype_name(dtype, device)


def fast_path_state(model) -> str:
    """``on``, or ``off (why)``: what the decode fast path did for this run (recorded with the figures)."""
    from mars.decoding import fastpath

    if not fastpath.enabled_by_env():
        return f"off ({fastpath.ENV}=0)"
    if next(model.parameters()).device.type != "cpu":
        return "off (not a CPU model)"
    reason = fastpath.unavailable_reason(model)
    return "on" if reason is None else f"off ({reason})"


def run_config(
    arguments: Mapping[str, Any],
    model,
    *,
    device: str,
    batch_sizes: Sequence[int],
    thresholds: Sequence[float],
    block_size: int | None,
) -> dict[str, Any]:
    """What the run was: ``arguments`` (a command's settings, by name), the machine, threads, dtype and fast-path
    state."""
    import torch

    from mars.decoding import huge_pages
    from mars.hardware import describe, describe_wait_policy

    return {
        **arguments,
        "hardware": describe(),
        "batch_sizes": list(batch_sizes),
        "thresholds": list(thresholds),
        "block_size": block_size,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": describe_wait_policy(),
        "fast_path": fast_path_state(model),
        "huge_pages": huge_pages.describe(),
        "host": platform.node(),
        "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
