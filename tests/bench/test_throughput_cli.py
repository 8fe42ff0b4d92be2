"""The throughput benchmark command end to end on a tiny model: every decoder, the AR baseline chosen
as the fastest AR decoder of the run, and exact decoders matching transformers' greedy output."""

import csv
import json
from collections import Counter
from pathlib import Path

import pytest

from mars.bench import timing
from mars.bench.throughput import main
from mars.decoding import api, fastpath

AR_DECODERS = {"ar-hf", "ar-hf-static", "ar-cursor"}
AR_DECODERS |= {f"{name}-eager" for name in AR_DECODERS}


def spy_on_runs(monkeypatch) -> tuple[Counter, list, set]:
    """(timed runs per decoder, (prompts, decoder, threshold) in the order they ran, fast-path states seen)."""
    timed = Counter()
    calls = []
    run_one = timing.run_one

    def counting_run_one(*args, **kwargs):
        timed[args[4].name] += 1
        calls.append((tuple(args[2]), args[4].name, args[5]))
        return run_one(*args, **kwargs)

    monkeypatch.setattr(timing, "run_one", counting_run_one)
    fast_path_seen = set()
    generate = api.generate

    def spying_generate(*args, **kwargs):
        fast_path_seen.add(fastpath.enabled_by_env())
        return generate(*args, **kwargs)

    monkeypatch.setattr(api, "generate", spying_generate)
    return timed, calls, fast_path_seen


def run_every_decoder(tmp_path) -> Path:
    """Every decoder at batch 1 and 2, thresholds 1.0 and 0.5, over 2 prompts of a 3-prompt file."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Say hi.", "Count to five.", "Name a dog."]))
    out = tmp_path / "out"
    args = ["--model", "tiny-random", "--batch-sizes", "1,2", "--repeats", "1", "--warmup", "0"]
    args += ["--max-new-tokens", "6", "--thresholds", "1.0,0.5", "--caches", "cursor", "--verify", "--ar-static"]
    args += ["--eager-baselines", "--num-prompts", "2", "--prompts-file", str(prompts), "--out", str(out)]
    assert main(args) == 0
    return out


def check_row(r: dict) -> None:
    """One CSV row: its baseline, its ratios and their spreads, its decode phase, and exactness."""
    assert r["ar_baseline"] in AR_DECODERS
    if r["decoder"] == r["ar_baseline"]:
        assert float(r["speedup"]) == 1.0
    assert float(r["speedup_per_tpf"]) == pytest.approx(float(r["speedup"]) / float(r["tokens_per_forward"]))
    assert float(r["speedup_per_tpf_min"]) <= float(r["speedup_per_tpf"]) <= float(r["speedup_per_tpf_max"])
    # the decode phase (after each batch's prefill): every decoder's time to first token is measured
    assert float(r["first_token_ms"]) > 0
    decode = float(r["decode_speedup_per_tpf"])
    assert decode == pytest.approx(float(r["decode_speedup"]) / float(r["decode_tokens_per_forward"]))
    assert float(r["decode_speedup_per_tpf_min"]) <= decode <= float(r["decode_speedup_per_tpf_max"])
    if r["decoder"] == r["ar_baseline"]:
        assert float(r["decode_speedup"]) == 1.0
    if r["decoder"].startswith("ar") and r["batch"] == "1":  # one forward per token after the prefill's
        assert float(r["decode_tokens_per_forward"]) == 1.0
    # AR decoders and verified decoding are exact at any sweep threshold
    if r["decoder"].startswith("ar") or r["decoder"] == "mars-verify":
        assert r["same_as_ar"] == "2/2" and float(r["threshold"]) == 1.0
    check_acceptance(r)


def check_acceptance(r: dict) -> None:
    """vLLM's acceptance columns: only for rows that verified drafts, and consistent with one another."""
    if r["decoder"] != "mars-verify" and not r["decoder"].startswith("verify-"):
        assert r["mean_acceptance_length"] == r["draft_acceptance_rate"] == r["acceptance_by_position"] == ""
        assert r["num_drafts"] == "0"
        return
    assert int(r["num_drafts"]) > 0 and r["draft_acceptance_rate"] == r["draft_acceptance"]
    by_position = [float(a) for a in r["acceptance_by_position"].split(";")]
    # a depth's draft passes only after the drafts before it did: per-position acceptance never rises
    assert all(0 <= b <= a <= 1 for a, b in zip([1.0, *by_position], by_position))
    assert float(r["mean_acceptance_length"]) == pytest.approx(1 + sum(by_position), abs=1e-3)


def check_rotation(calls: list, jobs: int) -> None:
    """Each batch of prompts runs through all decoders back to back, the first of them rotating between
    batches."""
    blocks = [calls[i : i + jobs] for i in range(0, len(calls), jobs)]
    assert len(blocks) == 3 and all(len({prompts for prompts, *_ in block}) == 1 for block in blocks)
    assert [len(block[0][0]) for block in blocks] == [1, 1, 2]
    assert all(len({(name, t) for _, name, t in block}) == jobs for block in blocks)
    assert blocks[0][0][1:] != blocks[1][0][1:]


def test_throughput_benchmark_end_to_end(tmp_path, monkeypatch):
    timed, calls, fast_path_seen = spy_on_runs(monkeypatch)
    out = run_every_decoder(tmp_path)
    rows = list(csv.DictReader((out / "throughput.csv").open()))
    decoders = {r["decoder"] for r in rows}
    assert decoders == AR_DECODERS | {"mars-cursor", "mars-verify"}
    for r in rows:
        check_row(r)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] in ("float32", "bfloat16") and "cpu_native_bf16" in config["hardware"]
    assert "fastest AR decoder measured in the same run" in (out / "throughput.md").read_text()
    assert "after the first token: speedup / tok/fwd" in (out / "throughput.md").read_text()
    # 2 batch sizes x 1 repeat over 2 prompts (2 batches of 1, then 1 of 2): the threshold-free decoders once
    # per batch, MARS once per batch and threshold (2)
    assert timed == {**{name: 3 for name in AR_DECODERS}, "mars-verify": 3, "mars-cursor": 6}
    # each batch of prompts runs through all 9 decoders back to back, the first of them rotating between batches
    check_rotation(calls, len(AR_DECODERS) + 3)
    assert len(rows) == 2 * 2 * 8  # the CSV lists every decoder under both thresholds
    table = [line.split(" | ") for line in (out / "throughput.md").read_text().splitlines() if line.startswith("| ")]
    listed = Counter(
        (cells[0].strip("| "), cells[1], cells[2]) for cells in table[1:]
    )  # tau, batch, decoder (table[0]: header)
    # the markdown lists a threshold-free decoder once per batch size, mars-cursor once per threshold
    assert set(listed.values()) == {1} and len(listed) == 2 * (7 + 2)
    assert fast_path_seen == {True, False} and fastpath.enabled_by_env()  # -eager rows ran without it


def test_draft_sources_are_rows_like_the_other_decoders(tmp_path):
    """Prompt lookup and a draft model (the target's first layer), with and without masks: lossless rows with
    the same columns; a copy-task file (a 'question' field) serves as prompts; a bad source is named."""
    prompts = tmp_path / "copy.jsonl"
    prompts.write_text(json.dumps({"question": "Repeat exactly: the cat sat on the mat."}) + "\n")
    out = tmp_path / "out"
    args = ["--model", "tiny-random", "--batch-sizes", "1", "--repeats", "1", "--warmup", "0"]
    args += ["--max-new-tokens", "6", "--caches", "cursor", "--prompts-file", str(prompts), "--out", str(out)]
    args += ["--draft-sources", "lookup,lookup+masks,model,model+masks", "--draft-model", "self:1"]
    assert main(args) == 0
    rows = {r["decoder"]: r for r in csv.DictReader((out / "throughput.csv").open())}
    drafted = {"verify-lookup", "verify-lookup+masks", "verify-model", "verify-model+masks"}
    assert drafted <= set(rows)
    for name in drafted:
        assert rows[name]["same_as_ar"] == "1/1" and float(rows[name]["threshold"]) == 1.0
        check_acceptance(rows[name])
    assert float(rows["verify-model"]["draft_acceptance"]) >= 0
    with pytest.raises(SystemExit, match="unknown draft source 'tree'"):
        main(args[:-4] + ["--draft-sources", "tree"])


def test_verify_draft_thresholds_and_tau_are_timed_side_by_side(tmp_path):
    """Each draft threshold, window and chain choice, and each combination given to ``--verify-rows``, is its
    own lossless verify row in the same run; ``--verify-tau`` times verified decoding at every threshold (at
    1.0 lossless like ``mars-verify``); a draft threshold outside [0, 1], an unknown chain choice, a window
    below 1, an unknown setting or an entry without ``=`` is refused before any model loads."""
    out = tmp_path / "out"
    args = ["--model", "tiny-random", "--batch-sizes", "1", "--repeats", "1", "--warmup", "0", "--num-prompts", "2"]
    args += ["--max-new-tokens", "6", "--caches", "cursor", "--verify", "--out", str(out)]
    extra = ["--verify-draft-thresholds", "0.3,0.9", "--verify-chains", "always,never", "--verify-windows", "2"]
    extra += ["--verify-rows", "window=3,draft_threshold=0.2; chain_drafts=never,window=2"]
    assert main([*args, *extra, "--verify-tau", "--thresholds", "1.0,0.5"]) == 0
    rows = list(csv.DictReader((out / "throughput.csv").open()))
    lossless = ("mars-verify", "mars-verify-dt0.3", "mars-verify-dt0.9", "mars-verify-w2", "mars-verify-w3-dt0.2")
    lossless += ("mars-verify-chain-never-w2",)
    for name in (*lossless, "mars-verify-chain-always", "mars-verify-chain-never"):
        assert {r["same_as_ar"] for r in rows if r["decoder"] == name} == {"2/2"}
    composed = {float(r["threshold"]): r for r in rows if r["decoder"] == "mars-verify-tau"}
    assert sorted(composed) == [0.5, 1.0] and composed[1.0]["same_as_ar"] == "2/2"
    refused = [
        ("--verify-draft-thresholds", "1.5", "draft_threshold"),
        ("--verify-chains", "sometimes", "--verify-chains"),
        ("--verify-windows", "0", "--verify-windows"),
        ("--verify-rows", "window=3;window=0", "--verify-rows.*window must be"),
        ("--verify-rows", "windw=3", "--verify-rows: unknown decoding setting\\(s\\) \\['windw'\\]"),
        ("--verify-rows", "window", "field=value"),
        ("--verify-rows", "typical_epsilon=0.09", "--verify-rows: typical_epsilon makes verification lossy"),
    ]
    for flag, value, message in refused:
        with pytest.raises(SystemExit, match=message):
            main([*args, flag, value])


def test_adapter_rank_is_checked_before_loading_and_needs_a_gated_adapter(tmp_path, monkeypatch):
    """``--adapter-rank 0`` stops before any model loads; a model without a gated adapter is named as such."""
    import mars.models

    args = ["--model", "tiny-random", "--batch-sizes", "1", "--repeats", "1", "--warmup", "0", "--num-prompts", "1"]
    args += ["--max-new-tokens", "4", "--caches", "cursor", "--out", str(tmp_path / "out")]
    loads = []
    real_load = mars.models.load_model
    monkeypatch.setattr(mars.models, "load_model", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    with pytest.raises(SystemExit, match="--adapter-rank must be >= 1"):
        main([*args, "--adapter-rank", "0"])
    assert loads == []
    from mars.adapters import AdapterError

    with pytest.raises(AdapterError, match="no MARS adapter"):
        main([*args, "--adapter-rank", "8"])
    assert len(loads) == 1


def test_a_bad_prompt_file_line_is_refused_naming_it_before_the_model_loads(tmp_path, monkeypatch):
    import mars.models

    loads = []
    monkeypatch.setattr(mars.models, "load_model", lambda *a, **k: loads.append(a))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Say hi."}\n{"answer": "no prompt here"}\n')
    args = ["--model", "tiny-random", "--batch-sizes", "1", "--caches", "cursor", "--prompts-file", str(prompts)]
    with pytest.raises(
        SystemExit, match=r"--prompts-file .*p.jsonl, line 2: no prompt \(expected a non-empty 'prompt'"
    ):
        main([*args, "--out", str(tmp_path / "out")])
    prompts.write_text("\n")
    with pytest.raises(SystemExit, match="p.jsonl: no prompts"):
        main([*args, "--out", str(tmp_path / "out")])
    assert loads == [] and not (tmp_path / "out").exists()
