"""``tree=auto``: the draft tree with the most expected tokens per second on the device in use (Sequoia's idea,
Chen et al. 2024, over Medusa-style product trees).

Expected tokens of a step with ``k_d`` candidates at depth ``d``: ``1 + sum_d prod_{i<=d} a_i(k_i)``, where
``a_i(k)`` is the chance that the greedy token at depth ``i`` is among the top ``k`` candidates of the i-th mask
given that every earlier depth's was (the checkpoint's acceptance per depth and rank: ``draft_acceptance`` in its
``mars_config.json``, measured by teacher forcing on held-out prompts (:mod:`mars.calibration`), or :data:`PRIOR`).
Cost of the step: the forward's time at its width (the root plus the template's columns,
:func:`mars.decoding.tree.columns_of`), measured once per model and device on the model itself, relative to one
column.  On a CPU, where every column costs, this picks a small tree; on a GPU, where a step's extra columns are
nearly free, a wide one.

Only shapes that fit the engine's column cap (``max_step_columns``, one row's root and template) compete.  The
timing is made robust to a shared machine: every width is timed over several interleaved rounds and its fastest run
kept, timed again when a wider step came out clearly cheaper than a narrower one, and then read as a cost that never
falls with width (a running maximum: a wider step is never cheaper).  Shapes within :data:`NEAR_TIE` of the best
score count as tied, and the tie goes to the fewest columns; the choice is logged with the figures it came from.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch

from mars.calibration import ACCEPTANCE_RANKS, stored_acceptance_table

from .attention import mars_attention
from .forward import ModelRunner
from .kv import RaggedKVCache
from .settings import MAX_TREE_COLUMNS
from .tree import columns_of

log = logging.getLogger(__name__)

# a_d(k) for a checkpoint without a measured table: the masks of a MARS checkpoint trained briefly on a small
# model (first depth about one in two at rank 1); conservative, so a tree must pay for its columns clearly
PRIOR: tuple[tuple[float, ...], ...] = (
    (0.55, 0.66, 0.72, 0.75),
    (0.53, 0.62, 0.66, 0.68),
    (0.45, 0.52, 0.56, 0.58),
    (0.40, 0.46, 0.50, 0.52),
)
MAX_CANDIDATES = ACCEPTANCE_RANKS  # per depth: the ranks a checkpoint's acceptance table measures
MAX_COLUMNS = MAX_TREE_COLUMNS  # a step's columns after the root: beyond, the tree's columns outgrow any gain
# widths at which a step is timed; the cost between them is interpolated (a step's cost is close to linear between)
COST_GRID = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48)
NEAR_TIE = 0.03  # scores this close to the best are within the timing's noise: the fewest columns win
# a wider step timed this much cheaper than a narrower one is noise: the widths are timed again (at most RETIMES times)
FALLING = 0.05
RETIMES = 2

# model -> {(device, dtype): {width: seconds}} and {(device, dtype, depth, masks): shape}: measured once
_costs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_chosen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def expected_tokens(shape: Sequence[int], acceptance: Sequence[Sequence[float]]) -> float:
    total, reach = 1.0, 1.0
    for depth, k in enumerate(shape):
        row = acceptance[min(depth, len(acceptance) - 1)]
        reach *= row[min(k, len(row)) - 1]
        total += reach
    return total


@functools.cache
def candidate_shapes(max_depth: int, masks: str) -> list[tuple[int, ...]]:
    """Product trees up to ``max_depth`` deep with non-increasing candidates per depth that fit MAX_COLUMNS."""
    shapes = []
    for depth in range(1, max_depth + 1):
        for shape in itertools.product(range(MAX_CANDIDATES, 0, -1), repeat=depth):
            if list(shape) == sorted(shape, reverse=True) and columns_of(shape, masks) <= MAX_COLUMNS:
                shapes.append(shape)
    return shapes


def choose_shape(
    cost: Callable[[int], float],
    acceptance: Sequence[Sequence[float]],
    max_depth: int,
    masks: str,
    max_columns: int | None = None,
) -> tuple[tuple[int, ...] | None, dict]:
    """The shape with the most expected tokens per unit of step cost (``cost(width)``, relative) among those of at
    most ``max_columns`` columns after the root (None: any), the fewest columns among those within :data:`NEAR_TIE`
    of the best; and the scores.  None where no shape fits."""
    scores = {}
    for shape in candidate_shapes(max_depth, masks):
        if max_columns is None or columns_of(shape, masks) <= max_columns:
            scores[shape] = expected_tokens(shape, acceptance) / cost(1 + columns_of(shape, masks))
    if not scores:
        return None, scores
    top = max(scores.values())
    tied = [shape for shape, score in scores.items() if score >= top * (1 - NEAR_TIE)]
    return min(tied, key=lambda shape: (columns_of(shape, masks), -scores[shape])), scores


def smaller_shapes(
    shape: tuple[int, ...], masks: str, acceptance: Sequence[Sequence[float]] = PRIOR
) -> tuple[tuple[int, ...], ...]:
    """What a step shrinks ``shape`` to where a column cap cannot fit it, best first: the shapes inside it (no
    deeper, no more candidates at any depth) by expected tokens, each kept only if it takes fewer columns than every
    shape before it, down to a single candidate, ``(1,)``."""
    inside = {s for d in range(1, len(shape) + 1) for s in itertools.product(*(range(1, k + 1) for k in shape[:d]))}
    ranked = sorted(inside - {tuple(shape)}, key=lambda s: (-expected_tokens(s, acceptance), columns_of(s, masks), s))
    kept, fewest = [], columns_of(tuple(shape), masks)
    for s in ranked:
        if columns_of(s, masks) < fewest:
            kept.append(s)
            fewest = columns_of(s, masks)
    return tuple(kept)


def acceptance_of(model) -> list[list[float]]:
    """The acceptance per depth and rank ``model`` was measured with (``mars_draft_acceptance``), else :data:`PRIOR`."""
    return stored_acceptance_table(getattr(model, "mars_draft_acceptance", None)) or [list(row) for row in PRIOR]


def non_decreasing(costs: dict[int, float]) -> dict[int, float]:
    """Step costs per width read so that a wider step never costs less (the running maximum over widths): a wider
    step computes everything a narrower one does, so a lower time is the machine's noise, not the step's cost."""
    out, highest = {}, 0.0
    for width in sorted(costs):
        highest = max(highest, costs[width])
        out[width] = highest
    return out


def step_costs(runner: ModelRunner, mask_id: int, widths: Sequence[int], context: int = 128, rounds: int = 5) -> dict:
    """Seconds of one batch-1 decode step per width (the root plus ``width - 1`` masks after ``context`` cached
    tokens, through the engine's forward), measured once per model: ``rounds`` rounds over every width in turn after
    a warm-up round, the fastest of each width's (interleaving spreads a busy moment over all widths, and the fastest
    run is the step's own cost, what the noise of a shared CPU only adds to); timed again, up to :data:`RETIMES`
    times, while a wider step comes out more than :data:`FALLING` cheaper than a narrower one."""
    known = _costs.setdefault(runner.model, {}).setdefault(_placement(runner), {})
    wanted = sorted(set(widths) - set(known))
    if not wanted:
        return known
    dev = runner.device
    times: dict[int, list[float]] = {w: [] for w in wanted}
    with torch.inference_mode(), mars_attention(runner.model):
        cache = RaggedKVCache(runner.num_layers)
        cache.add_rows(1)
        ids = torch.arange(context, device=dev).view(1, -1) % max(2, min(runner.vocab_size, 1000))
        positions = torch.arange(context, device=dev).view(1, -1)
        _timed_step(runner, cache, ids, positions)  # the prompt: its keys/values are what a step attends to
        for attempt in range(RETIMES + 1):
            for round_ in range(rounds + (attempt == 0)):
                for width in wanted:
                    step_ids = torch.full((1, width), mask_id, device=dev)
                    step_ids[0, 0] = 1
                    step_positions = context + torch.arange(width, device=dev).view(1, -1)
                    seconds = _timed_step(runner, cache, step_ids, step_positions)
                    if attempt or round_:  # the first round warms every width up
                        times[width].append(seconds)
            if not _falls({**known, **{w: min(t) for w, t in times.items()}}):
                break
    known.update({w: min(t) for w, t in times.items()})
    return known


def _falls(costs: dict[int, float]) -> bool:
    """Whether a wider step was timed more than FALLING cheaper than a narrower one."""
    ordered = [costs[w] for w in sorted(costs)]
    return any(later < (1 - FALLING) * max(ordered[:i]) for i, later in enumerate(ordered) if i)


def _placement(runner: ModelRunner) -> tuple[str, str]:
    return str(runner.device), str(runner.model.dtype)


def _timed_step(runner: ModelRunner, cache: RaggedKVCache, ids: torch.Tensor, positions: torch.Tensor) -> float:
    width, kv_length = ids.shape[1], int(positions.max()) + 1
    attention = torch.arange(kv_length, device=ids.device).view(1, 1, -1) <= positions.unsqueeze(2)
    cache.prepare_step(positions, kv_length)
    columns = torch.arange(width, device=ids.device).view(1, -1)
    start = time.perf_counter()
    runner.logits_at(ids, positions, attention.unsqueeze(1), columns, cache, widths=(1, 1, 1))
    if ids.device.type == "cuda":
        torch.cuda.synchronize(ids.device)
    return time.perf_counter() - start


def auto_shape(
    runner: ModelRunner, mask_id: int, max_depth: int, masks: str, max_columns: int | None = None
) -> tuple[int, ...] | None:
    """``tree=auto`` for this model on its device (see the module docstring) among the shapes of at most
    ``max_columns`` columns after the root (None: any), chosen once per placement and cap; None where no tree fits."""
    key = (*_placement(runner), max_depth, masks, max_columns)
    chosen = _chosen.setdefault(runner.model, {})
    if key not in chosen:
        chosen[key] = _auto_shape(runner, mask_id, max_depth, masks, max_columns)
    return chosen[key]


def _auto_shape(
    runner: ModelRunner, mask_id: int, max_depth: int, masks: str, max_columns: int | None
) -> tuple[int, ...] | None:
    measured = stored_acceptance_table(getattr(runner.model, "mars_draft_acceptance", None))
    acceptance = measured or PRIOR
    fitting = [
        s for s in candidate_shapes(max_depth, masks) if max_columns is None or columns_of(s, masks) <= max_columns
    ]
    if not fitting:
        log.info("tree=auto: no tree fits %d columns after the root (max_step_columns): chains", max_columns)
        return None
    widest = 1 + max(columns_of(s, masks) for s in fitting)
    grid = [w for w in COST_GRID if w < widest] + [widest]
    costs = non_decreasing({w: c for w, c in step_costs(runner, mask_id, grid).items() if w <= widest})
    widths, seconds = sorted(costs), [costs[w] for w in sorted(costs)]

    def relative(width: int) -> float:
        return float(np.interp(width, widths, seconds)) / costs[1]

    best, scores = choose_shape(relative, acceptance, max_depth, masks, max_columns)
    width = 1 + columns_of(best, masks)
    runner_up = sorted(scores, key=scores.get, reverse=True)[:3]
    log.info(
        "tree=auto picks %s (%.2f expected tokens per step at %.2fx a one-column step, %d columns: %.3f per unit of "
        "cost; %s; acceptance %s; leading scores %s; step cost by width, relative to one column of %.2f ms: %s)",
        ",".join(map(str, best)),
        expected_tokens(best, acceptance),
        relative(width),
        width,
        scores[best],
        f"shapes of at most {max_columns} columns after the root (max_step_columns)" if max_columns else "no cap",
        "measured" if measured else "prior",
        ", ".join(f"{','.join(map(str, s))}: {scores[s]:.3f}" for s in runner_up),
        1000 * costs[1],
        ", ".join(f"{w}: {c / costs[1]:.2f}" for w, c in costs.items()),
    )
    return best
