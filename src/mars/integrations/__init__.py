"""MARS checkpoints in the engines users deploy: ``transformers``' ``generate`` (``custom_generate``) and vLLM
(a parallel drafter, with an out-of-tree model for gated adapters).

* ``custom_generate``: :mod:`mars.hf_generate`, the decoder every export carries as ``custom_generate/generate.py``
  (below this package: training's export writes it too, through :mod:`mars.custom_generate_files`).
* :mod:`mars.integrations.export`: ``python -m mars.integrations.export CHECKPOINT OUT``.
* :mod:`mars.integrations.vllm_plugin` / :mod:`mars.integrations.vllm_gated`: the vLLM plugin (extra ``vllm``).
"""
