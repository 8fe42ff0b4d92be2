"""The mask search (scripts/mask_search.py): equal steps per variant, a published variant is skipped as a whole,
its figures come from the stages' own files, the report tables read them."""

import csv
import json

import pytest
import yaml
from conftest import REPO
from module_loading import load_module

search = load_module(REPO / "scripts" / "mask_search.py", "mask_search")


def spec_file(tmp_path, **changes):
    spec = yaml.safe_load((REPO / "conf" / "mask_search.yaml").read_text())
    spec.update(changes)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_every_variant_trains_the_same_number_of_steps_and_the_long_run_a_compute_budget(tmp_path):
    spec = search.load_spec(spec_file(tmp_path, steps=123, long_minutes=45), None, None)
    commands = [search.train_overrides(v, tmp_path, spec) for v in spec["selected"]]
    assert len(commands) == 4 and all("trainer.max_steps=123" in c and "budget.minutes=null" in c for c in commands)
    long = search.load_spec(spec_file(tmp_path, steps=123, long_minutes=45), None, "soft")
    (chosen,) = long["selected"]
    overrides = search.train_overrides(chosen, tmp_path, long)
    assert chosen["name"] == "soft_long" and "budget.minutes=45" in overrides and "trainer.max_steps=-1" in overrides
    assert "budget.clock=wall" in overrides  # conf/mask_search.yaml's long_clock
    assert "objective=mars_gated_soft" in chosen["overrides"]


@pytest.mark.parametrize(
    "changes", [{"steps": 0}, {"rank": "8"}, {"long_minutes": None}, {"long_minutes": 0}, {"long_clock": "cpus"}]
)
def test_a_bad_length_is_refused(tmp_path, changes):
    with pytest.raises(SystemExit, match="positive (integer|number)|long_clock must be one of"):
        search.load_spec(spec_file(tmp_path, **changes), None, None)


def test_unknown_variants_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown variant"):
        search.load_spec(spec_file(tmp_path), "nope", None)
    with pytest.raises(SystemExit, match="not a variant"):
        search.load_spec(spec_file(tmp_path), None, "nope")


def test_every_variant_composes_as_train_py_would_compose_it(tmp_path):
    spec = search.load_spec(spec_file(tmp_path), None, None)
    search.check_variants(spec, tmp_path)  # raises SystemExit naming the variant otherwise
    bad = {**spec, "selected": [{"name": "x", "overrides": ["objective.nope=1"], "steps": 3}]}
    with pytest.raises(SystemExit, match="x"):
        search.check_variants(bad, tmp_path)


def fake_stage_outputs(work, name, spec, lift=0.0, delta=-0.05):
    """The files each stage writes, as the tools write them (``lift``: added to the mean accepted tokens;
    ``delta``: the quality change from the base at every threshold)."""
    root = work / name
    (root / "train").mkdir(parents=True)
    summary = {"global_step": 400, "tokens_seen": 640000, "seconds_per_step": 6.0, "final": {"loss_mask": 2.5}}
    (root / "train" / "train_summary.json").write_text(json.dumps(summary))
    with (root / "train" / "losses.csv").open("w") as f:
        f.write(
            "step,loss,loss_mask,loss_ar,tokens_per_s\n" + "".join(f"{s},3.0,{3 - s / 400},,\n" for s in range(1, 41))
        )
    cut = root / "rank8"
    cut.mkdir()
    table = [[0.61, 0.72, 0.78, 0.8], [0.45, 0.6, 0.65, 0.7], [0.3, 0.5, 0.55, 0.6]]
    meta = {"calibration": {"temperatures": [1.4, 1.5, 1.4], "ece_after": [0.04, 0.05, 0.05]}}
    (cut / "mars_config.json").write_text(json.dumps(meta | {"draft_acceptance": {"conditional": table}}))
    (cut / "adapter_model.safetensors").write_bytes(b"x")
    for i, tree in enumerate(spec["trees"]):
        folder = root / "spec" / search.tree_folder(tree)
        folder.mkdir(parents=True)
        with (folder / "spec.csv").open("w") as f:
            w = csv.writer(f)
            w.writerow(["category", "prompts", "mean_acceptance_length", "tokens_per_forward", "draft_acceptance_rate"])
            w.writerow(["math", 2, 2.0 + lift, 1.9, 0.5])
            w.writerow(["overall", 16, 1.6 + i / 10 + lift, 1.5 + i / 10, 0.6])
        rows = list(csv.reader((folder / "spec.csv").open()))
        with (folder / "spec.csv").open("w") as f:
            w = csv.writer(f)
            w.writerow(rows[0] + ["identical_outputs"])
            w.writerows([r + [r[1]] for r in rows[1:]])
    probe = {"results": [{"threshold": t, "tokens_per_forward": 1 + (1 - t), "mask_fidelity": t - 0.01,
                          "identical_to_tau_1": 0.5} for t in spec["thresholds"]]}  # fmt: skip
    (root / "probe.json").write_text(json.dumps(probe))
    (root / "eval").mkdir()
    points = [{"task": "Average", "threshold": t, "tokens_per_forward": 1.2, "tokens_per_forward_lo": 1.1,
               "tokens_per_forward_hi": 1.3, "compare_ar_delta": delta, "fidelity": 0.9} for t in spec["thresholds"]]  # fmt: skip
    (root / "eval" / "points.json").write_text(json.dumps(points))


def test_a_published_variant_carries_its_figures_and_is_skipped_next_time(tmp_path, capsys):
    spec = search.load_spec(spec_file(tmp_path), "reference", None)
    work, results = tmp_path / "work", tmp_path / "results"
    (variant,) = spec["selected"]
    fake_stage_outputs(work, "reference", spec)
    search.publish(variant, work, results, spec)
    figures = json.loads((results / "reference" / "figures.json").read_text())
    assert figures["depth1_top1"] == 0.61 and figures["depth1_top2"] == 0.72 and figures["steps"] == 400
    assert figures["verify"]["2,1"]["mean_acceptance_length"] == pytest.approx(1.8)
    assert figures["verify"]["chain"]["identical_outputs"] == 16
    assert figures["quality"]["0.9"]["compare_ar_delta"] == -0.05
    assert (results / "reference" / "adapter" / "adapter_model.safetensors").is_file()
    search.report(spec, results)
    readme = (results / "README.md").read_text()
    assert "| **reference** | 400 | 61.0% | 72.0% | 45.0% | 1.60 (1.50) | 1.70 (1.60) | 1.80 (1.70) |" in readme
    assert "soft_certainty" in readme.split("Not measured yet:")[1]
    assert (results / "learning_curves.png").stat().st_size > 0
    # the next run finds it published: no stage runs (the work folder is gone, as on another machine)
    search.main(["--config", str(spec_file(tmp_path)), "--variants", "reference", "--work", str(tmp_path / "w2"),
                 "--results", str(results), "--dry-run"])  # fmt: skip
    out = capsys.readouterr().out
    assert "reference: published" in out and "reference/train" not in out


def test_a_trained_but_unmeasured_variant_is_measured_elsewhere_without_training_again(tmp_path):
    spec = search.load_spec(spec_file(tmp_path), "soft", None)
    (variant,) = spec["selected"]
    results = tmp_path / "results"
    fake_stage_outputs(tmp_path / "here", "soft", spec)
    search.publish_training(variant, tmp_path / "here", results, spec)
    assert (results / "soft" / "adapter" / "adapter_model.safetensors").is_file()
    assert not (results / "soft" / "figures.json").exists()  # not measured: not done
    elsewhere = tmp_path / "elsewhere"
    assert not search.restore_training(variant, tmp_path / "nowhere", tmp_path / "empty", spec)
    assert search.restore_training(variant, elsewhere, results, spec)
    assert (elsewhere / "soft" / "rank8" / "mars_config.json").is_file()
    assert (elsewhere / "soft" / "train" / "losses.csv").read_text().startswith("step,loss")


def test_with_every_variant_measured_the_report_names_the_winner_and_its_longer_run(tmp_path):
    spec = search.load_spec(spec_file(tmp_path), None, None)
    work, results = tmp_path / "work", tmp_path / "results"
    # soft and soft_reach_certainty tie on accepted tokens (within 1%); soft loses less quality
    figures = {"reference": (0.0, -0.08), "soft_certainty": (0.05, -0.05), "soft": (0.16, -0.02)}
    figures["soft_reach_certainty"] = (0.17, -0.04)
    for variant in spec["selected"]:
        lift, delta = figures[variant["name"]]
        fake_stage_outputs(work, variant["name"], spec, lift=lift, delta=delta)
        search.publish(variant, work, results, spec)
    search.report(spec, results)
    readme = (results / "README.md").read_text()
    assert "Not measured yet" not in readme
    # chain: 1.76 / 1.60, `1`: 1.86 / 1.70
    assert "**Winner at equal steps: soft** (accepted tokens vs reference, `chain` / `1`: +10.0% / +9.4%" in readme
    assert "`python scripts/mask_search.py --long soft`" in readme
    # one category (math) in the fake tables: 2.16 / 2.00 with the chain
    assert "the mean of the 1 category means" in readme and "`chain` +8.0% [+8.0, +8.0]" in readme
    assert "its curve lies lower by construction" in readme  # soft_reach_certainty weights its depths
    assert "| **reference** | 400 |" in readme and readme.count("| – |") >= 1


def test_a_published_longer_run_stays_in_the_report_whichever_command_writes_it(tmp_path):
    spec = search.load_spec(spec_file(tmp_path), None, None)
    work, results = tmp_path / "work", tmp_path / "results"
    for variant in spec["selected"]:
        fake_stage_outputs(work, variant["name"], spec, lift=0.1 if variant["name"] == "soft" else 0.0)
        search.publish(variant, work, results, spec)
    long = search.load_spec(spec_file(tmp_path), None, "soft")
    (chosen,) = long["selected"]
    fake_stage_outputs(work, chosen["name"], long, lift=0.3)
    search.publish(chosen, work, results, long)
    search.report(spec, results)  # --report-only, without --long
    readme = (results / "README.md").read_text()
    assert "| **soft_long** |" in readme and "**Winner at equal steps: soft**" in readme
    assert "--long soft`" not in readme  # its longer run is published
    # compared with the reference on the same prompts only (the fake tables: 16 prompts, one category)
    assert "Its longer run (400 steps, 1.0x the compared compute) against the reference recipe on the same 16" in readme
