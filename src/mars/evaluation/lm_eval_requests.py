"""How the lm-eval model (:class:`mars.evaluation.lm_eval_model.MarsLM`) decodes lm-eval's ``generate_until``
requests, and what it keeps of each: the per-request :class:`RequestRecord` and the per-task :class:`TaskStats`.

Requests are grouped by task and generation settings (so timing and tokens per forward are attributable to one
task), a group's generations found in the point's partial cache are read back, the rest decoded in batches of
similar prompt lengths through ``mars.decoding.generate`` (with ``fidelity=True`` also one AR forward per batch,
:mod:`mars.evaluation.fidelity`, timed apart), and each finished batch is appended to the cache so an
interrupted point resumes at the sample.  This lives apart from ``MarsLM``, which keeps lm-eval's interface
(the model, likelihoods, data parallel, the point being decoded), so that each reads on its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from mars.decoding.settings import DecodingSettings

log = logging.getLogger(__name__)


@dataclass
class TaskStats:
    """Decoder statistics of one task at one threshold, summed over its batches."""

    generated_tokens: int = 0  # generated tokens only
    row_forwards: int = 0  # forwards each row took part in, summed over rows (the paper's steps)
    batch_forwards: float = 0  # batched forward passes (a resumed batch contributes its rows' shares)
    seconds: float = 0.0  # wall time inside the decoder (never the fidelity forward)
    requests: int = 0
    resumed: int = 0  # requests taken from the partial cache of an interrupted run
    fidelity_seconds: float = 0.0  # the extra AR forward of fidelity=True, timed apart
    fidelity_tokens: int = 0
    fidelity_ar_equal: int = 0
    fidelity_mask_tokens: int = 0
    fidelity_mask_ar_equal: int = 0
    num_drafts: int = 0  # verify: steps that verified at least one draft, summed over requests
    num_accepted_tokens: int = 0  # verify: drafts accepted

    @property
    def tokens_per_forward(self) -> float:
        """The paper's figure: tokens accepted per forward, over every step of every request."""
        return self.generated_tokens / self.row_forwards if self.row_forwards else float("nan")

    @property
    def mean_acceptance_length(self) -> float | None:
        """vLLM's figure over the draft steps of every request (docs/decoding.md, "Acceptance figures")."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else float("nan")

    def add_fidelity(self, counts: dict[str, int] | None) -> None:
        if counts:
            self.fidelity_tokens += counts["tokens"]
            self.fidelity_ar_equal += counts["ar_equal"]
            self.fidelity_mask_tokens += counts["mask_tokens"]
            self.fidelity_mask_ar_equal += counts["mask_ar_equal"]

    def as_dict(self) -> dict[str, Any]:
        out = {
            "generated_tokens": self.generated_tokens,
            "row_forwards": self.row_forwards,
            "batch_forwards": round(self.batch_forwards, 6),
            "seconds": self.seconds,
            "requests": self.requests,
            "resumed_requests": self.resumed,
            "tokens_per_forward": self.tokens_per_forward,
            "batch_tokens_per_forward": self.generated_tokens / self.batch_forwards if self.batch_forwards else None,
            "tokens_per_second": self.tokens_per_second,
        }
        if self.num_drafts:
            out.update(
                num_drafts=self.num_drafts,
                num_accepted_tokens=self.num_accepted_tokens,
                mean_acceptance_length=self.mean_acceptance_length,
            )
        if self.fidelity_tokens or self.fidelity_seconds:
            out["fidelity"] = {
                "seconds": self.fidelity_seconds,
                "tokens": self.fidelity_tokens,
                "ar_equal": self.fidelity_ar_equal,
                "mask_tokens": self.fidelity_mask_tokens,
                "mask_ar_equal": self.fidelity_mask_ar_equal,
            }
        return out


@dataclass
class RequestRecord:
    tokens: int
    forwards: int
    finish_reason: str
    text: str
    output_ids: list[int]
    from_mask: list[bool]
    fidelity: dict[str, int] | None = None  # mars.evaluation.fidelity.token_fidelity of this output
    resumed: bool = False
    seconds: float | None = None  # its share of its batch's decoder time (a verify point is timed per sample)


class GenerationRequests:
    """The ``generate_until`` side of the lm-eval model: grouping, resume from the partial cache, batched
    decoding and the records of each request.

    The model class provides ``model``, ``tokenizer``, ``mask_token_id``, ``settings`` (the point's
    :class:`DecodingSettings`), ``max_new_tokens``, ``max_length``, ``batch_size``, ``fidelity``, ``point``,
    ``_rank``, ``tok_encode``, lm-eval's ``cache_hook`` and ``_eta`` (the time estimate, None off rank 0)."""

    def _init_requests(self) -> None:
        """No request decoded yet, no results folder to resume from."""
        self.generate_calls = 0  # decoder calls made (tests use it to see that resume skips work)
        self.results_dir = None  # store.ResultsDir: the partial cache of interrupted points
        self.cache_salt = ""
        self.reset_records()

    def reset_records(self) -> None:
        self.records: dict[tuple[str, int], RequestRecord] = {}
        self.task_stats: dict[str, TaskStats] = defaultdict(TaskStats)

    def use_results_dir(self, results_dir, salt: str) -> None:
        """Keep finished generations in ``results_dir``'s partial cache (keys salted with ``salt``, the
        config fingerprint's hash) and reuse the ones an interrupted run left there."""
        self.results_dir, self.cache_salt = results_dir, str(salt)

    def _max_new(self, gen_kwargs: dict) -> int:
        requested = gen_kwargs.get("max_gen_toks")
        return min(int(requested), self.max_new_tokens) if requested else self.max_new_tokens

    @staticmethod
    def _until(gen_kwargs: dict) -> list[str]:
        until = gen_kwargs.get("until") or []
        if isinstance(until, str):
            until = [until]
        return [u for u in until if u]

    def request_key(self, prompt_ids: list[int], until: list[str], settings: DecodingSettings) -> str:
        """What identifies a generation: the prompt's ids, stop strings, every decoding setting (the
        threshold and budget included), whether fidelity is measured, and the config's fingerprint."""
        text = json.dumps(
            {
                "salt": self.cache_salt,
                "prompt": list(prompt_ids),
                "until": list(until),
                "settings": settings.as_dict(),
                "fidelity": self.fidelity,
            },
            sort_keys=True,
        )
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def _fidelity(self, prompts: list[list[int]], outputs: list[list[int]], flags: list[list[bool]]):
        from mars.evaluation.fidelity import ar_predictions, token_fidelity

        exact_checks = self.settings.temperature == 0 and self.settings.typical_epsilon == 0
        if exact_checks and not any(any(f) for f in flags):
            # no token came from a mask (threshold 1.0, verified or AR decoding): every token is the greedy
            # AR choice made in the decoding forward itself, so the extra forward would only re-confirm it
            # (not under typical acceptance, whose verified drafts need not be the argmax)
            return [{"tokens": len(o), "ar_equal": len(o), "mask_tokens": 0, "mask_ar_equal": 0} for o in outputs]
        never = [] if self.mask_token_id is None else [int(self.mask_token_id)]  # no decoder emits it
        predictions = ar_predictions(self.model, prompts, outputs, batch_size=max(1, len(prompts)), suppress_ids=never)
        return token_fidelity(outputs, predictions, flags)

    @staticmethod
    def _group_requests(requests) -> dict[tuple[str, str], list[int]]:
        """Request indices grouped by task and generation settings (stop strings, token budget), so that a
        group's time and tokens per forward belong to one task."""
        groups: dict[tuple[str, str], list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            if gen_kwargs.get("do_sample"):
                log.warning("task %s asks for sampling; MARS evaluation decodes greedily", req.task_name)
            key = json.dumps(
                {k: v for k, v in sorted(gen_kwargs.items()) if k in ("until", "max_gen_toks")}, default=str
            )
            groups[(str(req.task_name), key)].append(i)
        return groups

    def _generate_group(self, requests, task: str, members: list[int], outputs: list, bar, partial: dict) -> None:
        """One group: the generations the partial cache holds are read back, the rest decoded in batches
        (longest prompts first) and appended to the cache as each batch finishes."""
        gen_kwargs = requests[members[0]].args[1]
        until, max_new = self._until(gen_kwargs), self._max_new(gen_kwargs)
        settings = self.settings.replace(max_new_tokens=max_new)
        room = max(1, self.max_length - max_new)  # keep the end of an over-long prompt, like lm-eval's HF model
        encoded = {i: self.tok_encode(requests[i].args[0])[-room:] for i in members}
        keys = {i: self.request_key(encoded[i], until, settings) for i in members}
        stats = self.task_stats[task]
        cache = None
        if self.results_dir is not None:
            if task not in partial:
                partial[task] = self.results_dir.load_partial(self.point, task)
            cache = self.results_dir.request_cache(self.point, task, self._rank)
        done = partial.get(task, {})
        todo = []
        for i in members:
            row = done.get(keys[i])
            if row is None:
                todo.append(i)
                continue
            self._take(task, requests[i], row, stats, resumed=True)
            outputs[i] = row["text"]
            bar.update(1)
        if self._eta is not None:
            self._eta.resumed += len(members) - len(todo)
        ordered = sorted(todo, key=lambda i: -len(encoded[i]))  # similar lengths share a batch
        for start in range(0, len(ordered), self.batch_size):
            batch = ordered[start : start + self.batch_size]
            rows = self._decode_batch([requests[i] for i in batch], [encoded[i] for i in batch], until, settings)
            for i, row in zip(batch, rows):
                row["key"] = keys[i]
                self._take(task, requests[i], row, stats, resumed=False)
                outputs[i] = row["text"]
            if cache is not None:
                cache.append(rows)
            bar.update(len(batch))
            if self._eta is not None:
                self._eta.decoded(len(batch))

    def _decode_batch(self, batch_requests, prompts: list[list[int]], until: list[str], settings) -> list[dict]:
        """Decodes one batch (and measures fidelity when asked); one cache row per request, its time and
        batch forwards as its share of the batch's (a resumed point sums the shares of its batches)."""
        from mars.decoding import generate

        t0 = time.perf_counter()
        result = generate(
            self.model,
            self.tokenizer,
            prompts,
            stop=until or None,
            mask_token_id=self.mask_token_id,
            chat_template=False,
            settings=settings,
        )
        seconds = float(result.stats.seconds or (time.perf_counter() - t0))
        self.generate_calls += 1
        flags = result.from_mask or [[False] * len(ids) for ids in result.token_ids]
        n = len(prompts)
        drafts = result.stats.extra.get("per_row_num_drafts") or [0] * n
        accepted = result.stats.extra.get("per_row_num_accepted_tokens") or [0] * n
        fidelity, fid_seconds = [None] * n, 0.0
        if self.fidelity:
            t1 = time.perf_counter()
            fidelity = self._fidelity(prompts, result.token_ids, flags)
            fid_seconds = time.perf_counter() - t1
        return [
            {
                "key": None,  # set by the caller: the request's cache key
                "doc_id": int(request.doc_id),
                "text": _cut(result.texts[j], until),  # the decoder cuts too; cheap belt and braces
                "output_ids": [int(t) for t in result.token_ids[j]],
                "from_mask": [bool(f) for f in flags[j]],
                "tokens": int(result.stats.per_row_tokens[j]),
                "forwards": int(result.stats.per_row_forwards[j]),
                "num_drafts": int(drafts[j]),
                "num_accepted_tokens": int(accepted[j]),
                "finish_reason": str(result.finish_reasons[j]),
                "fidelity": fidelity[j],
                "seconds": seconds / n,
                "batch_forwards": int(result.stats.forwards) / n,
                "fidelity_seconds": fid_seconds / n,
            }
            for j, request in enumerate(batch_requests)
        ]

    def _take(self, task: str, request, row: dict, stats: TaskStats, resumed: bool) -> None:
        """Account one finished generation (decoded now or read back from the partial cache)."""
        stats.generated_tokens += row["tokens"]
        stats.row_forwards += row["forwards"]
        stats.batch_forwards += row["batch_forwards"]
        stats.seconds += row["seconds"]
        stats.fidelity_seconds += row.get("fidelity_seconds") or 0.0
        stats.num_drafts += row.get("num_drafts", 0)  # (a partial cache may hold rows without the counts)
        stats.num_accepted_tokens += row.get("num_accepted_tokens", 0)
        stats.requests += 1
        stats.resumed += int(resumed)
        stats.add_fidelity(row.get("fidelity"))
        self.records[(task, int(request.doc_id))] = RequestRecord(
            tokens=row["tokens"],
            forwards=row["forwards"],
            finish_reason=row["finish_reason"],
            text=row["text"],
            output_ids=row["output_ids"],
            from_mask=row["from_mask"],
            fidelity=row.get("fidelity"),
            resumed=resumed,
            seconds=row["seconds"],
        )
        self.cache_hook.add_partial("generate_until", request.args, row["text"])


def _cut(text: str, until: list[str]) -> str:
    cuts = [text.find(u) for u in until if u in text]
    return text[: min(cuts)] if cuts else text
