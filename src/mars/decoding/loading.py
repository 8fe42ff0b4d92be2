"""The model a run's config names, loaded to decode with: one loader for evaluation, serving and the benchmarks.

A config names its model in two keys: ``model`` (a ``conf/model/`` entry: ``name_or_path``, the ``tiny`` shape
of ``tiny-random``, ``mask_token``, ``allow_new_embedding_row``, ``attn_implementation``) and ``checkpoint``
(a ``train.py`` export or gated adapter folder, which takes the place of ``model.name_or_path``).  It lives on
the decoding floor because the dtype it loads in is the decoding one (:func:`~mars.decoding.fastpath.decode_dtype_name`:
``auto`` is float32 where the CPU fast path runs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def load_for_decoding(
    model: Mapping[str, Any],
    *,
    checkpoint: str | None = None,
    checkpoint_meta: Mapping[str, Any] | None = None,
    dtype: str | None = "auto",
    device: str | None = "auto",
):
    """:class:`~mars.models.LoadedModel` of ``checkpoint`` (else ``model["name_or_path"]``, with its ``tiny``
    shape) on ``device`` (``auto``: cuda when a GPU is visible) in ``dtype``'s decoding dtype, with the mask
    token the checkpoint was trained with (``checkpoint_meta``, as the config check read it), else the model
    config's."""
    from mars.hardware import resolve_device
    from mars.models import load_model

    from .fastpath import decode_dtype_name

    where = resolve_device(device)
    mask_token = (checkpoint_meta or {}).get("mask_token") or model.get("mask_token")
    return load_model(
        str(checkpoint or model["name_or_path"]),
        tiny=None if checkpoint else model.get("tiny"),
        mask_token=mask_token,
        allow_new_row=bool(model.get("allow_new_embedding_row", False)),
        dtype=decode_dtype_name(dtype, where),
        attn_implementation=model.get("attn_implementation") or "sdpa",
        device=where,
    )
