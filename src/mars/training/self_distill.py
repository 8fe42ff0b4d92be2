"""Self-distilled instruction data for any model: prompts from any source, answered by the model itself.

MARS teaches a model to predict several of its *own* next tokens per forward.  Training on the model's
own greedy answers (self-distillation) keeps the AR stage consistent with the model and is what
peers that train multi-token predictors report the highest acceptance with.  Prompts come from

- ``offline``: the committed prompt set ``data/prompts/{train,heldout}.jsonl`` (7,033 licensed prompts
  in eight categories, see ``data/prompts/SOURCES.md``),
- ``jsonl``: any local file with a ``prompt`` field (or ``messages``: the first user turn),
- ``hub``: any Hugging Face dataset (``hub_id``, ``split``, ``field``),

are checked against the evaluation prompts (:mod:`mars.training.prompt_overlap`; an overlap is refused, naming it),
and answered greedily with the project's own batched decoder (cursor cache, finished rows leave the
batch) in ``dtype=auto`` (bf16 where the hardware has it).  Answers are cached under
``<cache>/<model>-<key>/`` where the key covers the model's weights and every decoding setting (a cache
of another model or setting is never reused); ``rows.jsonl`` there holds one answer per prompt, keyed
by the prompt's id and the hash of its text, appended after every batch (a killed build resumes, and a
larger or overlapping prompt set answers only the prompts it lacks).  Each prompt set gets
``sets/<prompts-hash>.jsonl`` (its rows, in prompt order) and ``sets/<prompts-hash>.json``, which says
``complete: true`` only when every prompt has its answer.

    python -m mars.training.self_distill --model embedded:smollm2-135m --limit 3000     # build or reuse
    python -m mars.training.self_distill --train experiment=reproduce                   # what that training config uses
    python train.py data=self_distill data.distill.prompts.limit=3000          # the same, then train
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import ConfigDict, Field

from mars.config_schema import DtypeName, Section, known_keys, validated
from mars.paths import conf_dir, data_dir
from mars.persistence import (
    WEIGHT_SUFFIXES,
    append_jsonl,
    atomic_write_json,
    atomic_write_jsonl,
    atomic_write_text,
    cache_root,
    file_sha256,
    read_appended_jsonl,
)
from mars.prompt_files import prompt_of, read_prompt_file

log = logging.getLogger(__name__)

OFFLINE_PROMPTS = data_dir() / "prompts"  # the checkout's data/, or the installed package's copy
# Answers committed with the repository (read-only), in folders named like the cache's: a fresh machine
# reuses them when model weights and decoding settings match, instead of spending an hour decoding.
SHIPPED = data_dir() / "self_distill"
FORMAT_VERSION = 1


# ------------------------------------------------------------------------------------------
# Prompts
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PromptSpec:
    source: str = "offline"  # offline | jsonl | hub
    path: str | None = None  # jsonl
    hub_id: str | None = None  # hub
    split: str = "train"  # offline: train | heldout; hub: the dataset split
    field: str = "prompt"  # jsonl/hub: the column holding the prompt
    limit: int | None = None  # the first N prompts (the committed files are already shuffled)
    allow_eval_overlap: bool = False

    def __post_init__(self) -> None:
        if self.source not in ("offline", "jsonl", "hub"):
            raise ValueError(f"distill.prompts.source must be offline | jsonl | hub, got {self.source!r}")
        if self.limit is not None and (
            isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1
        ):
            raise ValueError(f"distill.prompts.limit must be a positive integer or null, got {self.limit!r}")


def _read_jsonl(path: Path, field: str) -> list[dict[str, Any]]:
    """The prompt file's rows as ``{"id", "prompt", ...}`` (``source`` and ``category`` where given)."""
    return [
        {
            "id": row.id,
            "prompt": row.prompt,
            **{k: v for k, v in (("source", row.source), ("category", row.category)) if v is not None},
        }
        for row in read_prompt_file(path, fields=(field,))
    ]


def load_prompts(spec: PromptSpec) -> list[dict[str, Any]]:
    """The prompts of ``spec`` as ``{"id", "prompt", ...}`` rows, checked: non-empty, unique ids, and
    (unless ``allow_eval_overlap``) no overlap with the evaluation prompts."""
    if spec.source == "offline":
        path = OFFLINE_PROMPTS / f"{spec.split}.jsonl"
        rows = _read_jsonl(path, "prompt")
        where = str(path)
    elif spec.source == "jsonl":
        if not spec.path:
            raise ValueError("distill.prompts.source=jsonl needs distill.prompts.path")
        rows = _read_jsonl(Path(spec.path).expanduser(), spec.field)
        where = spec.path
    else:
        if not spec.hub_id:
            raise ValueError("distill.prompts.source=hub needs distill.prompts.hub_id")
        import datasets

        ds = datasets.load_dataset(spec.hub_id, split=spec.split)
        rows = []
        for i, row in enumerate(ds):
            prompt = prompt_of(row, (spec.field,))
            if prompt and prompt.strip():
                rows.append({"id": f"{spec.hub_id.replace('/', '_')}-{i}", "prompt": prompt})
        where = f"{spec.hub_id} ({spec.split})"
    if spec.limit is not None:
        rows = rows[: spec.limit]
    if not rows:
        raise ValueError(f"the prompt source {where} holds no prompts")
    ids = [r["id"] for r in rows]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"the prompt source {where} repeats the id {dup!r}; ids must be unique")
    if not spec.allow_eval_overlap:
        refuse_eval_overlap(rows, where)
    return rows


def refuse_eval_overlap(rows: list[dict[str, Any]], where: str) -> None:
    from mars.training.prompt_overlap import EvalOverlap

    overlap = EvalOverlap.from_repo()
    hits = [(r["id"], reason) for r in rows if (reason := overlap.reason(r["prompt"]))]
    if hits:
        shown = "; ".join(f"{i}: {why}" for i, why in hits[:5])
        raise ValueError(
            f"{len(hits)} prompt(s) of {where} overlap the evaluation prompts ({shown}{' ...' if len(hits) > 5 else ''}); "
            "training on them would leak the benchmarks. Remove them, or set distill.prompts.allow_eval_overlap=true "
            "if you will not evaluate on those tasks."
        )


# ------------------------------------------------------------------------------------------
# Fingerprint and cache folder
# ------------------------------------------------------------------------------------------
def model_fingerprint(name_or_path: str, tiny: dict | None = None) -> str:
    """What identifies the answering model's weights: the sha256 of every byte of the embedded GGUF or of
    a local folder's weight files (read once, then cached: :func:`mars.persistence.file_sha256`), a hub id
    (with the revision if given as ``id@rev``), or the tiny-random config."""
    if name_or_path == "tiny-random":
        return "tiny-random:" + json.dumps(tiny or {}, sort_keys=True)
    if name_or_path.startswith("embedded:"):
        from mars.models import embedded_gguf_path

        return f"{name_or_path}:{file_sha256(embedded_gguf_path())}"
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        weights = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
        if not weights:
            raise ValueError(f"{path} holds no weight files (any of {WEIGHT_SUFFIXES})")
        return f"dir:{path.resolve().name}:" + ",".join(file_sha256(p) for p in weights)
    return f"hub:{name_or_path}"


class DistillSettings(Section):
    """How ``data.distill`` answers its prompts (the prompts themselves: :class:`PromptSpec`)."""

    model_config = ConfigDict(frozen=True)
    section: ClassVar[str] = "data.distill"
    max_new_tokens: Annotated[int, Field(ge=1)]
    batch_size: Annotated[int, Field(ge=1)]
    dtype: DtypeName
    threads: Annotated[int, Field(ge=1)] | None = None  # torch CPU threads while building (None: leave as is)
    root: str | None = None  # cache folder (default <MARS_CACHE>/self_distill)


def fingerprint(model_id: str, settings: DistillSettings, dtype: str) -> dict[str, Any]:
    """What decides an answer besides its prompt: the model's weights and the decoding settings."""
    return {
        "format": FORMAT_VERSION,
        "model": model_id,
        # greedy, chat template with the generation prompt: the answers a chat user would get
        "decoding": {"greedy": True, "chat_template": True, "max_new_tokens": settings.max_new_tokens, "dtype": dtype},
    }


def prompt_hash(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16]


def prompt_set_hash(prompts: list[dict[str, Any]]) -> str:
    return hashlib.sha256(
        json.dumps([(r["id"], r["prompt"]) for r in prompts], ensure_ascii=False).encode()
    ).hexdigest()


def cache_folder(fp: dict[str, Any], root: str | None) -> Path:
    base = Path(root).expanduser() if root else cache_root() / "self_distill"
    label = fp["model"].split(":")[1] if ":" in fp["model"] else fp["model"]
    label = "".join(c if c.isalnum() or c in "-_." else "-" for c in label)[:40]
    key = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]
    return base / f"{label}-{key}"


# ------------------------------------------------------------------------------------------
# Building
# ------------------------------------------------------------------------------------------
@dataclass
class DistillResult:
    folder: Path
    rows_path: Path
    stats: dict[str, Any] = field(default_factory=dict)


def _key(row_id: str, prompt: str) -> tuple[str, str]:
    return row_id, prompt_hash(prompt)


def _read_done(path: Path, *, repair: bool = True) -> dict[tuple[str, str], dict]:
    """Answers already written, by (id, prompt hash); a line torn by a killed write is skipped (and, with
    ``repair``, removed from the file)."""
    rows = {}
    for row in read_appended_jsonl(path, repair=repair):
        try:
            rows[_key(row["id"], row["messages"][0]["content"])] = row
        except (KeyError, IndexError, TypeError):
            continue
    return rows


def summarise(rows: list[dict[str, Any]], seconds: float, generated: int) -> dict[str, Any]:
    tokens = [r["response_tokens"] for r in rows]
    return {
        "rows": len(rows),
        "response_tokens": sum(tokens),
        "mean_response_tokens": round(sum(tokens) / len(tokens), 1) if tokens else 0,
        "ended_with_eos": round(sum(r["finished"] for r in rows) / len(rows), 4) if rows else 0,
        "this_run_generated_tokens": generated,
        "this_run_seconds": round(seconds, 1),
        "this_run_tokens_per_second": round(generated / seconds, 1) if seconds > 0 else None,
    }


def build(
    model_name: str,
    prompts: list[dict[str, Any]],
    settings: DistillSettings,
    *,
    tiny: dict | None = None,
    progress: bool = True,
    loaded=None,
) -> DistillResult:
    """Answer every prompt not answered yet in the cache and write the prompt set's rows; see the
    module docstring."""
    from mars.hardware import resolve_device, resolve_dtype_name

    device = resolve_device("auto")
    dtype = resolve_dtype_name(settings.dtype, device)
    fp = fingerprint(model_fingerprint(model_name, tiny), settings, dtype)
    folder = _claim_cache(cache_folder(fp, settings.root), fp)
    rows_path = folder / "rows.jsonl"
    set_hash = prompt_set_hash(prompts)[:16]
    set_rows, set_meta = folder / "sets" / f"{set_hash}.jsonl", folder / "sets" / f"{set_hash}.json"
    if set_meta.is_file() and json.loads(set_meta.read_text()).get("complete") and set_rows.is_file():
        stats = json.loads(set_meta.read_text()).get("stats", {})
        log.info("self-distilled data reused: %s (%s rows)", set_rows, stats.get("rows"))
        return DistillResult(folder, set_rows, stats)
    shipped = _shipped_rows(folder.name, fp)
    done = {**shipped, **_read_done(rows_path)}
    todo = [p for p in prompts if _key(p["id"], p["prompt"]) not in done]
    generated, seconds = 0, 0.0
    if todo:
        generated, seconds = _answer(model_name, todo, settings, rows_path, dtype, device, tiny, progress, loaded)
        done = {**shipped, **_read_done(rows_path)}
    rows = [done[k] for p in prompts if (k := _key(p["id"], p["prompt"])) in done]
    complete = len(rows) == len(prompts)
    stats = summarise(rows, seconds, generated)
    set_rows.parent.mkdir(exist_ok=True)
    atomic_write_jsonl(set_rows, rows)
    atomic_write_json(
        set_meta,
        {"prompts_sha256": prompt_set_hash(prompts), "n_prompts": len(prompts), "complete": complete, "stats": stats},
    )
    log.info("self-distilled data: %s", json.dumps(stats))
    return DistillResult(folder, set_rows, stats)


def _claim_cache(folder: Path, fp: dict[str, Any]) -> Path:
    """``folder``, created with a meta.json recording ``fp``; one recording another fingerprint is refused (its
    answers are another model's or decoding's)."""
    meta_path = folder / "meta.json"
    if meta_path.is_file():
        if json.loads(meta_path.read_text()).get("fingerprint") != fp:
            raise ValueError(
                f"{folder} holds self-distilled data of another model or decoding setting; "
                "delete it or choose distill.root"
            )
    folder.mkdir(parents=True, exist_ok=True)
    if not meta_path.is_file():
        atomic_write_json(meta_path, {"fingerprint": fp})
    return folder


def _shipped_rows(name: str, fp: dict[str, Any]) -> dict[tuple[str, str], dict]:
    """Answers committed under data/self_distill/<name>/ for exactly this fingerprint (else none)."""
    folder = SHIPPED / name
    if not (folder / "meta.json").is_file():
        return {}
    if json.loads((folder / "meta.json").read_text()).get("fingerprint") != fp:
        log.warning("%s does not match this model/decoding fingerprint; not used", folder)
        return {}
    return _read_done(folder / "rows.jsonl", repair=False)  # committed, read-only


def _answer(model_name, todo, settings, rows_path, dtype, device, tiny, progress, loaded) -> tuple[int, float]:
    """Answer ``todo`` with the model (loaded here unless ``loaded`` is given), appending each batch's rows to
    ``rows_path`` as it finishes; returns the tokens generated and the seconds spent generating them."""
    import torch
    from tqdm.auto import tqdm

    from mars.decoding import generate
    from mars.models import load_model

    if settings.threads:
        torch.set_num_threads(settings.threads)
    if loaded is None:
        loaded = load_model(model_name, tiny=tiny, dtype=dtype, device=device)
    model, tok = loaded.model.eval(), loaded.tokenizer
    # longest first inside chunks of 8 batches: less padding, and a partial build stays a random sample
    chunk = settings.batch_size * 8
    generated, seconds = 0, 0.0
    bar = tqdm(total=len(todo), desc="self-distilling", unit="prompt", disable=not progress)
    for c in range(0, len(todo), chunk):
        part = sorted(todo[c : c + chunk], key=lambda p: -len(p["prompt"]))
        for b in range(0, len(part), settings.batch_size):
            batch = part[b : b + settings.batch_size]
            t0 = time.perf_counter()
            out = generate(
                model,
                tok,
                [p["prompt"] for p in batch],
                chat_template=True,
                threshold=1.0,
                max_new_tokens=settings.max_new_tokens,
                mask_token_id=loaded.mask.id,
            )
            seconds += time.perf_counter() - t0
            generated += out.stats.generated_tokens
            append_jsonl(rows_path, _answered_rows(batch, out))
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{generated / max(seconds, 1e-9):.1f}")
    bar.close()
    return generated, seconds


def _answered_rows(batch: list[dict[str, Any]], out) -> list[dict[str, Any]]:
    """One training row per prompt of ``batch`` with the model's answer from ``generate``'s result ``out``: the
    chat turns, whether the answer ended with EOS and its length in tokens (EOS not counted)."""
    rows = []
    for p, text, ids, reason in zip(batch, out.texts, out.token_ids, out.finish_reasons):
        finished = reason == "eos"
        rows.append(
            {
                "id": p["id"],
                "prompt_sha": prompt_hash(p["prompt"]),
                **{k: p[k] for k in ("source", "category") if k in p},
                "messages": [
                    {"role": "user", "content": p["prompt"]},
                    {"role": "assistant", "content": text.strip()},
                ],
                "finished": finished,
                "response_tokens": len(ids) - int(finished),
            }
        )
    return rows


# ------------------------------------------------------------------------------------------
# From a training config
# ------------------------------------------------------------------------------------------
def distill_section(distill: dict[str, Any] | None) -> tuple[PromptSpec, DistillSettings, bool]:
    """``data.distill`` checked (no file read): the prompts, the decoding settings, ``drop_unfinished``."""
    distill = dict(distill or {})
    prompts = distill.pop("prompts", None) or {}
    spec = PromptSpec(**known_keys(PromptSpec, prompts, "data.distill.prompts"))
    drop_unfinished = distill.pop("drop_unfinished", False)
    if not isinstance(drop_unfinished, bool):
        raise ValueError(f"data.distill.drop_unfinished must be true or false, got {drop_unfinished!r}")
    return spec, validated(DistillSettings, distill), drop_unfinished


def training_rows(data_cfg: dict[str, Any], model_name: str, tiny: dict | None = None) -> dict[str, Any]:
    """Turn a ``data=self_distill`` config into a plain jsonl data config over the (built or reused)
    self-distilled rows.  Prompts are validated before any model loads; under DDP only rank 0 builds."""
    data_cfg = dict(data_cfg)
    spec, settings, drop_unfinished = distill_section(data_cfg.pop("distill", None))
    prompts = load_prompts(spec)
    if int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0))) > 0:
        result = _wait_for_build(model_name, prompts, settings, tiny)
    else:
        result = build(model_name, prompts, settings, tiny=tiny)
    path = result.rows_path
    if drop_unfinished:  # or keep them: data.py gives a cut answer no loss on the end-of-turn token
        rows = [line for line in path.read_text(encoding="utf-8").splitlines() if json.loads(line).get("finished")]
        path = path.with_name(path.stem + ".finished.jsonl")
        if not path.is_file() or path.read_text(encoding="utf-8").count("\n") != len(rows):
            atomic_write_text(path, "".join(r + "\n" for r in rows))
    data_cfg.update(source="jsonl", path=str(path))
    return data_cfg


def _wait_for_build(model_name, prompts, settings, tiny, poll: float = 10.0) -> DistillResult:
    from mars.hardware import resolve_device, resolve_dtype_name

    dtype = resolve_dtype_name(settings.dtype, resolve_device("auto"))
    folder = cache_folder(fingerprint(model_fingerprint(model_name, tiny), settings, dtype), settings.root)
    set_hash = prompt_set_hash(prompts)[:16]
    meta = folder / "sets" / f"{set_hash}.json"
    while not meta.is_file() or not json.loads(meta.read_text()).get("complete"):
        time.sleep(poll)
    return DistillResult(folder, folder / "sets" / f"{set_hash}.jsonl")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mars.training.self_distill", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded:smollm2-135m", help="the model that answers (and will be trained)")
    p.add_argument("--source", default="offline", choices=["offline", "jsonl", "hub"])
    p.add_argument("--path", help="jsonl prompt file (--source jsonl)")
    p.add_argument("--hub-id", help="hub dataset (--source hub)")
    p.add_argument("--split", default="train")
    p.add_argument("--field", default="prompt")
    p.add_argument("--limit", type=int)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int)
    p.add_argument("--root", help="cache folder (default <MARS_CACHE>/self_distill)")
    p.add_argument(
        "--train",
        nargs="*",
        metavar="OVERRIDE",
        help="build what `python train.py OVERRIDE...` would train on (its data.distill and model)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.train is not None:
        return _from_train_config(args.train)
    spec = PromptSpec(
        source=args.source, path=args.path, hub_id=args.hub_id, split=args.split, field=args.field, limit=args.limit
    )
    flags = ("max_new_tokens", "batch_size", "dtype", "threads", "root")
    settings = validated(DistillSettings, {k: getattr(args, k) for k in flags}, where="")
    result = build(args.model, load_prompts(spec), settings)
    print(json.dumps({"folder": str(result.folder), **result.stats}, indent=2))
    return 0


def _from_train_config(overrides: list[str]) -> int:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name="train", overrides=list(overrides))
    data = OmegaConf.to_container(cfg.data, resolve=True)
    if data.get("source") != "self_distill":
        raise SystemExit(
            f"the training config {overrides} does not use data=self_distill (data.source={data.get('source')!r})"
        )
    tiny = OmegaConf.to_container(cfg.model.tiny) if cfg.model.get("tiny") else None
    print(json.dumps(training_rows(data, cfg.model.name_or_path, tiny), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "PromptSpec",
    "DistillSettings",
    "DistillResult",
    "load_prompts",
    "build",
    "training_rows",
    "model_fingerprint",
    "fingerprint",
    "cache_folder",
    "prompt_hash",
    "prompt_set_hash",
]
