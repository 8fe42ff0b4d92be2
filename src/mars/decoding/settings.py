"""One validated object for every decoding setting.

``generate``'s keywords, the decoding engine, ``conf/decoding/*.yaml``, the lm-eval adapter and the
server all go through :class:`DecodingSettings`, so each rule (what a threshold may be, which cache a
window needs, what verification excludes) is written once.  No torch import: evaluation configs are
checked with it before torch or a model loads.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DECODERS = ("mars", "ar", "jacobi")
CACHES = ("none", "block", "cursor")
METRICS = ("probability", "entropy", "margin")
FALLBACKS = ("none", "jacobi")
CHAINING = ("auto", "always", "never")
VERIFY_MASKS = ("auto", "all")  # or an integer
LEAN_VERIFY_MASKS = 2  # verify_masks=auto for lossless rows on a CPU (see the field)
DRAFT_SOURCES = ("masks", "model", "lookup")
TREE_MODES = ("auto", "chain")  # or a shape: candidates per depth, "2,1"
TREE_MASKS = ("all", "top")
# A tree's columns per row (its nodes and their mask groups) at most: every column is a query of the step and a
# slot of the KV buffer, and past this a tree's columns outgrow anything its deeper candidates could add
MAX_TREE_COLUMNS = 64
MAX_TREE_DEPTH = 8
_TREE_SPEC = re.compile(r"[0-9]+(?:[,x][0-9]+)*")  # ASCII digit groups joined by ',' or 'x'
AR_CACHES = ("dynamic", "static")
# Keys of a decoding config that are not decoding settings: the config's name and the batch size
# (which changes timings, never outputs).
CONFIG_ONLY_KEYS = ("name", "batch_size")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_metric(metric: Any) -> str:
    if metric not in METRICS:
        raise ValueError(f"unknown acceptance metric {metric!r}; choose one of {list(METRICS)}")
    return metric


def reference_threshold(metric: str) -> float:
    """The threshold at which MARS decoding is exactly greedy AR decoding (1.0; 0 nats for entropy)."""
    return 0.0 if metric == "entropy" else 1.0


def validate_threshold(threshold: Any, metric: str = "probability") -> float:
    """A threshold for ``metric``: (0, 1] for probability/margin, >= 0 nats for entropy."""
    validate_metric(metric)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or math.isnan(float(threshold)):
        raise ValueError(f"threshold must be a number, got {threshold!r}")
    value = float(threshold)
    if metric == "entropy":
        if not value >= 0:
            raise ValueError(f"threshold {threshold!r} is invalid for metric 'entropy': it must be >= 0 (nats)")
    elif not 0 < value <= 1:
        raise ValueError(f"threshold {threshold!r} is invalid for metric {metric!r}: it must lie in (0, 1]")
    return value


def is_exact_threshold(threshold: float, metric: str) -> bool:
    """Whether ``threshold`` means "accept only certain tokens", i.e. exactly greedy AR."""
    return threshold <= 0 if metric == "entropy" else threshold >= 1.0


def _help(text: str, choices: tuple[str, ...] | None = None, per_request: bool = False) -> dict[str, Any]:
    """A field's metadata, the one place its help text, allowed values and reach are declared: the CLI
    flags (``mars.cli.options``) and the server's per-request options (``mars.serving.schemas``) are
    derived from it.  ``per_request``: a client may set it on one request (the server's settings give the
    default)."""
    return {"help": text, "choices": choices, "per_request": per_request}


@dataclass(frozen=True)
class DecodingSettings:
    """How to decode; every field is validated on construction (see each field's ``help``)."""

    decoder: str = field(
        default="mars",
        metadata=_help(
            "mars (multi-token), ar (transformers generate with its KV cache) or jacobi (training-free baseline)",
            DECODERS,
        ),
    )
    block_size: int = field(default=4, metadata=_help("MARS block size B: predictions per step by default"))
    threshold: float = field(
        default=1.0,
        metadata=_help(
            "accept left to right while the confidence meets it; 1.0 (0 for entropy) is exactly greedy AR",
            per_request=True,
        ),
    )
    metric: str = field(
        default="probability",
        metadata=_help(
            "probability (>= threshold), entropy (<= threshold nats) or margin (top1 - top2 >= threshold)", METRICS
        ),
    )
    max_new_tokens: int = field(default=256, metadata=_help("generated tokens per row at most", per_request=True))
    cache: str = field(
        default="cursor",
        metadata=_help(
            "none (full forward per step), block (the paper's block-level cache), cursor (per-row KV cursor)", CACHES
        ),
    )
    cache_block: int = field(default=32, metadata=_help("Bcache of cache=block"))
    window: int | str | None = field(
        default=None,
        metadata=_help("predictions per step: None (= block_size), an integer, or 'cache_block' (cache=block only)"),
    )
    max_accept: int | None = field(default=None, metadata=_help("cap on tokens accepted per step"))
    temperature: float = field(default=0.0, metadata=_help("0 is greedy; > 0 samples", per_request=True))
    seed: int | None = field(default=None, metadata=_help("random seed of sampling", per_request=True))
    verify: bool = field(
        default=False,
        metadata=_help(
            "self-speculation: the masks' predictions are drafts verified by the next forward; at threshold 1.0 "
            "lossless (output identical to greedy AR, exact sampling at temperature > 0); below it the masks after "
            "drafts that all passed are also accepted while they meet the threshold (unverified)",
            per_request=True,
        ),
    )
    draft_length: int | None = field(
        default=None,
        metadata=_help(
            "drafts verified per step with verify=True (default: window - 1 with draft_source=masks, else block_size)"
        ),
    )
    # 0.15: drafts down to this confidence still pass often enough to pay for the column each one costs
    draft_threshold: float = field(
        default=0.15,
        metadata=_help(
            "verify=True: propose a draft only while the mask's top probability is >= this (0: always); "
            "never changes the output, only how many columns a step spends on drafts"
        ),
    )
    fallback: str = field(
        default="none",
        metadata=_help(
            "verify=True, after a rejected draft: none (the next step drafts from its masks) or jacobi "
            "(the unverified AR predictions become the next drafts)",
            FALLBACKS,
        ),
    )
    # auto: on a CPU every column costs and masks after drafts pay only when all drafts pass, so lossless rows
    # drop them there; elsewhere they ride along
    chain_drafts: str = field(
        default="auto",
        metadata=_help(
            "verify=True: whether masks ride after a step's drafts (their predictions are the next step's drafts "
            "when every draft passes): always; never (masks only on steps without drafts: where every column "
            "costs, as on a CPU, the masks after drafts rarely pay, since they need all drafts to pass); auto "
            "(never for lossless rows on a CPU, else always: a row below threshold 1.0 also accepts those masks "
            "unverified, and on accelerators extra columns are nearly free)",
            CHAINING,
        ),
    )
    # auto: on a CPU lossless rows feed at most LEAN_VERIFY_MASKS masks, since a deeper mask's draft rarely
    # passes while its column costs as much as any other
    verify_masks: int | str = field(
        default="auto",
        metadata=_help(
            "verify=True: masks a verifying row feeds per step, i.e. the most drafts its next step can verify: an "
            "integer (at most window - 1), all (window - 1) or auto (window - 1, but at most "
            f"{LEAN_VERIFY_MASKS} for lossless rows on a CPU: there every column costs "
            "about 5% of a step and the deepest drafts rarely pass)"
        ),
    )
    tree: str = field(
        default="auto",
        metadata=_help(
            "verify=True, draft_source=masks: the draft layout. chain: the drafts in a row, masks after them only when "
            "every draft may pass (chain_drafts, verify_masks); a shape 'k1,k2,...' (or 'k1xk2', or a tuple of "
            "integers): a tree of the top-k1 candidates of the first mask, each followed by the top-k2 of the second, "
            "..., verified in one forward, with a group of masks after every node the step may end on so the next "
            f"step always has drafts (1 to {MAX_TREE_DEPTH} depths, at most {MAX_TREE_COLUMNS} columns per row); "
            "auto: the shape with the most expected tokens per second from the step's measured cost per width on this "
            "device and the checkpoint's acceptance per depth and rank, among those that fit max_step_columns (chain "
            "where a tree does not apply: sampling, another draft source, a cache other than cursor). Greedy rows at "
            "threshold 1.0 draft the tree, other verifying rows a chain; a step that max_step_columns cannot fit "
            "drafts the largest smaller tree that fits, down to a chain",
            per_request=True,
        ),
    )
    tree_masks: str = field(
        default="all",
        metadata=_help(
            "tree shapes: which nodes carry a group of masks for the next step's drafts: all (every node the step may "
            "end on: drafts on every step) or top (the root and the path of first-ranked candidates)",
            TREE_MASKS,
        ),
    )
    # Medusa's typical acceptance (Cai et al. 2024, arXiv 2401.10774), greedy form: a draft the AR model finds
    # plausible passes although it is not the argmax; sqrt(eps) as Medusa's alpha. Lossy by design
    typical_epsilon: float = field(
        default=0.0,
        metadata=_help(
            "verify=True, greedy rows: 0 checks each draft against the AR argmax (lossless at threshold 1.0); "
            "eps > 0 also passes a draft whose AR probability (same forward) exceeds min(eps, sqrt(eps) * "
            "exp(-entropy)), Medusa's typical acceptance: lossy, more tokens per forward, every token still one "
            "the AR model finds likely"
        ),
    )
    draft_source: str = field(
        default="masks",
        metadata=_help(
            "where verified rows' drafts come from: masks (the checkpoint's own mask predictions), model (a draft "
            "model, draft_model=) or lookup (n-grams of the prompt and the output so far); the masks' predictions "
            "extend the drafts of the other two (window=1: none, plain speculative decoding)",
            DRAFT_SOURCES,
        ),
    )
    draft_model: str | None = field(
        default=None,
        metadata=_help(
            "draft_source=model: a causal LM sharing the tokenizer (hub id or local directory), 'self' (the "
            "target itself: the acceptance upper bound) or 'self:N' (the target's first N layers, weights shared)"
        ),
    )
    lookup_ngram: int = field(
        default=3,
        metadata=_help(
            "draft_source=lookup: the last n tokens are looked up earlier in the prompt and output; the tokens "
            "that followed their latest occurrence are the drafts",
            per_request=True,
        ),
    )
    full_window: bool = field(
        default=False,
        metadata=_help("append the masks even where no row can accept them (threshold 1.0): measures their cost"),
    )
    max_step_columns: int | None = field(
        default=None,
        metadata=_help(
            "cap on the columns one batched decode step computes: masks (or Jacobi guesses) are dropped, the "
            "longest rows' first, until the step fits, and a tree shrinks to the largest smaller tree that fits, down "
            "to a chain; every row keeps its real tokens, its AR column and its drafts (a sampling row verified at "
            "threshold 1.0 its masks too: they decide its samples). Extra columns are nearly free only while a step stays memory-bound (on a 2-core CPU up to "
            "about 8 in all), so under load this keeps masks from costing more than they yield. None: no cap. "
            "With a cap a row below threshold 1.0 can decode differently under different loads (verified and "
            "threshold-1.0 rows cannot)"
        ),
    )
    ar_cache: str = field(
        default="dynamic",
        metadata=_help(
            "decoder=ar: transformers' KV cache, dynamic (grows per step) or static (fixed-shape buffers)", AR_CACHES
        ),
    )

    def __post_init__(self) -> None:
        # each check validates (and normalises) its own fields; their order is the order errors are reported in
        self._check_decoder()
        self._check_limits()
        self._check_sampling()
        self._check_window()
        self._check_modes()
        self._check_drafts()
        self._check_draft_source()
        self._check_tree()
        if self.verify:
            self._check_verify()

    def _check_decoder(self) -> None:
        if self.decoder not in DECODERS:
            raise ValueError(f"unknown decoder {self.decoder!r}; choose one of {list(DECODERS)}")
        validate_metric(self.metric)
        if self.cache not in CACHES:
            raise ValueError(f"unknown cache strategy {self.cache!r}; choose one of {list(CACHES)}")

    def _check_limits(self) -> None:
        for name in ("block_size", "max_new_tokens", "cache_block", "lookup_ngram"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        object.__setattr__(self, "threshold", validate_threshold(self.threshold, self.metric))
        if self.max_accept is not None and (not _is_int(self.max_accept) or self.max_accept < 1):
            raise ValueError(f"max_accept must be None or an integer >= 1, got {self.max_accept!r}")
        if self.max_step_columns is not None and (not _is_int(self.max_step_columns) or self.max_step_columns < 1):
            raise ValueError(f"max_step_columns must be None or an integer >= 1, got {self.max_step_columns!r}")

    def _check_sampling(self) -> None:
        temp = self.temperature
        if isinstance(temp, bool) or not isinstance(temp, (int, float)) or not temp >= 0 or math.isinf(temp):
            raise ValueError(f"temperature must be a finite number >= 0, got {temp!r}")
        object.__setattr__(self, "temperature", float(temp))
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an integer, got {self.seed!r}")

    def _check_window(self) -> None:
        if self.window == "cache_block":
            if self.cache != "block":
                raise ValueError("window='cache_block' (masks fill the rest of the cache block) needs cache='block'")
        elif self.window is not None and (not _is_int(self.window) or self.window < 1):
            raise ValueError(
                f"window must be an integer >= 1, None (= block_size) or 'cache_block', got {self.window!r}"
            )

    def _check_modes(self) -> None:
        if not isinstance(self.verify, bool):
            raise ValueError(f"verify must be true or false, got {self.verify!r}")
        if self.ar_cache not in AR_CACHES:
            raise ValueError(f"unknown ar_cache {self.ar_cache!r}; choose one of {list(AR_CACHES)}")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"unknown fallback {self.fallback!r}; choose one of {list(FALLBACKS)}")
        if self.chain_drafts not in CHAINING:
            raise ValueError(f"unknown chain_drafts {self.chain_drafts!r}; choose one of {list(CHAINING)}")

    def _check_drafts(self) -> None:
        dt = self.draft_threshold
        if isinstance(dt, bool) or not isinstance(dt, (int, float)) or not 0 <= dt <= 1:
            raise ValueError(f"draft_threshold must be a number in [0, 1], got {dt!r}")
        eps = self.typical_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < 1:
            raise ValueError(f"typical_epsilon must be a number in [0, 1), got {eps!r}")
        object.__setattr__(self, "typical_epsilon", float(eps))
        if eps > 0 and not self.verify:
            raise ValueError("typical_epsilon relaxes the check of verified drafts: it needs verify=True")
        vm = self.verify_masks
        if vm not in VERIFY_MASKS and (not _is_int(vm) or vm < 1):
            raise ValueError(f"verify_masks must be an integer >= 1 or one of {list(VERIFY_MASKS)}, got {vm!r}")
        if self.draft_length is not None and (not _is_int(self.draft_length) or self.draft_length < 1):
            raise ValueError(f"draft_length must be None or an integer >= 1, got {self.draft_length!r}")

    def _check_draft_source(self) -> None:
        if self.draft_source not in DRAFT_SOURCES:
            raise ValueError(f"unknown draft_source {self.draft_source!r}; choose one of {list(DRAFT_SOURCES)}")
        if (self.draft_source == "model") != (self.draft_model is not None):
            raise ValueError(
                "draft_source='model' needs draft_model= (a model name or path, 'self' or 'self:N')"
                if self.draft_source == "model"
                else f"draft_model={self.draft_model!r} is read only with draft_source='model'"
            )
        model = self.draft_model
        if model is not None and (not isinstance(model, str) or not model.strip()):
            raise ValueError(f"draft_model must be a model name or path, 'self' or 'self:N', got {model!r}")
        if isinstance(model, str) and model.startswith("self:") and not (model[5:].isdigit() and int(model[5:]) >= 1):
            raise ValueError(f"draft_model={model!r}: 'self:N' takes the target's first N layers, N an integer >= 1")

    def _check_tree(self) -> None:
        if self.tree_masks not in TREE_MASKS:
            raise ValueError(f"unknown tree_masks {self.tree_masks!r}; choose one of {list(TREE_MASKS)}")
        shape = tree_shape(self.tree)  # raises on a malformed shape
        if shape is None:
            return
        label = ",".join(map(str, shape))
        object.__setattr__(self, "tree", label)  # one spelling: "2x1", (2, 1) and [2, 1] are "2,1"
        columns = tree_columns(shape, self.tree_masks)
        if columns > MAX_TREE_COLUMNS:
            raise ValueError(
                f"tree={label!r} feeds {tree_nodes(shape)} draft nodes in {columns} columns per row (nodes and their "
                f"mask groups, tree_masks={self.tree_masks!r}); a tree takes at most {MAX_TREE_COLUMNS}: choose fewer "
                "candidates per depth (e.g. '4,2': 38 columns) or tree='auto'"
            )
        if self.draft_source != "masks":
            raise ValueError(
                f"tree={label!r} drafts from the masks; draft_source={self.draft_source!r} verifies a chain "
                "(tree='chain' or 'auto')"
            )
        if self.cache != "cursor":
            raise ValueError(f"tree={label!r} needs cache='cursor' (its accepted path is moved in the KV cache)")
        if self.typical_epsilon > 0:
            raise ValueError(f"tree={label!r} checks drafts against the argmax: typical_epsilon needs tree='chain'")
        window = self.effective_window
        if _is_int(window) and len(shape) > window - 1:
            raise ValueError(f"tree={label!r} is {len(shape)} deep; the window's {window - 1} masks draft at most that")

    def check_every_row(self) -> None:
        """The rules of settings that every row of a run decodes with (``generate``, an evaluation, a benchmark):
        a setting only verifying rows read needs ``verify=True`` (another draft source, a tree shape), and a tree
        shape greedy rows.  A server's engine settings are not held to them: there ``verify`` and ``temperature`` are
        per request, and a request the server's tree does not apply to (not verifying, sampling, below threshold
        1.0) decodes as it would under ``tree='auto'``, verifying a chain where it verifies."""
        if self.draft_source != "masks" and not self.verify:
            raise ValueError(f"draft_source={self.draft_source!r} proposes drafts to verify: it needs verify=True")
        if tree_shape(self.tree) is None:
            return
        if not self.verify:
            raise ValueError(
                f"tree={self.tree!r} lays out the drafts verify checks, and no row verifies: set verify=True "
                "(or leave tree at 'auto')"
            )
        if self.temperature > 0:
            raise ValueError(
                f"tree={self.tree!r} verifies greedy rows; at temperature > 0 verification samples exactly along a "
                "chain: use tree='chain' or 'auto'"
            )

    @property
    def tree_applies(self) -> bool:
        """Whether a row decoded with these settings drafts a tree where the engine has one (a tree shape, or
        ``auto`` where it picks a tree): a greedy verifying row at its exact threshold with the masks as drafts and
        the cursor cache; every other verifying row verifies a chain."""
        exact = is_exact_threshold(self.threshold, self.metric)
        usable = self.decoder == "mars" and self.draft_source == "masks" and self.cache == "cursor"
        greedy = self.temperature == 0 and self.typical_epsilon == 0
        return self.verify and exact and usable and greedy and self.tree != "chain"

    def _check_verify(self) -> None:
        if self.decoder != "mars":
            raise ValueError(f"verify=True drafts with the MARS masks: it needs decoder='mars', got {self.decoder!r}")
        if self.max_accept is not None:
            raise ValueError("verify=True accepts every verified draft: max_accept does not apply (leave it None)")
        if self.window == "cache_block":
            raise ValueError("verify=True needs an integer window (the drafts plus W-1 masks), not 'cache_block'")
        if self.window is not None and self.window < 2 and self.draft_source == "masks":
            raise ValueError("verify=True needs window >= 2 (at least one mask to draft from)")
        window = self.effective_window
        if _is_int(self.verify_masks) and _is_int(window) and self.verify_masks > window - 1:
            raise ValueError(f"verify_masks={self.verify_masks} is more than the window's {window - 1} masks")

    # ------------------------------------------------------------------ derived values
    @property
    def effective_window(self) -> int | str:
        """Predictions per step: ``window`` or the block size."""
        return self.block_size if self.window is None else self.window

    @property
    def effective_draft_length(self) -> int:
        """Drafts verified per step (verify mode): ``draft_length``, else ``window - 1`` (as many as the masks
        predict) with the masks as source and ``block_size`` with another source."""
        if self.draft_length is not None:
            return self.draft_length
        if self.draft_source != "masks":
            return self.block_size
        window = self.effective_window
        return (window if isinstance(window, int) else self.cache_block) - 1

    @property
    def reference(self) -> float:
        return reference_threshold(self.metric)

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def help(cls) -> dict[str, str]:
        return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}

    @classmethod
    def per_request_fields(cls) -> tuple[str, ...]:
        """The fields one request may override (declared by ``per_request=True`` in their metadata)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("per_request"))

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any] | None, **overrides: Any) -> DecodingSettings:
        """From a ``decoding`` config (or adapter/request keys): unknown keys fail naming the allowed ones;
        ``None`` values mean "the default"; ``overrides`` win."""
        values = {k: v for k, v in dict(mapping or {}).items() if k not in CONFIG_ONLY_KEYS}
        values.update(overrides)
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"unknown decoding setting(s) {unknown}; allowed: {sorted(cls.field_names())}")
        nullable = {f.name for f in dataclasses.fields(cls) if f.default is None}
        text = {f.name for f in dataclasses.fields(cls) if f.type == "str"}  # names, never numbers ("1_0" stays)
        values = {k: v if k in text else _coerce(v, nullable=k in nullable) for k, v in values.items()}
        return cls(**{k: v for k, v in values.items() if v is not None})

    def replace(self, **changes: Any) -> DecodingSettings:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def tree_shape(tree: Any) -> tuple[int, ...] | None:
    """The candidates per depth of a tree setting: "2,1", "2x1", (2, 1) and [2, 1] are (2, 1), the integer 3 is (3,);
    None for ``auto`` and ``chain``.  Text is ASCII digit groups joined by ',' or 'x', nothing else (no signs, no
    digit separators, no other scripts' digits)."""
    if isinstance(tree, str) and tree in TREE_MODES:
        return None
    shape = _parse_shape(tree)
    if shape is None or not 1 <= len(shape) <= MAX_TREE_DEPTH or any(k < 1 for k in shape):
        raise ValueError(
            f"tree must be one of {list(TREE_MODES)} or candidates per depth such as '2,1' or '2x1' (ASCII digits "
            f"joined by ',' or 'x', or a tuple of integers; 1 to {MAX_TREE_DEPTH} depths, each >= 1), got {tree!r}"
        )
    return shape


def _parse_shape(tree: Any) -> tuple[int, ...] | None:
    if _is_int(tree):
        return (tree,)
    if isinstance(tree, str):
        return tuple(int(k) for k in re.split("[,x]", tree)) if _TREE_SPEC.fullmatch(tree) else None
    if isinstance(tree, Sequence) and all(_is_int(k) for k in tree):
        return tuple(int(k) for k in tree)
    return None


def tree_nodes(shape: Sequence[int]) -> int:
    """Draft nodes of a tree of ``shape`` candidates per depth: k1 + k1*k2 + ..."""
    nodes, reach = 0, 1
    for k in shape:
        reach *= k
        nodes += reach
    return nodes


def tree_columns(shape: Sequence[int], masks: str = "all") -> int:
    """Columns a step of this tree feeds after the root (:mod:`mars.decoding.tree`): its nodes, the root's group of
    ``D`` masks and a group of ``D`` after every node that carries one (``all``: every node; ``top``: the ``D``
    nodes of the first-ranked path)."""
    depth, nodes = len(shape), tree_nodes(shape)
    return nodes + depth * (1 + (nodes if masks == "all" else depth))


def _coerce(value: Any, nullable: bool = False) -> Any:
    """Numbers and booleans that arrive as strings (lm-eval ``--model_args``, query strings) become values;
    "none"/"null" mean None only for fields whose default is None (``cache=none`` is a strategy name)."""
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("true", "false"):
            return lowered == "true"
        if lowered in ("none", "null") and nullable:
            return None
        for cast in (int, float):
            try:
                return cast(value)
            except ValueError:
                pass
    return value


def decoding_block_size(requested: int | None, meta: Any = None) -> int:
    """The block size to decode with: ``requested`` when set, else the checkpoint's training block size (``meta``:
    its metadata as a mapping or an object with ``block_size``), else :class:`DecodingSettings`' default: one rule
    for evaluation, serving and the benchmark commands."""
    if requested is not None:
        return int(requested)
    trained = meta.get("block_size") if isinstance(meta, Mapping) else getattr(meta, "block_size", None)
    if trained:
        return int(trained)
    from mars.paper_checkpoints import missing_block_size

    if missing := missing_block_size(meta):  # a paper checkpoint: no default stands in for its training block
        raise ValueError(missing)
    return next(f.default for f in dataclasses.fields(DecodingSettings) if f.name == "block_size")
