"""scripts/demo.py's summary: the lossless result first, then the threshold curve with quality and fidelity
beside each point, read from hand-made throughput.csv and points.csv files."""

import csv

from conftest import REPO
from module_loading import load_module

demo = load_module(REPO / "scripts" / "demo.py", "demo")


def write_csv(path, rows):
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def timing(decoder, threshold, speedup, tpf, same, accepted=""):
    return dict(
        threshold=threshold, batch=1, decoder=decoder, ar_baseline="ar-cursor", tokens_per_s=40 * speedup,
        speedup=speedup, speedup_min=speedup - 0.05, speedup_max=speedup + 0.04, row_tokens_per_forward=tpf,
        same_as_ar=same, mean_acceptance_length=accepted,
    )  # fmt: skip


def point(task, threshold, accuracy, tpf, fidelity=None, reference=0.5):
    row = dict(
        task=task, threshold=threshold, accuracy=accuracy, accuracy_lo=accuracy - 0.05, accuracy_hi=accuracy + 0.05,
        accuracy_delta="" if threshold == 1.0 else accuracy - reference, accuracy_delta_lo="", accuracy_delta_hi="",
        tokens_per_forward=tpf, fidelity="", fidelity_lo="", fidelity_hi="",
    )  # fmt: skip
    if fidelity is not None:
        row.update(fidelity=fidelity, fidelity_lo=fidelity - 0.03, fidelity_hi=fidelity + 0.02)
    return row


def test_the_summary_opens_with_the_lossless_result_then_the_curve(tmp_path):
    rows = [
        timing("ar-hf", 1.0, 0.9, 1.0, "4/4"),
        timing("ar-cursor", 1.0, 1.0, 1.0, "4/4"),
        timing("mars-cursor", 0.95, 1.31, 1.52, "2/4"),
        timing("mars-verify", 0.95, 1.18, 1.41, "4/4", accepted=1.47),
    ]
    points = [
        point("Capitals", 1.0, 0.6, 1.0),
        point("Average", 1.0, 0.5, 1.0),
        point("Average", 0.9, 0.42, 1.66, fidelity=0.78),
        point("Average", 0.95, 0.47, 1.5, fidelity=0.9),
    ]
    text = demo.summary(write_csv(tmp_path / "t.csv", rows), write_csv(tmp_path / "p.csv", points))
    lines = text.splitlines()
    assert lines[:4] == [
        "lossless (verified) MARS, batch 1:",
        "  outputs identical to the base model (greedy AR): 4/4",
        "  1.41 tokens per forward, 1.47 tokens accepted per draft step (mean)",
        "  wall clock 1.18x [1.13-1.22] the fastest AR decoder measured in this run (ar-cursor), 47.2 tokens/s",
    ]
    curve = lines[lines.index("") + 2 :]
    assert curve == [
        "  tau 1.0: quality 50.0% [45.0, 55.0], 1.00 tokens per forward, fidelity –",
        "  tau 0.95: quality 47.0% [42.0, 52.0] (-3.0 points vs tau 1.0), 1.50 tokens per forward, "
        "fidelity 90.0% [87.0, 92.0], wall clock 1.31x AR",
        "  tau 0.9: quality 42.0% [37.0, 47.0] (-8.0 points vs tau 1.0), 1.66 tokens per forward, "
        "fidelity 78.0% [75.0, 80.0]",
    ]


def test_without_a_verified_row_or_an_acceptance_figure_the_summary_says_what_is_missing(tmp_path):
    rows = [timing("ar-cursor", 1.0, 1.0, 1.0, "4/4"), timing("mars-cursor", 0.95, 1.3, 1.5, "3/4")]
    points = [point("Copy", 1.0, 0.6, 1.0), point("Copy", 0.95, 0.55, 1.4, fidelity=0.8, reference=0.6)]
    text = demo.summary(write_csv(tmp_path / "t.csv", rows), write_csv(tmp_path / "p.csv", points))
    assert text.startswith("lossless (verified) MARS: not measured\n")
    assert "threshold curve (quality: Copy," in text
    assert "tau 0.95: quality 55.0% [50.0, 60.0] (-5.0 points vs tau 1.0)" in text  # the only task stands in
    only_verify = [timing("mars-verify", 0.95, 1.1, 1.3, "4/4")]
    lossless = demo.lossless_lines([{**r, "mean_acceptance_length": ""} for r in only_verify])
    assert lossless[2] == "  1.30 tokens per forward"
