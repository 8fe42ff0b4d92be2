"""``python -m mars.integrations.vllm_bench --out results/vllm_cpu``: vLLM's AR, vLLM with the MARS drafter (the
gated adapter through the plugin, and the same adapter merged), K = 2, 3, 4, and this project's AR and verify, on
the same held-out prompts (batch 1, greedy, fp32) in one run.

Written to ``--out``: ``results.json`` (every output, vLLM's spec-decode counters, the step-by-step comparison
of vLLM's proposals with this project's mask predictions) and ``table.md``.  Without ``--timing``
(the default) it is an acceptance and identity run: tokens per second are recorded in ``results.json`` but left
out of the table, since they mean nothing on a busy machine; ``--timing`` puts them in (run it on a quiet machine).
vLLM runs in ``.venv-vllm`` (``make test-vllm`` builds it; ``MARS_VLLM_PYTHON`` names another interpreter).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

from mars.integrations.vllm_compare import compare_run, vllm_figures

ADAPTER = "adapters/smollm2-135m-mars-rank8"


def heldout_prompts(tokenizer, n: int) -> list[list[int]]:
    """The first ``n`` held-out prompts (data/prompts/heldout.jsonl, file order) as chat-templated token ids."""
    from mars.paths import data_dir

    rows = [json.loads(line) for line in (data_dir() / "prompts" / "heldout.jsonl").read_text().splitlines()[:n]]
    out = []
    for row in rows:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def project_runs(lm, prompts, max_tokens: int, ks: list[int]) -> list[dict[str, Any]]:
    """This project's AR (threshold 1.0), its default verify, and its verify chain at window K (K - 1 mask drafts
    after the bonus, masks after every step's drafts), each prompt on its own (batch 1, as vLLM runs here)."""
    from mars.decoding import generate

    configs = [("project AR", {}), ("project verify", {"verify": True})]
    chain = dict(verify=True, chain_drafts="always", verify_masks="all", tree="chain", draft_threshold=0.0)
    configs += [(f"project verify chain, window {k}", {**chain, "window": k}) for k in ks]
    runs = []
    for name, kwargs in configs:
        # one untimed call first: tree=auto's step-cost timing and the kernels' first use stay out of the figures,
        # as vLLM's start-up and warm-up do
        generate(lm.model, lm.tokenizer, [prompts[0]], max_new_tokens=8, **kwargs)
        outputs, tokens, forwards, seconds, drafts, accepted, by_position = [], 0, 0, 0.0, 0, 0, []
        layouts = set()
        for prompt in prompts:
            stats = (result := generate(lm.model, lm.tokenizer, [prompt], max_new_tokens=max_tokens, **kwargs)).stats
            outputs.append(result.token_ids[0])
            layouts.add(stats.extra.get("tree"))
            tokens, forwards, seconds = (
                tokens + stats.generated_tokens,
                forwards + stats.forwards,
                seconds + stats.seconds,
            )
            steps = stats.num_drafts or 0
            drafts, accepted = drafts + steps, accepted + (stats.num_accepted_tokens or 0)
            counts = [round(a * steps) for a in stats.acceptance_by_position or []]
            width = max(len(by_position), len(counts))
            by_position = [
                (by_position[d] if d < len(by_position) else 0) + (counts[d] if d < len(counts) else 0)
                for d in range(width)
            ]
        runs.append(
            {
                "name": name,
                "outputs": outputs,
                "tokens_per_s": tokens / seconds if seconds else None,
                "tokens_per_forward": tokens / forwards if forwards else None,
                "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                "acceptance_by_position": [c / drafts for c in by_position] if drafts else None,
                "tree": " ".join(sorted(t for t in layouts if t)) or None,  # verify's draft layout (auto's choice)
            }
        )
    return runs


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return " / ".join(f"{v:.{digits}f}" for v in value)
    return f"{value:.{digits}f}"


def _speed_ups(report: dict[str, Any]) -> dict[str, tuple[float | None, float | None]]:
    """Per run (vLLM's by their name prefixed ``vLLM``): its tokens/s over its own AR's in the same run (vLLM's AR
    of the same compilation mode; this project's AR) and over the fastest AR of the run, vLLM's or this project's."""

    def rate(run):
        return run.get("tokens_per_s")

    vllm = {f"vLLM {run['name']}": run for run in report["vllm"]["runs"]}
    project = {run["name"]: run for run in report["project"]}
    ars = [rate(r) for name, r in {**vllm, **project}.items() if name.startswith(("vLLM AR", "project AR")) and rate(r)]
    best = max(ars, default=None)
    out = {}
    for name, run in {**vllm, **project}.items():
        if name.startswith("vLLM"):
            own = vllm.get("vLLM AR, compiled" if run.get("compile") else "vLLM AR")
        else:
            own = project.get("project AR")
        own_rate = rate(own) if own else None
        mine = rate(run)
        out[name] = (mine / own_rate if mine and own_rate else None, mine / best if mine and best else None)
    return out


def table(report: dict[str, Any], timing: bool) -> str:
    ar = report["vllm"]["runs"][0]["outputs"]
    speed = _speed_ups(report) if timing else {}
    head = (
        "| run | identical to vLLM AR | tokens/s | vs own AR | vs fastest AR | mean acceptance length | "
        "per-position acceptance | project's masks, same steps | proposals = project's predictions |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]

    def timed(name: str, run: dict[str, Any]) -> str:
        if not timing:
            return "- | - | -"
        own, best = speed.get(name, (None, None))
        ratio = lambda x: f"{x:.2f}x" if x is not None else "-"
        return f"{_fmt(run['tokens_per_s'], 1)} | {ratio(own)} | {ratio(best)}"

    for run in report["vllm"]["runs"]:
        same = sum(a == b for a, b in zip(run["outputs"], ar))
        figures = vllm_figures(run) if run.get("drafter") else {}
        cmp = report["comparisons"].get(run["name"], {})
        lines.append(
            f"| vLLM {run['name']} | {same}/{len(ar)} | {timed('vLLM ' + run['name'], run)} | "
            f"{_fmt(figures.get('mean_acceptance_length'))} | {_fmt(figures.get('acceptance_by_position'))} | "
            f"{_fmt(cmp.get('project_acceptance_by_position'))} | "
            f"{_fmt(100 * cmp['equal_share'], 1) + '%' if cmp else '-'} |"
        )
    for run in report["project"]:
        same = sum(a == b for a, b in zip(run["outputs"], ar))
        layout, by_position = "", run["acceptance_by_position"]
        if run.get("tree") and run["tree"] != "chain":
            # a tree drafts len(shape) depths; the counters hold a slot for every mask of the block
            layout, depths = f" (tree `{run['tree']}`)", max(len(t.split(",")) for t in run["tree"].split())
            by_position = by_position[:depths] if by_position else by_position
        lines.append(
            f"| {run['name']}{layout} | {same}/{len(ar)} | {timed(run['name'], run)} | "
            f"{_fmt(run['mean_acceptance_length'])} | {_fmt(by_position)} | - | - |"
        )
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mars.integrations.vllm_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/vllm_cpu")
    p.add_argument("--work", default="outputs/vllm_cpu", help="exported drafters and the vLLM log")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ks", default="2,3,4")
    p.add_argument("--timing", action="store_true", help="put tokens/s in the table (a quiet machine only)")
    p.add_argument("--compile", action="store_true", help="also run the gated drafter with vLLM's compilation on")
    p.add_argument("--threads", type=int, help="torch threads of this project's side (1 on a busy machine)")
    p.add_argument("--reuse-vllm", action="store_true", help="take the vLLM runs of the same job from --work")
    return p


def _vllm_runs(gated: Path, merged: Path, ks: list[int], compiled: bool) -> list[dict[str, Any]]:
    """vLLM's runs: AR, the gated and the merged drafter at each K, and with ``compiled`` the gated drafter at the
    first K with vLLM's compilation on."""
    runs: list[dict[str, Any]] = [{"name": "AR"}]
    runs += [{"name": f"gated K={k}", "drafter": {"model": str(gated), "k": k}, "record": True} for k in ks]
    runs += [{"name": f"merged K={k}", "drafter": {"model": str(merged), "k": k}, "record": True} for k in ks]
    if compiled:  # with vLLM's own AR compiled beside it: the baseline a compiled drafter is held against
        runs.append({"name": "AR, compiled", "compile": True})
        runs.append(
            {"name": f"gated K={ks[0]}, compiled", "drafter": {"model": str(gated), "k": ks[0]}, "compile": True}
        )
    return runs


def _vllm_result(job: dict[str, Any], work: Path, reuse: bool) -> dict[str, Any]:
    """vLLM's result of ``job``: with ``reuse``, the one saved in ``work`` when it ran the same job; otherwise run
    (and saved there for a later ``--reuse-vllm``)."""
    from mars.integrations.vllm_env import run_job

    work.mkdir(parents=True, exist_ok=True)
    saved = work / "vllm_result.json"
    if reuse and saved.is_file() and json.loads(saved.read_text()).get("job") == job:
        return json.loads(saved.read_text())["result"]
    vllm = run_job(job, log=work / "vllm.log")
    saved.write_text(json.dumps({"job": job, "result": vllm}) + "\n")
    return vllm


def _comparisons(vllm: dict[str, Any], lm, merged: Path, prompts) -> dict[str, Any]:
    """Each recorded vLLM run's proposals against the predictions of the model it drafted with (the gated adapter
    or the merged one)."""
    from transformers import AutoModelForCausalLM

    merged_model = AutoModelForCausalLM.from_pretrained(merged).eval()
    comparisons = {}
    for run in vllm["runs"]:
        if run.get("proposals"):
            model = lm.model if run["name"].startswith("gated") else merged_model
            comparisons[run["name"]] = compare_run(model, prompts, run, lm.mask.id).as_dict()
    return comparisons


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from mars.integrations.export import export_for_vllm
    from mars.integrations.vllm_env import vllm_python
    from mars.models import embedded_model_dir, load_model
    from mars.paths import data_dir

    vllm_python()  # no vLLM: say so before any model loads
    work, out = Path(args.work), Path(args.out)
    adapter = data_dir() / ADAPTER
    gated = export_for_vllm(adapter, work / "gated")
    merged = export_for_vllm(adapter, work / "merged", merge=True)
    lm = load_model(str(adapter))
    prompts = heldout_prompts(lm.tokenizer, args.prompts)
    runs = _vllm_runs(gated, merged, ks, args.compile)
    job = {"model": str(embedded_model_dir()), "prompts": prompts, "max_tokens": args.max_tokens, "runs": runs}
    started = time.time()
    report: dict[str, Any] = {"vllm": _vllm_result(job, work, args.reuse_vllm)}
    report["project"] = project_runs(lm, prompts, args.max_tokens, ks)
    report["comparisons"] = _comparisons(report["vllm"], lm, merged, prompts)
    report["settings"] = {
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "ks": ks,
        "timing": args.timing,
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "seconds": time.time() - started,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "table.md").write_text(table(report, args.timing))
    print(table(report, args.timing))


if __name__ == "__main__":
    main()
