"""MARS checkpoints in the engines users deploy: ``transformers``' ``generate`` (``custom_generate``) and vLLM
(a parallel drafter, with an out-of-tree model for gated adapters).

* :mod:`mars.integrations.hf_generate`: the ``custom_generate/generate.py`` every export carries.
* :mod:`mars.integrations.export`: ``python -m mars.integrations.export CHECKPOINT OUT``.
* :mod:`mars.integrations.vllm_plugin` / :mod:`mars.integrations.vllm_gated`: the vLLM plugin (extra ``vllm``).
"""
