"""The decode-time fast path for ``nn.Linear``: small-M fp32 GEMMs on the CPU through ``mars::small_linear``.

At batch 1 a decode step multiplies 1-8 columns by every weight matrix once; on a CPU that step is bound
by reading the weights (SmolLM2-135M: 540 MB of fp32), and MKL's sgemm, tuned for large M, turns
compute-bound from about four columns.
:func:`fast_linear` routes every fp32 CPU ``nn.Linear`` of a model through the streaming kernel of
:mod:`mars.decoding.kernels` while a decode step (or ``transformers`` ``generate`` for the AR baseline) runs, and
restores the modules afterwards; inputs with more than :data:`MAX_COLUMNS` columns (prefill of long prompts,
big batches; a decode step's drafts and masks do not count where its rows must match AR's, see
:func:`step_width`), gradients, other dtypes and other devices take ``F.linear``.

The kernel's summation order does not depend on the number of columns, so a row's output is the same
whether it rides alone or with masks and other rows (batch invariance); it differs from MKL's by float
rounding only (greedy outputs are unchanged on the equivalence tests).

Its attention (:func:`attention`) goes through ``mars::decode_attention``, a kernel for a decode step's few
query columns and for prefills with the same column invariance; :mod:`mars.decoding.attention` routes the
model's own attention to it inside a :func:`fast_linear` block, and the lean forward calls it directly.

Off switch: ``MARS_FAST_PATH=0`` in the environment (or ``fast_linear(model, enabled=False)``).  Where the
kernel cannot run (no compiler, no AVX2, not x86-64, a model without fp32 CPU linears) decoding warns
once, naming why, and runs the eager path with the same outputs.
"""

from __future__ import annotations

import contextvars
import logging
import os
import warnings
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

log = logging.getLogger(__name__)

ENV = "MARS_FAST_PATH"


def _max_columns() -> int:
    """Largest number of columns (rows of the flattened input) the kernel takes; above it F.linear (MKL). The
    AVX2 build falls behind MKL between 16 and 32 columns; the AVX-512 build's larger tiles stay ahead of MKL up
    to 64 columns at least."""
    from mars.decoding.kernels import KernelUnavailable, kernel_isa

    try:
        return 64 if kernel_isa() == "avx512" else 16
    except KernelUnavailable:  # a bad MARS_KERNEL_ISA: refused where the kernel is built, with its message
        return 16


MAX_COLUMNS = _max_columns()
# Rows one pass of the kernel takes at most whatever the step's width (small_gemm.cpp's kMaxColumns: the columns
# a gated LoRA acts at), beyond which F.linear runs
MAX_KERNEL_ROWS = 1024
_warned: set[str] = set()
# Inside a `fast_linear` block that patched the model: its attention takes mars::decode_attention too (see
# `attention`), so the model's own forward and the lean forward agree bit for bit.
_attention_on: contextvars.ContextVar[bool] = contextvars.ContextVar("mars_fast_attention", default=False)
# The input columns whose outputs the current step reads (see `only_columns`); None: all of them.
_live: contextvars.ContextVar[tuple[tuple[int, ...], torch.Tensor] | None] = contextvars.ContextVar(
    "mars_live_columns", default=None
)
# The current step's width against MAX_COLUMNS, where its caller decides it (see `step_width`); None: the rows.
_width: contextvars.ContextVar[int | None] = contextvars.ContextVar("mars_step_width", default=None)
# The current step's queries per row against the attention kernel's width (see `step_width`); None: its columns.
_queries: contextvars.ContextVar[int | None] = contextvars.ContextVar("mars_step_queries", default=None)


def enabled_by_env(name: str = ENV) -> bool:
    """The on/off switch ``name`` in the environment (on when unset); other values are refused."""
    value = os.environ.get(name, "1").strip().lower()
    if value in ("1", "on", "true", "yes", "auto", ""):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{name}={value!r}: use 1/on or 0/off")


def _cpu_linears(model: torch.nn.Module):
    # Exactly nn.Linear: subclasses (quantized, LoRA, ...) compute something else in their forward.
    return (m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.device.type == "cpu")


def unavailable_reason(model: torch.nn.Module) -> str | None:
    """Why the fast path cannot serve ``model`` here, or None when it can (asked before every generate: the
    walk stops at the first float32 linear)."""
    linears = _cpu_linears(model)
    first = next(linears, None)
    if first is None:
        return None if next(model.parameters()).device.type != "cpu" else "the model has no nn.Linear layers"
    if first.weight.dtype != torch.float32 and not any(m.weight.dtype == torch.float32 for m in linears):
        return f"its linear weights are {first.weight.dtype}; the small-M kernel is float32-only"
    from mars.decoding.kernels import KernelUnavailable, small_linear_op

    try:
        small_linear_op()
    except KernelUnavailable as err:
        return str(err)
    return None


def decode_dtype_name(name: str | None, device: object = "cpu") -> str:
    """The dtype a model loaded for decoding gets: as :func:`mars.hardware.resolve_dtype_name`, except that
    ``auto`` on a CPU whose fast path can run (on, x86-64 with AVX2+FMA, a compiler or a finished build) is
    float32 even where bf16 is native: at batch 1 the fp32 fast path decodes faster than eager bf16, and fp32
    is what the quality figures are measured in.  Training keeps bf16 there (``mars.training.precision``)."""
    from mars.decoding import kernels
    from mars.hardware import device_type, resolve_dtype_name, validate_dtype

    auto_on_cpu = validate_dtype(name) == "auto" and device_type(device) == "cpu"
    if auto_on_cpu and enabled_by_env() and kernels.can_run_here():
        return "float32"
    return resolve_dtype_name(name, device)


def usable(model: torch.nn.Module) -> bool:
    """Whether the kernel can serve ``model`` (a CPU model with fp32 linears, the kernel built here); when
    not, warns once naming why.  Walks the model's modules: callers decoding many steps keep the answer."""
    if next(model.parameters()).device.type != "cpu":
        return False
    reason = unavailable_reason(model)
    if reason is not None:
        _warn_once(reason)
    return reason is None


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"decoding fast path off, eager matmuls instead: {reason}", RuntimeWarning, stacklevel=3)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through the kernel where it applies (fp32, no autograd, at most :data:`MAX_COLUMNS` columns,
    or only the live columns of an :func:`only_columns` block); ``F.linear`` otherwise."""
    if not kernel_takes(x, weight):
        return F.linear(x, weight, bias)
    from mars.decoding.kernels import small_linear_op

    return _at_live_rows(small_linear_op(), x, weight, bias)


def down_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A LoRA down factor's ``F.linear(x, weight)`` through the kernel at any width (the fused pass computes it
    there; a factor's few rows cost little at any width), so that a step wider than the kernel takes still gets
    the fused pass's bits at mask columns; ``F.linear`` where the kernel does not take it (autograd, dtypes)."""
    if not kernel_takes(x, weight):
        return F.linear(x, weight)
    from mars.decoding.kernels import small_linear_op

    return _at_live_rows(small_linear_op(), x, weight, None, any_width=True)


def lowrank_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A LoRA up factor's ``F.linear(x, weight)`` through the kernel at any width, in the order the fused pass
    (:func:`fused_linears`) adds the low-rank term, so that the two agree bit for bit."""
    if not kernel_takes(x, weight):
        return F.linear(x, weight)
    from mars.decoding.kernels import lowrank_linear_op

    op, packed = lowrank_linear_op(), packed_lowrank(weight)
    return _at_live_rows(lambda x, w, _: op(x, packed, w.shape[0]), x, weight, None, any_width=True)


def attention_on() -> bool:
    """Whether a :func:`fast_linear` block is serving the current forward (its attention goes through
    :func:`attention`)."""
    return _attention_on.get()


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float):
    """``F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)`` (not causal; grouped KV
    heads read in place), through ``mars::decode_attention`` for fp32 CPU inputs without autograd: its kernel takes
    a decode step's few query columns (where it is faster than SDPA's flash kernel) and prefills of up to 1024
    queries per row, counted as :func:`step_width` says, and hands anything else to SDPA.  A column's output does not
    depend on the other columns of the step (see ``decode_attention.cpp``), which SDPA's does not guarantee."""
    if query.device.type == "cpu" and kernel_takes(query, key):
        from mars.decoding.kernels import decode_attention_op

        return decode_attention_op()(query, key, value, mask, scale, _queries.get())
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
    )


# LoRA up factors packed for the kernel, by factor: packing one costs about as much as its product at 4 columns
_packed: WeakIdKeyDictionary = WeakIdKeyDictionary()
# LoRA factors as the kernel streams them (see `streamed_factor`), by factor
_streamed: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Off switch for streaming bf16-valued LoRA factors as bf16; the results are the same either way.
BF16_FACTORS_ENV = "MARS_BF16_FACTORS"


def _kept(cache: WeakIdKeyDictionary, weight: torch.Tensor, make) -> torch.Tensor:
    """``make(weight)``, computed once and kept while ``weight`` lives unchanged (an in-place update or new
    storage computes it again)."""
    stamp = (weight._version, weight.data_ptr())
    hit = cache.get(weight)
    if hit is None or hit[0] != stamp:
        hit = (stamp, make(weight.detach()))
        cache[weight] = hit
    return hit[1]


def _as_streamed(weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype != torch.float32 or not enabled_by_env(BF16_FACTORS_ENV):
        return weight
    narrow = weight.to(torch.bfloat16)
    return narrow if torch.equal(narrow.to(torch.float32), weight) else weight


def streamed_factor(weight: torch.Tensor) -> torch.Tensor:
    """A LoRA factor as the kernel streams it: in bfloat16 when every value is a bf16 number (an adapter trained
    or saved in bf16 and loaded into an fp32 model), half the bytes to read at every mask step, else as it is.
    A bf16 widens to fp32 exactly, so the kernel's products are the same bits either way."""
    return _kept(_streamed, weight, _as_streamed)


def packed_lowrank(weight: torch.Tensor) -> torch.Tensor:
    """A LoRA up factor [N, r] in the layout the kernel reads (``mars::pack_lowrank``), in the dtype it streams
    (:func:`streamed_factor`), packed once and kept while the factor lives unchanged."""
    from mars.decoding.kernels import pack_lowrank_op

    return _kept(_packed, weight, lambda _: pack_lowrank_op()(streamed_factor(weight)))


def kernel_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and weight.dtype == torch.float32 and not torch.is_grad_enabled()


def _at_live_rows(
    op, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, any_width: bool = False
) -> torch.Tensor:
    """``op(x, weight, bias)`` on the live rows of an :func:`only_columns` block (zeros elsewhere), on all rows
    up to :data:`MAX_COLUMNS` (``any_width``: at any number), else ``F.linear``."""
    n, k = weight.shape
    index = computed_rows(tuple(x.shape[:-1]))
    if index is not None:
        y = x.new_zeros((*x.shape[:-1], n))
        y.view(-1, n).index_copy_(0, index, op(x.reshape(-1, k).index_select(0, index), weight, bias))
        return y
    if any_width or not beyond_kernel(x.numel() // k):
        return op(x, weight, bias)
    return F.linear(x, weight, bias)


def beyond_kernel(rows: int) -> bool:
    """Whether an input of ``rows`` flattened rows goes to ``F.linear`` rather than the kernel: the step's width
    (:func:`step_width`; else ``rows``) above :data:`MAX_COLUMNS`, or ``rows`` above :data:`MAX_KERNEL_ROWS`."""
    width = _width.get()
    return (rows if width is None else width) > MAX_COLUMNS or rows > MAX_KERNEL_ROWS


@contextmanager
def step_width(width: int | None, queries: int | None = None):
    """Inside this block a step's projections leave the kernel for ``F.linear`` by ``width`` (None: by their rows),
    and its attention leaves ``mars::decode_attention``'s kernel for SDPA by ``queries`` per row (None: by its
    columns; :func:`attention_width`).
    Where rows must match AR bit for bit (lossless verify, threshold 1.0) the decode engine counts them as AR's step
    for them would, by their new real tokens, so that their drafts and masks never push a step past the kernel's
    width that AR's step for the same rows stays within (lossy rows beside them count every column).
    Counted by rows, a prompt one or two tokens under the width would take the kernel in AR's prefill and MKL
    with verify's two masks, and a batch of 8 verify steps of 3 columns MKL on an AVX2 build (16 columns) where
    8 AR steps of one take the kernel: different bits (tested)."""
    token, queries_token = _width.set(width), _queries.set(queries)
    try:
        yield
    finally:
        _width.reset(token)
        _queries.reset(queries_token)


def attention_width() -> int | None:
    """The queries per row that send the current step's attention from the kernel to SDPA (:func:`step_width`)."""
    return _queries.get()


def computed_rows(shape: tuple[int, ...]) -> torch.Tensor | None:
    """The flattened input rows the kernel computes for an input of leading shape ``shape`` inside an
    :func:`only_columns` block (the live columns), or None when it computes all of them."""
    live = _live.get()
    if live is not None and tuple(shape) == live[0] and not beyond_kernel(live[1].numel()):
        return live[1]
    return None


def fused_linears(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    lora: tuple[list, list, list[float]] | None = None,
    columns: torch.Tensor | None = None,
) -> list[torch.Tensor] | None:
    """``[F.linear(x, w, b) for w, b in zip(weights, biases)]`` in one pass of the kernel; with ``lora``
    (``(A factors, B factors packed by pack_lowrank, scalings)``, None entries for weights without an adapter)
    each adapted output also gets ``(B (A x)) * scaling`` at the flattened rows ``columns`` (of the rows
    computed, see :func:`computed_rows`) -- a gated LoRA at mask columns.  Bit-identical to the separate calls
    (:func:`linear` for the weights, :func:`down_linear` and :func:`lowrank_linear` for the factors).

    None where the kernel does not apply (autograd, other dtypes, more than :data:`MAX_COLUMNS` rows):
    the caller then runs the linears one by one."""
    if x.dtype != torch.float32 or torch.is_grad_enabled() or any(w.dtype != torch.float32 for w in weights):
        return None
    from mars.decoding.kernels import fused_linear_op

    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    rows = computed_rows(lead)
    flat = x.reshape(-1, k)
    if rows is None and beyond_kernel(flat.shape[0]):
        return None
    a, b, scalings = lora if lora is not None else ([], [], [])
    outputs = fused_linear_op()(
        flat if rows is None else flat.index_select(0, rows), weights, biases, a, b, scalings, columns
    )
    if rows is None:
        return [y.view(*lead, y.shape[-1]) for y in outputs]
    full = []
    for y in outputs:
        z = y.new_zeros((flat.shape[0], y.shape[-1]))
        z.index_copy_(0, rows, y)
        full.append(z.view(*lead, y.shape[-1]))
    return full


def _fast_forward(module: torch.nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x, module.weight, module.bias)

    return forward


def _factor_forward(module: torch.nn.Linear, product):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return product(x, module.weight)

    return forward


def _fast_forwards(model: torch.nn.Module) -> list[tuple[torch.nn.Linear, object]]:
    """Each fp32 CPU ``nn.Linear`` of ``model`` not patched yet, with its fast forward: LoRA factors (peft's
    ``lora_A``/``lora_B`` linears) through the kernel at any width, the up factors in the fused pass's order
    (:func:`down_linear`, :func:`lowrank_linear`), so the two agree bit for bit.  One walk over the modules (a
    parent comes before its children, so its factors are known when they come)."""
    factors: dict[int, object] = {}
    plan = []
    for m in model.modules():
        for name, product in (("lora_A", down_linear), ("lora_B", lowrank_linear)):
            held = m._modules.get(name)
            if isinstance(held, torch.nn.ModuleDict):
                factors.update((id(f), product) for f in held.values())
        if type(m) is not torch.nn.Linear or "forward" in m.__dict__:
            continue  # not exactly nn.Linear, or already patched by an outer block
        if m.weight.device.type != "cpu" or m.weight.dtype != torch.float32:
            continue
        product = factors.get(id(m)) if m.bias is None else None
        plan.append((m, _fast_forward(m) if product is None else _factor_forward(m, product)))
    return plan


@contextmanager
def only_columns(live: torch.Tensor | None):
    """Inside this block the fast path computes the linear layers only at the input columns where
    ``live`` (``[batch, columns]``, bool) is True, for inputs of exactly that shape; the others get zeros.

    A batched decode step pads every row to the longest row's columns; a row at threshold 1.0 beside
    rows with masks needs one prediction, and its padding columns feed nothing it reads (causal
    attention: a column only sees earlier ones), so their matmuls are skipped.  Because the kernel's
    result for a column does not depend on the other columns, the live columns' outputs are exactly
    what they would be with the padding computed."""
    if live is None or bool(live.all()):
        yield
        return
    token = _live.set((tuple(live.shape), live.reshape(-1).nonzero().squeeze(1)))
    try:
        yield
    finally:
        _live.reset(token)


@contextmanager
def fast_linear(model: torch.nn.Module, enabled: bool | None = None):
    """Run ``model``'s fp32 CPU ``nn.Linear`` layers through the small-M kernel inside this block.

    Re-entrant (an inner block over the same model changes nothing) and exception-safe (the modules'
    own ``forward`` comes back however the block ends).  CUDA models pass through untouched."""
    if enabled is None:
        enabled = enabled_by_env()
    if not enabled:
        yield False
        return
    if not usable(model):
        yield False
        return
    patched = []
    for m, forward in _fast_forwards(model):
        m.forward = forward
        patched.append(m)
    token = _attention_on.set(True)
    try:
        yield True
    finally:
        _attention_on.reset(token)
        for m in patched:
            m.__dict__.pop("forward", None)
