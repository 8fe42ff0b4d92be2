"""The lm-eval model adapter: generation through ``mars.decoding``, likelihoods through a plain AR forward.

lm-eval hands ``generate_until`` every request of every task at once.  The adapter groups them by
task and generation settings (so timing and tokens per forward are attributable to one task), sorts
each group by prompt length (less padding), decodes it in batches at the current threshold, and keeps
each request's decoder statistics in ``records`` keyed by ``(task, doc_id)``.  The decoder applies
lm-eval's ``until`` stop strings itself (text cut before the first stop string) and the per-request
``max_gen_toks``, capped at the configured ``max_new_tokens`` (the paper's 256).
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from mars.decoding.settings import DecodingSettings

log = logging.getLogger(__name__)



@dataclass
class TaskStats:
    """Decoder statistics of one task at one threshold, summed over its batches."""

    generated_tokens: int = 0  # generated tokens only
    row_forwards: int = 0  # forwards each row took part in, summed over rows (the paper's steps)
    batch_forwards: int = 0  # batched forward passes
    seconds: float = 0.0  # wall time inside the decoder
    requests: int = 0

    @property
    def tokens_per_forward(self) -> float:
        """The paper's figure: tokens accepted per forward, over every step of every request."""
        return self.generated_tokens / self.row_forwards if self.row_forwards else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {
            "generated_tokens": self.generated_tokens,
            "row_forwards": self.row_forwards,
            "batch_forwards": self.batch_forwards,
            "seconds": self.seconds,
            "requests": self.requests,
            "tokens_per_forward": self.tokens_per_forward,
            "batch_tokens_per_forward": self.generated_tokens / self.batch_forwards if self.batch_forwards else None,
            "tokens_per_second": self.tokens_per_second,
        }


@dataclass
class RequestRecord:
    tokens: int
    forwards: int
    finish_reason: str
    text: str


@register_model("mars")
class MarsLM(TemplateLM):
    """lm-eval model backed by a MARS-capable causal LM.

    Build it from a loaded model (``MarsLM(model=..., tokenizer=..., mask_token_id=...)``) or, from
    lm-eval's CLI, with ``--model mars --model_args pretrained=<dir or hub id>,threshold=0.9,block_size=4``.
    """

    def __init__(
        self,
        model=None,
        tokenizer=None,
        *,
        pretrained: str | None = None,
        mask_token_id: int | None = None,
        threshold: float = 1.0,
        decoding: dict[str, Any] | None = None,
        batch_size: int | str | None = None,
        max_new_tokens: int | None = None,
        max_length: int | None = None,
        device: str | None = None,
        **decoding_kwargs: Any,
    ) -> None:
        super().__init__()
        if model is None:
            if pretrained is None:
                raise ValueError("MarsLM needs a model (model=..., tokenizer=...) or pretrained=<path or hub id>")
            from mars.models import load_model

            loaded = load_model(str(pretrained), device=device or "cpu")
            model, tokenizer, mask_token_id = loaded.model, loaded.tokenizer, loaded.mask.id
            explicit = decoding_kwargs.get("block_size") or (decoding or {}).get("block_size")
            if loaded.metadata and loaded.metadata.get("block_size") and not explicit:
                decoding_kwargs["block_size"] = int(loaded.metadata["block_size"])
        if tokenizer is None:
            raise ValueError("MarsLM needs the model's tokenizer")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.mask_token_id = mask_token_id if mask_token_id is not None else tokenizer.mask_token_id
        settings = dict(decoding or {})
        settings.update({k: v for k, v in decoding_kwargs.items() if v is not None})
        batch = batch_size or settings.pop("batch_size", None) or 8
        self.batch_size = int(batch) if str(batch).isdigit() else 8  # lm-eval's "auto" means nothing here
        settings.pop("batch_size", None)
        if max_new_tokens is not None:
            settings["max_new_tokens"] = max_new_tokens
        # one validated object (mars.decoding.settings); the threshold is set per sweep point
        self.settings = DecodingSettings.from_mapping(settings, threshold=float(threshold))
        self.max_new_tokens = self.settings.max_new_tokens
        self.threshold = self.settings.threshold
        self._max_length = max_length
        self.generate_calls = 0  # decoder calls made (tests use it to see that resume skips work)
        self.reset_records()

    # ------------------------------------------------------------------ bookkeeping
    def reset_records(self) -> None:
        self.records: dict[tuple[str, int], RequestRecord] = {}
        self.task_stats: dict[str, TaskStats] = defaultdict(TaskStats)

    def set_threshold(self, threshold: float) -> None:
        self.settings = self.settings.replace(threshold=float(threshold))
        self.threshold = self.settings.threshold

    # ------------------------------------------------------------------ lm-eval plumbing
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return int(self._max_length)
        for attr in ("max_position_embeddings", "n_positions", "seq_length"):
            value = getattr(self.model.config, attr, None)
            if value:
                return int(value)
        return 2048

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "mars")).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The model's own chat template (lm-eval's ``apply_chat_template=True`` path)."""
        import jinja2

        kwargs = dict(tokenize=False, add_generation_prompt=add_generation_prompt,
                      continue_final_message=not add_generation_prompt)
        try:
            return self.tokenizer.apply_chat_template(chat_history, **kwargs)
        except jinja2.exceptions.TemplateError:
            # some templates reject a system turn; lm-eval's HF model drops it in that case too
            history = [m for m in chat_history if m["role"] != "system"]
            return self.tokenizer.apply_chat_template(history, **kwargs)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # Chat-templated prompts already carry their special tokens: never add a second BOS.
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def get_model_info(self) -> dict[str, Any]:
        return {"model_name": getattr(self.model.config, "_name_or_path", ""), **self.settings.as_dict()}

    # ------------------------------------------------------------------ generation
    def _max_new(self, gen_kwargs: dict) -> int:
        requested = gen_kwargs.get("max_gen_toks")
        return min(int(requested), self.max_new_tokens) if requested else self.max_new_tokens

    @staticmethod
    def _until(gen_kwargs: dict) -> list[str]:
        until = gen_kwargs.get("until") or []
        if isinstance(until, str):
            until = [until]
        return [u for u in until if u]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from mars.decoding import generate

        outputs: list[str | None] = [None] * len(requests)
        groups: dict[tuple[str, str], list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            if gen_kwargs.get("do_sample"):
                log.warning("task %s asks for sampling; MARS evaluation decodes greedily", req.task_name)
            key = json.dumps({k: v for k, v in sorted(gen_kwargs.items()) if k in ("until", "max_gen_toks")},
                             default=str)
            groups[(str(req.task_name), key)].append(i)

        bar = tqdm(total=len(requests), desc=f"generate tau={self.threshold:g}", disable=disable_tqdm)
        for (task, _), members in groups.items():
            gen_kwargs = requests[members[0]].args[1]
            until, max_new = self._until(gen_kwargs), self._max_new(gen_kwargs)
            room = max(1, self.max_length - max_new)  # keep the end of an over-long prompt, like lm-eval's HF model
            encoded = {i: self.tok_encode(requests[i].args[0])[-room:] for i in members}
            ordered = sorted(members, key=lambda i: -len(encoded[i]))  # similar lengths share a batch
            stats = self.task_stats[task]
            for start in range(0, len(ordered), self.batch_size):
                batch = ordered[start : start + self.batch_size]
                prompts = [encoded[i] for i in batch]
                t0 = time.perf_counter()
                result = generate(
                    self.model, self.tokenizer, prompts, stop=until or None, mask_token_id=self.mask_token_id,
                    chat_template=False, settings=self.settings.replace(max_new_tokens=max_new),
                )
                elapsed = time.perf_counter() - t0
                self.generate_calls += 1
                stats.generated_tokens += int(sum(result.stats.per_row_tokens))
                stats.row_forwards += int(sum(result.stats.per_row_forwards))
                stats.batch_forwards += int(result.stats.forwards)
                stats.seconds += float(result.stats.seconds or elapsed)
                stats.requests += len(batch)
                for j, i in enumerate(batch):
                    text = _cut(result.texts[j], until)  # the decoder cuts too; cheap belt and braces
                    outputs[i] = text
                    self.records[(task, int(requests[i].doc_id))] = RequestRecord(
                        tokens=int(result.stats.per_row_tokens[j]),
                        forwards=int(result.stats.per_row_forwards[j]),
                        finish_reason=str(result.finish_reasons[j]),
                        text=text,
                    )
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(batch))
        bar.close()
        return [o if o is not None else "" for o in outputs]

    # ------------------------------------------------------------------ likelihoods (plain AR forward)
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = []
        for _, context_enc, continuation_enc in tqdm(requests, desc="loglikelihood", disable=disable_tqdm):
            ids = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1) :][:-1]
            n = len(continuation_enc)
            logits = self.model(torch.tensor([ids], device=self.device)).logits[0, -n:].float()
            logprobs = F.log_softmax(logits, dim=-1)
            target = torch.tensor(continuation_enc, device=self.device)
            score = logprobs.gather(1, target[:, None]).sum().item()
            greedy = bool((logprobs.argmax(-1) == target).all().item())
            results.append((score, greedy))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for (string,) in tqdm([r.args for r in requests], desc="loglikelihood_rolling", disable=disable_tqdm):
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1,
                )
            ]
            scores = self._loglikelihood_tokens([(None, a, b) for a, b in windows], disable_tqdm=True)
            out.append(sum(s for s, _ in scores))
        return out


def _cut(text: str, until: list[str]) -> str:
    cuts = [text.find(u) for u in until if u in text]
    return text[: min(cuts)] if cuts else text
