"""One vLLM engine run, in the environment that has vLLM (``.venv-vllm``): ``python -m mars.integrations.vllm_runner
JOB.json OUT.json``.  The rest of the project never imports vLLM; it writes a job, runs this in vLLM's interpreter
(:func:`mars.integrations.vllm_env.run_job`) and reads the result.

A job names the target model, the prompts (token-id lists), the generated-token budget and, per run, an optional
drafter (``{"model": <folder>, "k": K}``: vLLM's parallel drafting, ``method: draft_model``).  All runs of a job
share one process; each run starts its own engine (a drafter is part of the engine's configuration).  For each run
the result holds the generated ids per prompt, the start-up and generation seconds, vLLM's spec-decode counters
(drafts, draft tokens, accepted tokens, accepted per position) and, with ``record`` set, every step's proposals per
prompt: the position of the bonus token, the bonus and the K drafts, read from the proposer in this process.

Engine settings for a small CPU: batch 1 (``max_num_seqs=1``, Spec-Bench's setting), fp32, eager mode with
compilation off unless the job asks for ``compile``, a small KV cache (``VLLM_CPU_KVCACHE_SPACE``, GiB), prefix
caching off (every prompt computes its own prefill, as the project's engine does).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from mars.integrations.vllm_plugin import vllm_missing_message


def _metrics(llm) -> dict[str, Any]:
    """vLLM's spec-decode counters (cumulative for the engine)."""
    out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_position": []}
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    }
    for metric in llm.get_metrics():
        if metric.name in names:
            out[names[metric.name]] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = [int(v) for v in metric.values]
            have = out["accepted_per_position"]
            out["accepted_per_position"] = [a + b for a, b in zip(values, have + [0] * (len(values) - len(have)))]
    return out


class ProposalRecorder:
    """Wraps the draft proposer's ``propose`` (engine in this process) to keep, per call of a batch-1 engine, the
    bonus token's position, the bonus token and the drafts."""

    def __init__(self):
        self.steps: list[dict[str, Any]] = []
        self._original = None

    def install(self) -> None:
        from vllm.v1.spec_decode.draft_model import DraftModelProposer

        original = DraftModelProposer.propose
        recorder = self

        def propose(proposer, num_speculative_tokens, target_token_ids, target_positions, *args, **kwargs):
            drafts = original(proposer, num_speculative_tokens, target_token_ids, target_positions, *args, **kwargs)
            names = ("target_hidden_states", "next_token_ids", "token_indices_to_sample", "common_attn_metadata")
            given = dict(zip(names, args)) | kwargs
            cad = given["common_attn_metadata"]
            rejected = given.get("num_rejected_tokens_gpu")
            count = int(cad.query_start_loc[1]) - 1 - (int(rejected[0]) if rejected is not None else 0)
            recorder.steps.append(
                {
                    "bonus_position": int(target_positions[count]) + 1,
                    "bonus": int(given["next_token_ids"][0]),
                    "drafts": [int(t) for t in drafts[0].tolist()],
                }
            )
            return drafts

        self._original = original
        DraftModelProposer.propose = propose

    def take(self) -> list[dict[str, Any]]:
        steps, self.steps = self.steps, []
        return steps


def check_pair(target: str, drafter: str) -> None:
    """Refuse, before an engine starts, a drafter whose tokenizer differs from the target's (naming both)."""
    from transformers import AutoTokenizer

    from mars.integrations.export import check_same_vocabulary

    config = json.loads((Path(drafter) / "config.json").read_text())
    draft_tokenizer = AutoTokenizer.from_pretrained(drafter)
    mask = (
        draft_tokenizer.convert_ids_to_tokens(int(config.get("mask_token_id", -1))) if "mask_token_id" in config else ""
    )
    check_same_vocabulary(
        draft_tokenizer, AutoTokenizer.from_pretrained(target), draft=drafter, target=target, mask_token=mask or ""
    )


def _engine(job: dict[str, Any], run: dict[str, Any]):
    from vllm import LLM

    drafter = run.get("drafter")
    if drafter:
        check_pair(job["model"], drafter["model"])
    kwargs: dict[str, Any] = dict(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        max_model_len=int(job.get("max_model_len", 1024)),
        max_num_seqs=1,
        seed=0,
        enable_prefix_caching=False,
        disable_log_stats=False,
        enforce_eager=not run.get("compile", False),
    )
    if not run.get("compile", False):
        kwargs["compilation_config"] = {"mode": 0}
    if drafter:
        kwargs["speculative_config"] = {
            "model": drafter["model"],
            "method": "draft_model",
            "parallel_drafting": True,
            "num_speculative_tokens": int(drafter["k"]),
        }
    return LLM(**kwargs)


def _generate_each(llm, prompts, params, recorder: ProposalRecorder):
    """Each prompt generated on its own (batch 1, so each step's proposals belong to that prompt): the generated
    ids and the recorded proposals per prompt, the generated-token total and the generation seconds."""
    outputs, proposals = [], []
    generated = 0
    seconds = 0.0
    for prompt in prompts:
        recorder.take()
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        seconds += time.perf_counter() - t0
        proposals.append(recorder.take())
        outputs.append([int(t) for t in out.token_ids])
        generated += len(out.token_ids)
    return outputs, proposals, generated, seconds


def _spec_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The spec-decode counters one run added (vLLM's are cumulative for the engine)."""
    spec = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}
    spec["accepted_per_position"] = [
        a - b
        for a, b in zip(
            after["accepted_per_position"],
            before["accepted_per_position"] + [0] * len(after["accepted_per_position"]),
        )
    ]
    return spec


def _run(job: dict[str, Any], run: dict[str, Any], prompts, params, recorder: ProposalRecorder) -> dict[str, Any]:
    """One run of ``job`` on an engine of its own, freed before the next run starts its engine."""
    started = time.perf_counter()
    llm = _engine(job, run)
    ready = time.perf_counter()
    before = _metrics(llm)
    outputs, proposals, generated, seconds = _generate_each(llm, prompts, params, recorder)
    spec = _spec_delta(before, _metrics(llm))
    result = {
        "name": run["name"],
        "drafter": run.get("drafter"),
        "compile": bool(run.get("compile", False)),
        "startup_s": ready - started,
        "generate_s": seconds,
        "generated_tokens": generated,
        "tokens_per_s": generated / seconds if seconds > 0 else None,
        "outputs": outputs,
        "spec": spec,
        "proposals": proposals if run.get("record") else None,
    }
    del llm
    import gc

    gc.collect()
    return result


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise ImportError(vllm_missing_message()) from err
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    recorder = ProposalRecorder()
    if any(run.get("record") for run in job["runs"]):
        recorder.install()
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in job["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=int(job["max_tokens"]), ignore_eos=bool(job.get("ignore_eos")))
    results = [_run(job, run, prompts, params, recorder) for run in job["runs"]]
    return {"vllm_version": vllm.__version__, "runs": results}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit("usage: python -m mars.integrations.vllm_runner JOB.json OUT.json")
    job = json.loads(Path(args[0]).read_text())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the proposer runs in this process (recording)
    result = run_job(job)
    Path(args[1]).write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
