"""Where verified decoding's wall clock goes at batch 1, against AR in the same engine: the model forward's
time per step by the number of columns it carried (and whether the gated adapter was live at mask columns),
the tokens per forward and speed against AR, and whether a step whose masks proposed no
draft predicts the next one (which decides whether skipping the masks after a miss could pay).

    mars-bench step-breakdown --model <checkpoint>/hf --prompts 4 --repeats 5 --adapter-ranks 8,4 \
        --out results/step_cost_cpu/breakdown

Decoders are interleaved per repeat; figures are medians over repeats (the first repeat warms up and is
dropped).  Writes ``breakdown.md`` and ``breakdown.json``.
"""

from __future__ import annotations

import collections
import copy
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mars.hardware import apply_process_defaults

apply_process_defaults()  # the OpenMP wait for this machine's load unless set, before torch loads libgomp

import torch  # noqa: E402

from mars.bench import cli_options  # noqa: E402
from mars.bench.decoders import VERIFIED  # noqa: E402
from mars.hardware import configure_threads  # noqa: E402
from mars.paths import data_dir  # noqa: E402

if TYPE_CHECKING:
    from mars.decoding.step import StepReport

DECODERS = {
    "ar-cursor": dict(decoder="mars", cache="cursor", threshold=1.0),
    "verify": VERIFIED,  # the throughput command's lossless decoder
    "verify, masks after drafts": {**VERIFIED, "chain_drafts": "always"},
    "verify window 3": {**VERIFIED, "window": 3},
    "verify window 2": {**VERIFIED, "window": 2},
}


@dataclass(frozen=True)
class StepRecord:
    """One engine step as :class:`Recorder` saw it (this tool decodes one row; with more, ``drafts`` and ``verified``
    are summed over the rows and ``masks`` is any row's)."""

    columns: int  # the columns the step fed (the plan's input width)
    masks: bool  # whether it fed a mask column (where a gated adapter is live)
    seconds: float  # the step's model forward
    drafts: int  # the drafts it fed
    verified: int  # of those, the drafts it emitted


class Recorder:
    """An engine step observer (``generate(..., observers=[recorder])``): one :class:`StepRecord` per forward,
    prefill included.  It reads each step's :class:`~mars.decoding.step.StepReport` and changes nothing."""

    def __init__(self):
        self.steps: list[StepRecord] = []

    def __call__(self, report: StepReport) -> None:
        plan = report.plan
        # a MARS row's predictions are its AR column, its drafts and its masks; a tree row feeds a group of masks
        masks = bool((plan.predictions - 1 - plan.drafts > 0).any() or plan.tree_rows.any())
        drafts, verified = int(plan.drafts.sum()), int(report.verified.sum())
        self.steps.append(StepRecord(plan.input_width, masks, report.forward_seconds, drafts, verified))

    def clear(self) -> None:
        self.steps.clear()

    def draft_trace(self) -> list[tuple[int, int]]:
        """Each step's (drafts fed, passed), as :func:`draft_transitions` reads them."""
        return [(s.drafts, s.verified) for s in self.steps]


def has_gated_adapter(model) -> bool:
    """Whether ``model`` carries a gated adapter (:mod:`mars.adapters`), live at mask columns only."""
    return getattr(model, "mars_gate", None) is not None


def draft_transitions(traces: list[list[tuple[int, int]]]) -> dict:
    """P(step t+1's masks propose a draft | step t's did or did not); a step's masks proposed a draft when
    the next step fed one."""
    counts = collections.Counter()
    for trace in traces:
        proposed = [fed > 0 for fed, _ in trace[1:]]
        counts.update(zip(proposed, proposed[1:]))
    after = {prev: counts[prev, True] / max(1, counts[prev, True] + counts[prev, False]) for prev in (False, True)}
    total = sum(counts.values())
    return {
        "p_draft": sum(v for (_, nxt), v in counts.items() if nxt) / max(1, total),
        "p_draft_after_none": after[False],
        "p_draft_after_draft": after[True],
        "transitions": total,
    }


def build_parser():
    p = cli_options.parser("mars-bench step-breakdown", __doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts-file", default=str(data_dir() / "prompts" / "heldout.jsonl"))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--trace-prompts", type=int, default=16, help="prompts for the (untimed) draft statistics")
    p.add_argument("--trace-tokens", type=int, default=96)
    p.add_argument("--threads", default="auto")
    p.add_argument(
        "--adapter-ranks",
        default="",
        help="also time verify with the gated adapter truncated to each of these ranks (comma-separated)",
    )
    p.add_argument(
        "--checkpoints",
        default="",
        help="also time verify on these checkpoints, each loaded as --model is (comma-separated; e.g. the same "
        "adapter at a lower rank, from python -m mars.training.adapter_rank, or --model again to see what a second "
        "copy in memory changes)",
    )
    p.add_argument(
        "--decoders",
        default=";".join(DECODERS),
        help=f"a subset of {list(DECODERS)}, separated by ';' (ar-cursor always)",
    )
    cli_options.add_out(p, "results/step_cost_cpu/breakdown")
    return p


def load_decoders(args, chosen: list[str]) -> tuple[dict, object]:
    """decoder name -> (model, generate kwargs): the chosen decoders on ``--model``, then verify on each of
    ``--checkpoints`` and on each ``--adapter-ranks`` truncation; and the tokenizer."""
    from mars.adapters import truncate_adapter_rank
    from mars.models import load_model

    lm = load_model(args.model, dtype=torch.float32)
    model, tokenizer = lm.model.eval(), lm.tokenizer
    decoders = {name: (model, DECODERS[name]) for name in chosen}
    for i, folder in enumerate(c for c in args.checkpoints.split(",") if c):
        other = load_model(folder, dtype=torch.float32).model.eval()
        decoders[f"verify, checkpoint {i + 1} ({Path(folder).name})"] = (other, DECODERS["verify"])
    for rank in (int(r) for r in args.adapter_ranks.split(",") if r):
        truncated = copy.deepcopy(model)
        kept = truncate_adapter_rank(truncated, rank)
        print(f"rank {rank}: every product keeps >= {kept:.1%} of its energy")
        decoders[f"verify, adapter rank {rank}"] = (truncated, DECODERS["verify"])
    return decoders, tokenizer


def time_decoders(args, decoders: dict, tokenizer, prompts: list[str], rec: Recorder) -> tuple[dict, dict]:
    """Every decoder on every prompt, interleaved per repeat (repeat 0 warms up and is dropped):
    decoder -> per repeat (seconds, tokens, decode steps, forward seconds), and
    (decoder, columns, adapter live) -> the model forward's seconds of each decode step."""
    from mars.decoding import generate

    runs = collections.defaultdict(list)
    steps = collections.defaultdict(list)
    for repeat in range(args.repeats + 1):
        for name, (decoder_model, kwargs) in decoders.items():
            gated = has_gated_adapter(decoder_model)
            seconds = tokens = forwards = forward_seconds = 0.0
            for prompt in prompts:
                rec.clear()
                start = time.perf_counter()
                result = generate(
                    decoder_model,
                    tokenizer,
                    [prompt],
                    max_new_tokens=args.max_new_tokens,
                    chat_template=True,
                    observers=[rec],
                    **kwargs,
                )
                seconds += time.perf_counter() - start
                tokens += sum(len(t) for t in result.token_ids)
                decode_steps = rec.steps[1:]  # the prompt's prefill is not a decode step
                forwards += len(decode_steps)
                forward_seconds += sum(s.seconds for s in decode_steps)
                if repeat:
                    for s in decode_steps:
                        steps[name, s.columns, s.masks and gated].append(s.seconds)
            if repeat:
                runs[name].append((seconds, tokens, forwards, forward_seconds))
    return runs, steps


def trace_drafts(args, model, tokenizer, prompts: list[str], rec: Recorder) -> list[list[tuple[int, int]]]:
    """Each of the first ``--trace-prompts`` prompts decoded by ``verify``: its steps' (drafts fed, passed)."""
    from mars.decoding import generate

    traces = []
    for prompt in prompts[: args.trace_prompts]:
        rec.clear()
        generate(
            model,
            tokenizer,
            [prompt],
            max_new_tokens=args.trace_tokens,
            chat_template=True,
            observers=[rec],
            **DECODERS["verify"],
        )
        traces.append(rec.draft_trace())
    return traces


def summarise(runs: dict, prompts: int) -> dict:
    """decoder -> tokens/s, tokens per forward (prefills counted), forward ms per decode step, seconds (medians)."""
    summary = {}
    for name, rs in runs.items():
        seconds = statistics.median(r[0] for r in rs)
        tokens, forwards = rs[0][1], rs[0][2]
        summary[name] = dict(
            tokens_per_s=tokens / seconds,
            tokens_per_forward=tokens / (forwards + prompts),
            forward_ms_per_step=1e3 * statistics.median(r[3] / r[2] for r in rs),
            seconds=seconds,
        )
    return summary


def breakdown_table(args, threads: int, prompts: int, summary: dict, steps: dict, transitions: dict) -> list[str]:
    """``breakdown.md``'s lines: speed per decoder, model forward time per step kind, the draft statistics."""
    ar = summary["ar-cursor"]
    ar_step = statistics.median(steps["ar-cursor", 1, False])
    table = [
        f"# Verified decoding at batch 1: where the time goes\n\nmodel `{args.model}`, float32, {threads} threads, "
        f"{prompts} prompts of `{args.prompts_file}`, {args.max_new_tokens} new tokens, {args.repeats} repeats "
        "(median), decoders interleaved.\n",
        "| decoder | tokens/s | vs AR | tok/fwd | (vs AR) / (tok/fwd) |",
        "|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        speedup = s["tokens_per_s"] / ar["tokens_per_s"]
        table.append(
            f"| {name} | {s['tokens_per_s']:.1f} | {speedup:.2f}x | {s['tokens_per_forward']:.2f} | "
            f"{speedup / s['tokens_per_forward']:.2f} |"
        )
    table += [
        "",
        "| decoder | columns | adapter live | decode steps | forward ms | vs AR step |",
        "|---|---|---|---|---|---|",
    ]
    for (name, columns, adapter), times in sorted(steps.items()):
        ms = statistics.median(times)
        table.append(
            f"| {name} | {columns} | {'yes' if adapter else 'no'} | {len(times)} | {ms * 1e3:.1f} | {ms / ar_step:.2f}x |"
        )
    table += [
        "",
        f"Draft statistics ({args.trace_prompts} prompts, {args.trace_tokens} new tokens, `verify`): the masks of "
        f"{transitions['p_draft']:.2f} of {transitions['transitions']} steps proposed a draft; after a step that "
        f"proposed none {transitions['p_draft_after_none']:.2f}, after one that proposed "
        f"{transitions['p_draft_after_draft']:.2f}.",
    ]
    return table


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    chosen = ["ar-cursor"] + [d for d in args.decoders.split(";") if d and d != "ar-cursor"]
    unknown = sorted(set(chosen) - set(DECODERS))
    if unknown:
        p.error(f"--decoders: unknown {unknown}; known: {list(DECODERS)}")
    every = [
        row.prompt for row in cli_options.prompt_rows(args.prompts_file, "--prompts-file")
    ]  # before the model loads
    threads = configure_threads(args.threads)
    decoders, tokenizer = load_decoders(args, chosen)
    model = decoders["ar-cursor"][0]
    prompts = every[: args.prompts]
    rec = Recorder()
    with torch.inference_mode():
        runs, steps = time_decoders(args, decoders, tokenizer, prompts, rec)
        traces = trace_drafts(args, model, tokenizer, every, rec)
    summary = summarise(runs, len(prompts))
    transitions = draft_transitions(traces)
    table = breakdown_table(args, threads, len(prompts), summary, steps, transitions)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "breakdown.md").write_text("\n".join(table) + "\n")
    (out / "breakdown.json").write_text(
        json.dumps(dict(summary=summary, transitions=transitions, model=args.model, threads=threads), indent=1)
    )
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
