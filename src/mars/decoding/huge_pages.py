"""A CPU model's weights moved into one buffer of 2 MB pages (Linux transparent huge pages) for decoding.

A batch-1 decode step streams every weight from memory.  With 4 KB pages each step's 540 MB (SmolLM2-135M,
fp32) cross about 135,000 pages, and on a KVM guest every TLB miss walks two page tables.  In 2 MB pages a step
takes a few percent less time, with the same tokens.  Most of a small model's tensors are under 2 MB, so pages of
their own would not do: they share one buffer here, each tensor keeping its own storage (so nothing looks shared
to safetensors or to ``save_pretrained``).

Values, dtypes, devices and parameter objects stay the same (``param.data`` is swapped), so outputs are the same
bits and optimisers and tied weights are unaffected.  It costs, once per model, what the kernel takes to zero (and
compact for) the 2 MB pages at first touch, less than loading the model takes.  ``MARS_HUGE_PAGES=0`` turns it
off; it is a no-op where transparent huge pages are off or absent (other systems, ``never``) and for models not on
a CPU.
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .fastpath import enabled_by_env

log = logging.getLogger(__name__)

ENV = "MARS_HUGE_PAGES"
HUGE_PAGE = 2 << 20
ALIGN = 4096  # each tensor starts on a page of its own (and on a 64-byte line for the kernel's vector loads)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_placed: WeakIdKeyDictionary = WeakIdKeyDictionary()  # model -> bytes it has in huge pages


def transparent_huge_pages() -> str | None:
    """This system's THP mode (``always``, ``madvise`` or ``never``), None where there is none to ask."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else None


def available() -> bool:
    """Whether a buffer here can ask for huge pages: Linux with THP ``always`` or ``madvise``."""
    return hasattr(mmap, "MADV_HUGEPAGE") and transparent_huge_pages() in ("always", "madvise")


def wanted() -> bool:
    """Whether decoding places its weights in huge pages here: on (``MARS_HUGE_PAGES``) and available."""
    return enabled_by_env(ENV) and available()


def describe() -> str:
    """Whether decoding places weights in huge pages here, for run records."""
    if not enabled_by_env(ENV):
        return f"off ({ENV}=0)"
    mode = transparent_huge_pages()
    return f"on (THP {mode})" if available() else f"unavailable (THP {mode or 'absent'})"


def place_weights(model: torch.nn.Module) -> int:
    """Move ``model``'s CPU parameters into one huge-page buffer, once per model; the bytes placed (0 where off,
    unavailable, or nothing on a CPU).  Safe to call before every decode: later calls return at once."""
    if model in _placed:
        return _placed[model]
    placed = 0
    if wanted() and not _distributed():
        params = [p for p in _unique(model.parameters()) if _movable(p)]
        if params:
            placed = place_tensors(params)
            log.info("decoding weights in 2 MB pages: %.0f MB (%s=0 turns this off)", placed / 1e6, ENV)
    _placed[model] = placed
    return placed


def _distributed() -> bool:
    # a sharded or replicated model's wrappers keep their own views of its parameters: left where they are
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _movable(p: torch.Tensor) -> bool:
    """A plain CPU tensor that is its whole storage (not a view into another, not a DTensor or a subclass)."""
    storage = p.untyped_storage()
    whole = p.data_ptr() == storage.data_ptr() and storage.nbytes() == p.numel() * p.element_size()
    return type(p.data) is torch.Tensor and p.device.type == "cpu" and p.numel() > 0 and whole and p.is_contiguous()


def _unique(params) -> list[torch.nn.Parameter]:
    return list({id(p): p for p in params}.values())  # a tied weight is one parameter: moved once


def place_tensors(params: list[torch.Tensor]) -> int:
    """Move ``params`` (parameters or plain tensors, each once) into one new huge-page buffer, in order, each on a
    4 KB page of its own, by swapping their ``.data``; the buffer's bytes."""
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
    buffer = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:  # before the first touch: the copies fault the pages in as 2 MB ones
        buffer.madvise(mmap.MADV_HUGEPAGE)
    except OSError as err:  # a kernel built without THP: the same buffer in 4 KB pages
        log.info("no huge pages for the decoding weights: %s", err)
    start = -torch.frombuffer(buffer, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    with torch.no_grad():
        for p, offset in zip(params, offsets):
            # a storage of its own over its part of the buffer; the tensors keep the buffer alive
            home = torch.frombuffer(buffer, dtype=p.dtype, count=p.numel(), offset=start + offset)
            p.data = home.view(p.shape).copy_(p.data)
    return total
