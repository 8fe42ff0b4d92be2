"""The equal-compute recipe search (scripts/recipe_search.py): only complete variants enter the table; a
tiny search runs end to end and resumes."""

import argparse
import json

import pytest
import yaml
from conftest import REPO, TINY_SFT
from module_loading import load_module

search = load_module(REPO / "scripts" / "recipe_search.py", "recipe_search")

SPEC = {"thresholds": [1.0, 0.9], "limit": 2, "budget_minutes": 0.05, "clock": "cpu", "common": []}


def write_points(folder, thresholds, tpf=1.3):
    folder.mkdir(parents=True, exist_ok=True)
    points = [
        {
            "task": "Average",
            "threshold": t,
            "tokens_per_forward": 1.0 if t == 1.0 else tpf,
            "tokens_per_forward_lo": 1.0 if t == 1.0 else tpf - 0.1,
            "tokens_per_forward_hi": 1.0 if t == 1.0 else tpf + 0.1,
            "compare_ar_delta": -0.01,
            "compare_ar_delta_lo": -0.03,
            "compare_ar_delta_hi": 0.01,
        }
        for t in thresholds
    ]
    (folder / "points.json").write_text(json.dumps(points))


def finished_training(folder):
    from mars.metadata import MarsMetadata, write_metadata

    (folder / "hf").mkdir(parents=True)  # the metadata train.py writes beside a finished export
    write_metadata(
        folder / "hf", MarsMetadata(block_size=4, objective="mars", mask_token="<m>", mask_token_id=7, complete=True)
    )
    summary = {"global_step": 40, "tokens_seen": 9000, "response_tokens_seen": 3000, "budget": {"used_minutes": 2.0}}
    (folder / "train_summary.json").write_text(json.dumps(summary))


def test_a_variant_enters_the_table_only_when_every_stage_is_complete(tmp_path):
    variant = {"name": "v", "overrides": []}
    assert search.variant_row(variant, tmp_path, SPEC) is None  # nothing yet
    finished_training(tmp_path / "v" / "train")
    write_points(tmp_path / "v" / "eval", [1.0])  # a sweep killed after its first threshold
    assert search.variant_row(variant, tmp_path, SPEC) is None
    write_points(tmp_path / "v" / "eval", [1.0, 0.9], tpf=1.42)
    assert search.variant_row(variant, tmp_path, SPEC) is None  # verify mode still missing
    write_points(tmp_path / "v" / "verify", [1.0], tpf=1.0)
    row = search.variant_row(variant, tmp_path, SPEC)
    assert row["steps"] == 40 and row["cpu_s_per_step"] == 3.0
    table = search.table([row], SPEC)
    assert "1.42 [1.32, 1.52]" in table and "-1.0 [-3.0, 1.0]" in table
    assert "tokens_per_forward@0.9" in search.rows_csv([row], SPEC).splitlines()[0]


def test_unknown_variants_and_duplicate_names_are_refused(tmp_path):
    config = tmp_path / "search.yaml"
    config.write_text(yaml.safe_dump({**SPEC, "variants": [{"name": "a", "overrides": []}] * 2}))
    args = argparse.Namespace(variants=None, budget=None, limit=None)
    with pytest.raises(SystemExit, match="unique"):
        search.load_search(config, args)
    config.write_text(yaml.safe_dump({**SPEC, "variants": [{"name": "a", "overrides": []}]}))
    args.variants = "a,b"
    with pytest.raises(SystemExit, match=r"unknown variant\(s\) \['b'\]"):
        search.load_search(config, args)


def test_a_variant_train_py_would_refuse_stops_the_search_before_any_stage(tmp_path):
    """A typo in one variant's overrides is found up front (train.py's own checks on the composed config), with
    the variant named, instead of when the search reaches that variant's training stage hours later."""
    variants = [
        {"name": "fine", "overrides": ["optim.lr=1.0e-3"]},
        {"name": "typo", "overrides": ["objective.certainty_wieght=0.5"]},
        {"name": "bad_value", "overrides": ["optim.lr=-1"]},
    ]
    config = tmp_path / "search.yaml"
    config.write_text(yaml.safe_dump({**SPEC, "budget_minutes": 20, "variants": variants}))
    argv = ["--config", str(config), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "bench")]
    with pytest.raises(SystemExit) as refused:
        search.main([*argv, "--dry-run"])
    message = str(refused.value)
    assert "- typo (" in message and "certainty_wieght" in message and "- bad_value (" in message
    assert "- fine (" not in message
    assert not (tmp_path / "bench").exists() and not (tmp_path / "work").exists()  # no stage ran
    config.write_text(yaml.safe_dump({**SPEC, "budget_minutes": 20, "variants": variants[:1]}))
    assert search.main([*argv, "--dry-run"]) == 0


@pytest.mark.slow
def test_a_tiny_search_runs_end_to_end_and_a_rerun_resumes_without_redoing_anything(tmp_path):
    tiny = [
        "model=tiny-random",
        "data=jsonl",
        f"data.path={TINY_SFT}",
        "data.batch_size=4",
        "data.max_length=64",
        "trainer.precision=32-true",
        "logger=none",
    ]
    spec = {
        **SPEC,
        "base": "tiny-random",
        "common": ["experiment=recipe_search", *tiny],
        "variants": [
            {"name": "full", "lever": "full", "overrides": ["objective=mars", "adapter=none"]},
            {"name": "gated", "lever": "gated", "overrides": ["objective=mars_gated", "adapter=gated_lora"]},
        ],
    }
    config = tmp_path / "search.yaml"
    config.write_text(yaml.safe_dump(spec))
    argv = ["--config", str(config), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "bench")]
    assert search.main(argv) == 0
    readme = (tmp_path / "bench" / "README.md").read_text()
    assert "**full**" in readme and "**gated**" in readme and "Not in the table" not in readme
    assert (tmp_path / "bench" / "pareto.png").is_file()
    stages = json.loads((tmp_path / "bench" / "stages.json").read_text())
    assert set(stages) == {"base/eval", *(f"{v}/{s}" for v in ("full", "gated") for s in ("train", "eval", "verify"))}
    before = {k: v["finished"] for k, v in stages.items()}
    assert search.main(argv) == 0  # everything done: every stage skipped
    after = json.loads((tmp_path / "bench" / "stages.json").read_text())
    assert {k: v["finished"] for k, v in after.items()} == before


def test_training_stages_let_idle_openmp_threads_sleep_unless_the_caller_chose(monkeypatch):
    """On the CPU clock a spinning OpenMP thread counts as compute, so the search's training stages run with
    PASSIVE waits; a policy the caller exported is left alone."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert search.equal_compute_env() == {"OMP_WAIT_POLICY": "PASSIVE"}
    monkeypatch.setenv("GOMP_SPINCOUNT", "3000")
    assert search.equal_compute_env() == {}


def test_report_only_lists_every_stage_command_without_running_any(tmp_path):
    """A report regenerated from finished outputs still writes each variant's train/eval/verify commands."""
    config = tmp_path / "search.yaml"
    config.write_text(yaml.safe_dump({**SPEC, "variants": [{"name": "v", "overrides": ["optim.lr=1.0e-3"]}]}))
    work, bench = tmp_path / "work", tmp_path / "bench"
    finished_training(work / "v" / "train")
    write_points(work / "v" / "eval", [1.0, 0.9])
    write_points(work / "v" / "verify", [1.0])
    argv = ["--config", str(config), "--work", str(work), "--out", str(bench), "--report-only"]
    assert search.main(argv) == 0
    commands = (bench / "commands.md").read_text()
    for stage in ("base/eval", "v/train", "v/eval", "v/verify"):
        assert f"# {stage}\n" in commands
    assert "optim.lr=1.0e-3" in commands and "**v**" in (bench / "README.md").read_text()
    assert not (bench / "stages.json").exists()  # nothing ran
