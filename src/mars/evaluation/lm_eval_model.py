"""The lm-eval model (``MarsLM``, registered with lm-eval as ``mars``): generation through ``mars.decoding``,
likelihoods through a plain AR forward.  (Not to be confused with :mod:`mars.adapters`, the gated LoRA
adapters of a checkpoint.)

lm-eval hands ``generate_until`` every request of every task at once (decoded by
:mod:`mars.evaluation.lm_eval_requests`).  The model groups them by
task and generation settings (so timing and tokens per forward are attributable to one task), sorts
each group by prompt length (less padding), decodes it in batches at the current threshold, and keeps
each request's decoder statistics in ``records`` keyed by ``(task, doc_id)``: the generated token ids,
per token whether it was accepted from a mask prediction (``from_mask``), and with ``fidelity=True``
how many tokens equal the model's own greedy AR choice given the output's prefix
(:mod:`mars.evaluation.fidelity`; one extra forward per batch, timed apart from the decoder).  The decoder
applies lm-eval's ``until`` stop strings itself (text cut before the first stop string) and the
per-request ``max_gen_toks``, capped at the configured ``max_new_tokens`` (the paper's 256).

Resume: given a results folder (``use_results_dir``), every decoded batch is appended to the point's
partial cache (store.RequestCache) and a request found there is not decoded again, so a killed run
resumes at (threshold, task, sample).  A sweep moves the model from point to point: ``set_threshold`` (the
sweep's settings at a threshold) and ``set_verify`` (the verify point's own settings, kept under its own point).

Data parallel: launched by ``torchrun``/``accelerate launch`` (``WORLD_SIZE`` > 1) the model joins the
process group through accelerate (as lm-eval's HFLM does) and reports its rank and world size; lm-eval
then gives each rank every world_size-th document and gathers the per-sample metrics on rank 0 through
``all_gather``/``gather_object``/``barrier`` below.

Command line: lm-eval 0.4.13 has no plugin mechanism, so its own ``lm_eval`` only knows models that are
imported before it parses; ``mars-lm-eval`` (:mod:`mars.cli.lm_eval` over :func:`lm_eval_main`) is lm-eval's CLI
with this model registered, taking all of its flags.  It adds the decoder's headline figure to lm-eval's
results (file and printed table): ``tokens_per_forward`` per task, and pooled over the tasks of each group
(under verify also ``mean_acceptance_length``)::

    mars-lm-eval --model mars --model_args pretrained=<dir>,threshold=0.9 --tasks mars_math \\
        --include_path eval/offline --apply_chat_template
    torchrun --nproc-per-node 8 --no-python mars-lm-eval --model mars ...      # data parallel
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from mars.decoding.settings import DecodingSettings
from mars.evaluation.lm_eval_requests import GenerationRequests, TaskStats
from mars.evaluation.store import VERIFY

log = logging.getLogger(__name__)


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes")
    return bool(value)


def _adopt_trained_block_size(settings: dict[str, Any], trained: int | None) -> None:
    """Decode with the block size the checkpoint was trained with unless one is asked for (then warn when
    the two differ)."""
    if trained and not settings.get("block_size"):
        settings["block_size"] = int(trained)
    elif trained:
        from mars.evaluation.config import block_size_mismatch

        warning = block_size_mismatch(trained, int(settings["block_size"]))
        if warning:
            log.warning(warning)


def _requested_settings(
    decoding: dict[str, Any] | None, decoding_kwargs: dict[str, Any], batch_size: Any, max_new_tokens: int | None
) -> tuple[dict[str, Any], int]:
    """The decoding settings MarsLM's arguments ask for (``decoding`` with the keyword fields over it, not yet
    validated) and its batch size (8 unless a number is given: lm-eval's "auto" means nothing here)."""
    settings = dict(decoding or {})
    settings.update({k: v for k, v in decoding_kwargs.items() if v is not None})
    batch = batch_size or settings.pop("batch_size", None) or 8
    settings.pop("batch_size", None)
    if max_new_tokens is not None:
        settings["max_new_tokens"] = max_new_tokens
    return settings, int(batch) if str(batch).isdigit() else 8


@register_model("mars")
class MarsLM(GenerationRequests, TemplateLM):
    """lm-eval model backed by a MARS-capable causal LM.

    Build it from a loaded model (``MarsLM(model=..., tokenizer=..., mask_token_id=...)``) or, from
    lm-eval's CLI (``mars-lm-eval``), with ``--model mars --model_args pretrained=<dir or hub
    id>,threshold=0.9,block_size=4,fidelity=true``; every other key is a :class:`DecodingSettings`
    field (validated there).  How it decodes ``generate_until`` requests and what it records of them:
    :class:`~mars.evaluation.lm_eval_requests.GenerationRequests`.
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
        dtype: str | None = None,
        fidelity: bool | str = False,
        **decoding_kwargs: Any,
    ) -> None:
        super().__init__()
        self._init_distributed()
        settings, self.batch_size = _requested_settings(decoding, decoding_kwargs, batch_size, max_new_tokens)
        # validated before a model is loaded: a typo costs nothing
        DecodingSettings.from_mapping(settings, threshold=float(threshold)).check_every_row()
        if model is None:
            if pretrained is None:
                raise ValueError("MarsLM needs a model (model=..., tokenizer=...) or pretrained=<path or hub id>")
            model, tokenizer, mask_token_id = self._load_pretrained(str(pretrained), device, dtype, settings)
        if tokenizer is None:
            raise ValueError("MarsLM needs the model's tokenizer")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.mask_token_id = mask_token_id if mask_token_id is not None else tokenizer.mask_token_id
        # one validated object (mars.decoding.settings); the threshold is set per sweep point
        self.settings = DecodingSettings.from_mapping(settings, threshold=float(threshold))
        self._sweep_settings = self.settings  # the thresholds' settings, kept while the verify point decodes
        self.point: float | str = self.settings.threshold  # the results folder's point being decoded
        self.max_new_tokens = self.settings.max_new_tokens
        self.threshold = self.settings.threshold
        self.fidelity = _as_bool(fidelity)
        self._max_length = max_length
        self.thresholds_to_run = 1  # set by a sweep: thresholds left, this one included (the time estimate)
        self._eta: _Eta | None = None
        self._init_requests()

    def _load_pretrained(self, pretrained: str, device: str | None, dtype: str | None, settings: dict[str, Any]):
        """Model, tokenizer and mask token id of a checkpoint folder or hub id, on this rank's device; the
        block size it was trained with becomes the decoding default (``settings`` is updated)."""
        from mars.decoding.loading import load_for_decoding
        from mars.hardware import resolve_device

        where = resolve_device(device)
        if where.startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's CLI asks for cuda by default; like its HF model, fall back to the CPU
            log.warning("device %s requested but no CUDA device is available: using the CPU", where)
            where = "cpu"
        if self._world_size > 1 and where == "cuda":
            where = str(self.accelerator.device)  # this rank's GPU
        loaded = load_for_decoding({"name_or_path": pretrained}, dtype=dtype or "float32", device=where)
        _adopt_trained_block_size(settings, (loaded.metadata or {}).get("block_size"))
        return loaded.model, loaded.tokenizer, loaded.mask.id

    # ------------------------------------------------------------------ data parallel
    def _init_distributed(self) -> None:
        """Join the process group that torchrun / accelerate launch set up (``WORLD_SIZE`` > 1) through
        accelerate, as lm-eval's HFLM does.  One process builds no Accelerator and joins no group."""
        self.accelerator = None
        self._rank, self._world_size = 0, 1
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return
        from datetime import timedelta

        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs

        threads = torch.get_num_threads()
        # HFLM's timeout: the other ranks may wait at a collective while rank 0 writes a point's results.
        # cpu=True where there is no CUDA: without it accelerate would not treat torchrun's CPU processes as
        # data parallel (its type NO: every gather a no-op); with it they join over gloo.
        self.accelerator = Accelerator(
            cpu=not torch.cuda.is_available(), kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(weeks=52))]
        )
        torch.set_num_threads(threads)  # accelerate picks its own on CPU when OMP_NUM_THREADS is unset
        self._rank, self._world_size = self.accelerator.process_index, self.accelerator.num_processes
        log.info("data parallel: rank %d of %d", self._rank, self._world_size)
        # a gloo group still alive at interpreter exit can abort the rank ("terminate called without an active
        # exception", exit code -6), failing a finished evaluation
        atexit.register(_leave_process_group)

    def all_gather(self, tensor):
        """Every rank's ``tensor`` concatenated along the first dimension (a 0-d tensor counts as one)."""
        if self._world_size <= 1:
            return tensor
        return self.accelerator.gather(tensor)

    def gather_object(self, obj, dst: int = 0):
        """Every rank's ``obj`` in rank order on rank ``dst``, None elsewhere."""
        if self._world_size <= 1:
            return [obj]
        from accelerate.utils import gather_object

        parts = gather_object([obj])  # an all-gather of one-item lists: works on gloo and nccl alike
        return parts if self._rank == dst else None

    def barrier(self) -> None:
        if self._world_size > 1:
            self.accelerator.wait_for_everyone()

    # ------------------------------------------------------------------ bookkeeping
    def set_threshold(self, threshold: float) -> None:
        """Decode the sweep's point at ``threshold``."""
        self.settings = self._sweep_settings.replace(threshold=float(threshold))
        self.threshold = self.point = self.settings.threshold

    def set_verify(self, settings: DecodingSettings) -> None:
        """Decode the verify point: its own settings, its generations cached under its own point."""
        self.settings, self.threshold, self.point = settings, settings.threshold, VERIFY

    @property
    def point_label(self) -> str:
        """The point being decoded, as the progress bar and the time estimate name it."""
        return f"verify tau={self.threshold:g}" if self.point == VERIFY else f"tau={self.threshold:g}"

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

        kwargs = dict(
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )
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
        return {
            "model_name": getattr(self.model.config, "_name_or_path", ""),
            **self.settings.as_dict(),
            "fidelity": self.fidelity,
        }

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Every request's text: decoded group by group (GenerationRequests), with a progress bar and, on rank 0,
        the point's time estimate."""
        outputs: list[str | None] = [None] * len(requests)
        groups = self._group_requests(requests)
        bar = tqdm(total=len(requests), desc=f"generate {self.point_label}", disable=disable_tqdm)
        self._eta = _Eta(len(requests), self.point_label, self.thresholds_to_run) if self._rank == 0 else None
        partial: dict[str, dict[str, dict]] = {}
        for (task, _), members in groups.items():
            self._generate_group(requests, task, members, outputs, bar, partial)
        bar.close()
        return [o if o is not None else "" for o in outputs]

    # ------------------------------------------------------------------ likelihoods (plain AR forward)
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """Batched (right padding, longest first): each continuation's summed log-probability and
        whether it is the greedy continuation."""
        items = []
        for _, context_enc, continuation_enc in requests:
            ids = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1) :][:-1]
            items.append((ids, list(continuation_enc)))
        results: list[tuple[float, bool] | None] = [None] * len(items)
        order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
        bar = tqdm(total=len(items), desc="loglikelihood", disable=disable_tqdm)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            width = max(len(items[i][0]) for i in batch)
            ids = torch.full((len(batch), width), int(self.eot_token_id or 0), dtype=torch.long)
            att = torch.zeros((len(batch), width), dtype=torch.long)
            for r, i in enumerate(batch):
                seq = items[i][0]
                ids[r, : len(seq)] = torch.tensor(seq)
                att[r, : len(seq)] = 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=att.to(self.device)).logits
            for r, i in enumerate(batch):
                seq, cont = items[i]
                n = len(cont)
                logprobs = F.log_softmax(logits[r, len(seq) - n : len(seq)].float(), dim=-1)
                target = torch.tensor(cont, device=logprobs.device)
                score = logprobs.gather(1, target[:, None]).sum().item()
                greedy = bool((logprobs.argmax(-1) == target).all().item())
                results[i] = (score, greedy)
            bar.update(len(batch))
        bar.close()
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for (string,) in tqdm([r.args for r in requests], desc="loglikelihood_rolling", disable=disable_tqdm):
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            scores = self._loglikelihood_tokens([(None, a, b) for a, b in windows], disable_tqdm=True)
            out.append(sum(s for s, _ in scores))
        return out


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class _Eta:
    """The time a threshold's generations will take, estimated once from the first decoded batch (the
    longest prompts of the first task: an estimate on the high side) and logged as one line."""

    def __init__(self, total: int, label: str, thresholds: int):
        self.total, self.label, self.thresholds = total, label, max(1, int(thresholds))
        self.resumed, self.done, self.logged = 0, 0, False
        self.start = time.perf_counter()

    def decoded(self, n: int) -> None:
        self.done += n
        todo = self.total - self.resumed
        if self.logged or self.done >= todo:  # finished already: nothing left to estimate
            return
        self.logged = True
        each = (time.perf_counter() - self.start) / self.done
        line = (
            f"{self.label}: about {_duration(each * todo)} per threshold for {todo:,} requests "
            f"({each:.2f} s each over the first {self.done})"
        )
        if self.thresholds > 1:
            line += f"; {self.thresholds} thresholds to run: about {_duration(each * todo * self.thresholds)} in all"
        log.info(line)


TOKENS_PER_FORWARD = "tokens_per_forward,none"  # lm-eval's "<metric>,<filter>" key
MEAN_ACCEPTANCE_LENGTH = "mean_acceptance_length,none"


def _leaves(name: str, group_subtasks: dict[str, list[str]]) -> list[str]:
    children = group_subtasks.get(name)
    if not children:
        return [name]
    return [leaf for child in children for leaf in _leaves(child, group_subtasks)]


def add_decoder_stats(results: dict[str, Any], stats: dict[str, TaskStats]) -> None:
    """Put tokens per forward beside lm-eval's metrics in its ``results`` (and ``groups``): per task, and
    for a group the pooled figure of its tasks (their generated tokens over their forwards, the figure
    evaluate.py reports); under verify, vLLM's mean acceptance length beside it, pooled the same way.  Tasks
    without generations (log-likelihood only) get none."""
    for section in ("results", "groups"):
        for name, metrics in (results.get(section) or {}).items():
            parts = [stats[leaf] for leaf in _leaves(name, results.get("group_subtasks") or {}) if leaf in stats]
            forwards = sum(s.row_forwards for s in parts)
            if not forwards:
                continue
            metrics[TOKENS_PER_FORWARD] = sum(s.generated_tokens for s in parts) / forwards
            better = results.setdefault("higher_is_better", {}).setdefault(name, {})
            better["tokens_per_forward"] = True
            drafts = sum(s.num_drafts for s in parts)
            if drafts:
                metrics[MEAN_ACCEPTANCE_LENGTH] = 1 + sum(s.num_accepted_tokens for s in parts) / drafts
                better["mean_acceptance_length"] = True


def _gathered_stats(lm: MarsLM) -> dict[str, TaskStats]:
    """Every rank's task statistics summed (data parallel); this process's alone otherwise."""
    parts = lm.gather_object({task: s.__dict__ for task, s in lm.task_stats.items()}, dst=0)
    total: dict[str, TaskStats] = defaultdict(TaskStats)
    for part in parts or []:
        for task, values in part.items():
            for key, value in values.items():
                setattr(total[task], key, getattr(total[task], key) + value)
    return total


def _lm_eval_default_device() -> str | None:
    """The device lm-eval's CLI fills in when ``--device`` is not given (``cuda:0`` in lm-eval 0.4.13)."""
    import dataclasses

    from lm_eval.config.evaluate_config import EvaluatorConfig

    return next((f.default for f in dataclasses.fields(EvaluatorConfig) if f.name == "device"), None)


def names_a_device(argv: list[str]) -> bool:
    """Whether an lm-eval command line asks for a device itself (``--device X`` or ``--device=X``)."""
    return any(arg == "--device" or arg.startswith("--device=") for arg in argv)


def cap_generation_kwargs(tasks: dict[str, Any], lm: MarsLM) -> None:
    """Write each generating task's effective token budget into its ``generation_kwargs`` (the smaller of the
    task's ``max_gen_toks`` and the model's ``max_new_tokens``), so that what lm-eval logs and records is what
    the decoder does (lm-eval's HF model likewise records the ``max_gen_toks`` it generated with)."""
    for task in tasks.values():
        if task.get_config("output_type") != "generate_until":
            continue
        kwargs = dict(task.get_config("generation_kwargs") or {})
        task.set_config(key="generation_kwargs", value={**kwargs, "max_gen_toks": lm._max_new(kwargs)})


def _capped_cli_gen_kwargs(gen_kwargs: Any, lm: MarsLM) -> Any:
    """``--gen_kwargs max_gen_toks=N`` replaces the tasks' budgets after they load: cap it the same way."""
    if not gen_kwargs:
        return gen_kwargs
    if isinstance(gen_kwargs, str):
        from lm_eval.utils import simple_parse_args_string

        gen_kwargs = simple_parse_args_string(gen_kwargs)
    if "max_gen_toks" not in gen_kwargs:
        return gen_kwargs
    return {**gen_kwargs, "max_gen_toks": lm._max_new(gen_kwargs)}


def _build_cli_model(model_args: Any, kwargs: dict[str, Any], device_given: bool) -> MarsLM:
    """The ``mars`` model as lm-eval's CLI would build it (its batch size and device), except that the device
    lm-eval fills in by default is no request: without ``--device`` the model picks one as ``device=auto``
    does (cuda when there is one), with no warning."""
    extra = {k: kwargs.get(k) for k in ("batch_size", "max_batch_size", "device")}
    if not device_given and extra["device"] == _lm_eval_default_device():
        extra["device"] = None
    if isinstance(model_args, dict):
        return MarsLM.create_from_arg_obj(model_args, extra)
    return MarsLM.create_from_arg_string(model_args or "", extra)


def _with_decoder_stats(simple_evaluate, device_given: bool = True):
    """lm-eval's ``simple_evaluate``, with the model's tokens per forward added to what it returns.

    For ``model="mars"`` the model is built here (:func:`_build_cli_model`), so that its statistics outlive
    the run (lm-eval drops its own reference), and the tasks' generation settings record the token budget
    the decoder applies (:func:`cap_generation_kwargs`)."""

    from mars.logs import folded_lm_eval_task_logs

    def wrapped(*args, model=None, model_args=None, **kwargs):
        if model != "mars":
            with folded_lm_eval_task_logs():
                return simple_evaluate(*args, model=model, model_args=model_args, **kwargs)
        lm = _build_cli_model(model_args, kwargs, device_given)
        kwargs["gen_kwargs"] = _capped_cli_gen_kwargs(kwargs.get("gen_kwargs"), lm)
        manager = kwargs.get("task_manager")
        if manager is not None:  # the CLI passes its own; lm-eval logs the tasks' settings right after loading
            load = manager.load

            def load_capped(*a, **k):
                loaded = load(*a, **k)
                cap_generation_kwargs(loaded["tasks"], lm)
                return loaded

            manager.load = load_capped
        with folded_lm_eval_task_logs():  # one line per task, not four
            results = simple_evaluate(*args, model=lm, model_args=model_args, **kwargs)
        stats = _gathered_stats(lm)  # every rank takes part; only rank 0 holds results
        if results is not None:
            results["config"]["model"] = "mars"  # lm-eval names a pre-built model by its class
            add_decoder_stats(results, stats)
        return results

    return wrapped


def lm_eval_main(argv: list[str] | None = None) -> None:
    """``mars-lm-eval``: lm-eval's own command line with the ``mars`` model registered (every lm-eval
    flag works; ``--model mars --model_args pretrained=<dir>,threshold=0.9,...``), reporting tokens per
    forward per task in its results."""
    import sys

    import lm_eval
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    # lm-eval's CLI looks simple_evaluate up on the package when it runs: wrap it there, for this command only
    lm_eval.simple_evaluate = _with_decoder_stats(lm_eval.simple_evaluate, device_given=names_a_device(sys.argv[1:]))
    cli_evaluate()


def _leave_process_group() -> None:
    """Destroy the default process group if this process still has one (at exit, after lm-eval is done)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
