"""Statistics of the evaluation (mars.evaluation.agreement) and their use in points, tables and plots.

Everything here runs on hand-made numbers and hand-made sample files: no model, no lm-eval run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mars.evaluation import agreement as ag
from mars.evaluation.store import ResultsDir, write_json

# ------------------------------------------------------------------------------------------------
# text similarity
# ------------------------------------------------------------------------------------------------


def test_chrf_of_known_strings():
    """Values worked out by hand from chrF's definition, so they pin how sacrebleu is called (character
    n-grams only, not chrF++'s word n-grams; orders both strings have; F-beta; scaled to 0-1)."""
    # "ab" vs "abc": order 1 P=2/2 R=2/3, order 2 P=1/1 R=1/2, orders 3-6 absent from "ab";
    # P=1, R=7/12 -> F2 = 5PR / (4P + R) = 7/11
    assert ag.chrf("ab", "abc") == pytest.approx(7 / 11, abs=1e-12)
    # "abcd" vs "abce": P = R per order: 3/4, 2/3, 1/2, 0/1 (both have one 4-gram) -> F = 23/48
    assert ag.chrf("abcd", "abce") == pytest.approx(23 / 48, abs=1e-12)
    assert ag.chrf("abcd", "abce", order=2) == pytest.approx((3 / 4 + 2 / 3) / 2, abs=1e-12)
    # "aab" vs "ab": order 1 P=2/3 R=1, order 2 P=1/2 R=1, order 3 absent from "ab": P=7/12, R=1
    assert ag.chrf("aab", "ab") == pytest.approx(7 / 8, abs=1e-12)  # F2 = 5PR / (4P + R)
    assert ag.chrf("aab", "ab", beta=1) == pytest.approx(14 / 19, abs=1e-12)  # F1 = 2PR / (P + R)
    # swapped, P=1 R=7/12 as for "ab" vs "abc": recall weighs more than precision
    assert ag.chrf("ab", "aab") == pytest.approx(7 / 11, abs=1e-12)
    assert ag.chrf("The cat sat on the mat.", "The cat sat on the mat.") == 1.0
    assert ag.chrf("a b  c", "abc") == 1.0  # whitespace is not scored
    assert ag.chrf("", "abc") == 0.0 and ag.chrf("abc", None) == 0.0 and ag.chrf("  ", "abc") == 0.0
    # our convention on top of sacrebleu (which scores 0): two empty outputs agree
    assert ag.chrf("", "") == 1.0 and ag.chrf(None, None) == 1.0 and ag.chrf(" \n", "") == 1.0
    assert ag.chrf("abc", "xyz") == 0.0
    # one changed word costs a little, not everything
    one_word = ag.chrf("The cat sat on the red mat today.", "The cat sat on the blue mat today.")
    assert 0.6 < one_word < 0.95


def test_chrf_is_sacrebleus_sentence_chrf():
    import sacrebleu

    pairs = [
        ("The cat sat on the mat.", "The cat sat on a mat."),
        ("Paris is the capital of France.", "The capital of France is Paris."),
        ("hello world", "hello there world"),
        ("def f(x):\n    return x+1", "def f(x):\n    return x + 2"),
    ]
    for hyp, ref in pairs:
        assert ag.chrf(hyp, ref) == sacrebleu.sentence_chrf(hyp, [ref]).score / 100


def test_token_f1_of_known_strings():
    assert ag.words("Paris, France.") == ["Paris", ",", "France", "."]
    assert ag.token_f1("the cat sat", "the cat ran") == pytest.approx(2 / 3)
    assert ag.token_f1("Paris.", "Paris") == pytest.approx(2 / 3)  # P = 1/2, R = 1
    ten = "one two three four five six seven eight nine ten"
    assert ag.token_f1(ten.replace("five", "FIVE"), ten) == pytest.approx(0.9)
    assert ag.token_f1("", "") == 1.0 and ag.token_f1("a", "") == 0.0 and ag.token_f1("x", "y") == 0.0
    assert ag.token_f1("b a", "a b") == 1.0  # a bag of words: order is not scored
    assert ag.similarity("exact", "a", "a") == 1.0 and ag.similarity("exact", "a", "a ") == 0.0
    with pytest.raises(ValueError, match="unknown similarity 'bleu'"):
        ag.similarity("bleu", "a", "b")


# ------------------------------------------------------------------------------------------------
# intervals
# ------------------------------------------------------------------------------------------------
def test_wilson_interval_known_values():
    lo, hi = ag.wilson_interval(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    lo, hi = ag.wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = ag.wilson_interval(10, 10)
    assert hi == 1.0 and lo == pytest.approx(0.7225, abs=1e-4)
    with pytest.raises(ValueError):
        ag.wilson_interval(11, 10)
    with pytest.raises(ValueError):
        ag.wilson_interval(1, 10, confidence=1.5)


def test_mean_interval_wilson_for_binary_bootstrap_otherwise():
    est = ag.mean_interval([1, 0, 1, 0, 1, 0, 1, 0, 1, 0, None, float("nan"), True])
    assert est.n == 11 and est.value == pytest.approx(6 / 11)
    assert (est.lo, est.hi) == pytest.approx(ag.wilson_interval(6, 11))
    graded = [0.1, 0.5, 0.9, 0.7, 0.3] * 20
    a, b = ag.mean_interval(graded), ag.mean_interval(graded)
    assert a == b  # seeded: same data, same interval
    assert a.value == pytest.approx(0.5) and a.lo < 0.5 < a.hi and a.hi - a.lo < 0.2
    assert ag.mean_interval([]) == ag.NONE and ag.mean_interval([None]).value is None
    assert ag.mean_interval([0.25] * 30) == ag.Estimate(0.25, 0.25, 0.25, 30)  # constant: zero width
    assert ag.mean_interval([1.0] * 30, binary=False) == ag.Estimate(1.0, 1.0, 1.0, 30)  # e.g. chrF all 1
    assert ag.mean_interval([1.0] * 30).lo == pytest.approx(ag.wilson_interval(30, 30)[0])  # 30 of 30 right


def test_identical_outputs_give_zero_width_difference():
    scores = [1, 0, 1, 1, 0] * 40
    d = ag.paired_difference(scores, list(scores))
    assert (d.value, d.lo, d.hi, d.n) == (0.0, 0.0, 0.0, 200)


def test_paired_difference_recovers_a_known_two_point_drop():
    """400 documents, half right at tau=1.0; 8 of the right ones turn wrong: a 2-point drop that two
    independent Wilson intervals cannot see but the paired interval resolves."""
    ref = [1, 0] * 200
    low = list(ref)
    flipped = [i for i, v in enumerate(ref) if v == 1][:8]
    for i in flipped:
        low[i] = 0
    d = ag.paired_difference(low, ref)
    assert d.value == pytest.approx(-0.02) and d.n == 400
    assert d.lo < -0.02 < d.hi < 0  # resolved: the interval excludes no change
    a, b = ag.mean_interval(low), ag.mean_interval(ref)
    assert a.hi > b.lo  # the unpaired intervals overlap
    # pairs with a missing side are left out; lists must be paired
    assert ag.paired_difference([1, None, 0], [1, 1, None]).n == 1
    with pytest.raises(ValueError, match="paired"):
        ag.paired_difference([1, 0], [1])


def test_ratio_interval_over_requests():
    even = ag.ratio_interval([4, 6, 8, 10], [2, 3, 4, 5])  # every request at 2 tokens per forward
    assert (even.value, even.lo, even.hi, even.n) == (2.0, 2.0, 2.0, 4)
    mixed = ag.ratio_interval([10, 30, 20, 40], [10, 10, 10, 10])
    assert mixed.value == pytest.approx(2.5) and 1.0 <= mixed.lo < 2.5 < mixed.hi <= 4.0
    assert ag.ratio_interval([0, 0], [0, 0]).value is None
    with pytest.raises(ValueError):
        ag.ratio_interval([1], [1, 2])


def test_average_over_tasks():
    # combined: the mean of the values, half-widths added in quadrature per side, divided by k
    a, b = ag.Estimate(0.5, 0.4, 0.7, 100), ag.Estimate(0.75, 0.7, 0.75, 40)
    c = ag.combine_intervals([a, b])
    assert c.value == pytest.approx(0.625) and c.n == 140
    assert c.lo == pytest.approx(0.625 - (0.1**2 + 0.05**2) ** 0.5 / 2)
    assert c.hi == pytest.approx(0.625 + 0.2 / 2)
    # tasks that are all wrong keep their Wilson width in the average (a bootstrap would say [0, 0])
    zero = ag.mean_interval([0] * 4)
    assert zero.hi > 0 and ag.combine_intervals([zero, zero]).hi == pytest.approx(zero.hi / 2**0.5)
    assert ag.combine_intervals([ag.Estimate(0.95, 0.9, 1.4)]).hi == 1.0  # clipped to the share's range
    assert ag.combine_intervals([ag.Estimate(1.5, 1.2, 1.9)], bounds=None).hi == pytest.approx(1.9)
    assert ag.combine_intervals([ag.NONE]) == ag.NONE
    assert ag.combine_intervals([ag.Estimate(0.5), ag.Estimate(0.7, 0.6, 0.8)]).lo is None  # one unknown width

    # paired: stratified bootstrap of the mean of per-task paired differences
    big, small = [1, 0] * 300, [1, 1, 1, 0] * 10
    same = ag.mean_of_paired_differences([(big, big), (small, small)])
    assert (same.value, same.lo, same.hi) == (0.0, 0.0, 0.0)
    worse = [0] * 4 + small[4:]  # 3 of small's right answers lost: -7.5 points there, -3.75 on average
    d = ag.mean_of_paired_differences([(big, big), (worse, small)])
    assert d.value == pytest.approx(-0.0375) and d.lo <= -0.0375 <= d.hi <= 0 and d.n == 640


# ------------------------------------------------------------------------------------------------
# agreement figures from sample rows
# ------------------------------------------------------------------------------------------------
def _row(doc, output, fidelity=None, from_mask=None, **extra):
    row = {"doc_id": doc, "output": output, **extra}
    if fidelity is not None:
        row["fidelity"] = dict(zip(("tokens", "ar_equal", "mask_tokens", "mask_ar_equal"), fidelity))
    if from_mask is not None:
        row["from_mask"] = from_mask
    return row


def test_agreement_figures_identical_outputs():
    ref = [_row(i, f"answer number {i}", (5, 5, 0, 0)) for i in range(20)]
    figs = ag.agreement_figures(ag.pair_rows(ref, ref))
    for key in ("chrf", "token_f1", "ar_equal"):
        assert (figs[key].value, figs[key].lo, figs[key].hi, figs[key].n) == (1.0, 1.0, 1.0, 20), key
    assert figs["exact"].value == 1.0 and figs["exact"].hi == 1.0 and figs["exact"].lo < 1.0  # Wilson
    assert figs["fidelity"].value is None  # no token came from a mask
    assert figs["mask_share"].value == 0.0


def test_agreement_figures_counts_by_hand():
    ref = [_row(0, "The capital is Paris."), _row(1, "one two three"), _row(2, "x"), _row(9, "unpaired")]
    out = [
        _row(0, "The capital is Paris.", (6, 6, 3, 3)),
        _row(1, "one two four", (4, 3, 2, 1)),
        _row(2, "", (1, 0, 1, 0)),
        _row(5, "no reference", (9, 9, 9, 9)),
    ]
    pairs = ag.pair_rows(out, ref)
    assert [r["doc_id"] for r, _ in pairs] == [0, 1, 2]
    figs = ag.agreement_figures(pairs)
    assert figs["exact"].value == pytest.approx(1 / 3) and figs["exact"].n == 3
    assert figs["token_f1"].value == pytest.approx((1 + 2 / 3 + 0) / 3)
    assert figs["chrf"].value == pytest.approx((1 + ag.chrf("one two four", "one two three") + 0) / 3)
    assert figs["fidelity"].value == pytest.approx((3 + 1 + 0) / (3 + 2 + 1))
    assert figs["ar_equal"].value == pytest.approx(9 / 11)
    assert figs["mask_share"].value == pytest.approx(6 / 11)
    # without a fidelity record, the from_mask flags still give the share of mask tokens
    flags = ag.agreement_figures([(_row(0, "a", from_mask=[False, True, True, False]), _row(0, "a"))])
    assert flags["mask_share"].value == 0.5 and flags["fidelity"].value is None


# ------------------------------------------------------------------------------------------------
# points, table and plots from hand-made results folders
# ------------------------------------------------------------------------------------------------
def _plan(out: Path, tasks: list[dict], compare: list[Path] = (), thresholds=(1.0, 0.9)):
    from mars.evaluation.config import Plan
    from mars.evaluation.tasks import Suite, TaskSpec

    specs = [
        TaskSpec(name=t["name"], label=t["label"], metric="exact_match", filter="none", leaves=t["leaves"])
        for t in tasks
    ]
    suite = Suite(name="handmade", tasks=specs, include_path=[])
    resolved = {
        "model": {"name_or_path": "hand-made"},
        "benchmarks": {"name": "handmade", "tasks": tasks},
        "dtype": "float32",
    }
    return Plan(
        thresholds=list(thresholds),
        reference_added=False,
        block_size=4,
        model_label="hand",
        output_dir=out,
        suite=suite,
        decoding={"metric": "probability", "cache": "cursor", "max_new_tokens": 16},
        fingerprint={},
        resolved=resolved,
        compare=list(compare),
    )


def _write(store: ResultsDir, thr: float, leaf: str, rows: list[dict]):
    n = len(rows)
    tokens = sum(r["tokens"] for r in rows)
    forwards = sum(r["forwards"] for r in rows)
    summary = {
        "task": leaf,
        "threshold": thr,
        "metric": "exact_match,none",
        "accuracy": sum(r["score"] for r in rows) / n,
        "decoder": {"generated_tokens": tokens, "row_forwards": forwards, "batch_forwards": forwards, "seconds": 1.0},
    }
    store.write_point(thr, leaf, rows, summary)


def _sample(doc, score, output, tokens=4, forwards=4, mask=(0, 0)):
    return {
        "doc_id": doc,
        "score": score,
        "output": output,
        "tokens": tokens,
        "forwards": forwards,
        "fidelity": {
            "tokens": tokens,
            "ar_equal": tokens - (mask[0] - mask[1]),
            "mask_tokens": mask[0],
            "mask_ar_equal": mask[1],
        },
    }


@pytest.fixture
def handmade(tmp_path):
    """Two tasks at tau 1.0 and 0.9: 'QA' (right/wrong, 100 docs; 4 right answers lost at 0.9, 10 outputs
    changed) and 'Free' (no gold: scored by chrF against tau 1.0; 20 docs, 5 changed by one word)."""
    store = ResultsDir(tmp_path / "run")
    ref_qa = [_sample(i, float(i % 2 == 0), f"answer {i}") for i in range(100)]
    low_qa = []
    for i, r in enumerate(ref_qa):
        changed = i < 10  # docs 0, 2, 4, 6, 8 were right: 0, 2, 4, 6 turn wrong, 8 stays right
        score = 0.0 if i in (0, 2, 4, 6) else r["score"]
        low_qa.append(
            _sample(
                i,
                score,
                f"changed {i}" if changed else r["output"],
                tokens=4,
                forwards=2,
                mask=(2, 1 if changed else 2),
            )
        )
    _write(store, 1.0, "qa", ref_qa)
    _write(store, 0.9, "qa", low_qa)
    ref_free = [_sample(i, 1.0, f"the quick brown fox {i} jumps") for i in range(20)]
    low_free = [
        _sample(
            i, 1.0, r["output"].replace("quick", "slow") if i < 5 else r["output"], tokens=6, forwards=3, mask=(3, 3)
        )
        for i, r in enumerate(ref_free)
    ]
    _write(store, 1.0, "free", ref_free)
    _write(store, 0.9, "free", low_free)
    tasks = [
        {"name": "qa", "label": "QA", "leaves": ["qa"]},
        {"name": "free", "label": "Free", "leaves": ["free"], "score": "chrf"},
    ]
    return store, tasks, ref_qa, low_qa, ref_free, low_free


def test_points_carry_intervals_and_agreement(handmade):
    from mars.evaluation.aggregate import FIELDS, collect_points

    store, tasks, ref_qa, low_qa, ref_free, low_free = handmade
    points = collect_points(_plan(store.root, tasks), store)
    cell = {(p["threshold"], p["task"]): p for p in points}
    assert set(cell) == {(t, c) for t in (1.0, 0.9) for c in ("QA", "Free", "Average")}

    qa_ref, qa = cell[(1.0, "QA")], cell[(0.9, "QA")]
    assert qa_ref["accuracy"] == 0.5 and (qa_ref["accuracy_lo"], qa_ref["accuracy_hi"]) == pytest.approx(
        ag.wilson_interval(50, 100)
    )
    assert qa_ref["agreement"] == 1.0 and qa_ref["fidelity"] is None and qa_ref["ar_equal"] == 1.0
    assert qa["accuracy"] == pytest.approx(0.46) and qa["accuracy_delta"] == pytest.approx(-0.04)
    assert qa["accuracy_delta_lo"] < -0.04 < qa["accuracy_delta_hi"] < 0 and qa["n_paired"] == 100
    assert qa["agreement"] == pytest.approx(0.9) and qa["agreement_lo"] < 0.9 < qa["agreement_hi"]
    assert qa["tokens_per_forward"] == 2.0 and (qa["tokens_per_forward_lo"], qa["tokens_per_forward_hi"]) == (2.0, 2.0)
    assert qa["fidelity"] == pytest.approx((10 * 1 + 90 * 2) / 200) and qa["fidelity_tokens"] == 200
    assert qa["mask_share"] == pytest.approx(0.5)
    assert qa["agreement_token_f1"] == pytest.approx(
        sum(ag.token_f1(a["output"], b["output"]) for a, b in zip(low_qa, ref_qa)) / 100
    )

    free_ref, free = cell[(1.0, "Free")], cell[(0.9, "Free")]
    assert free_ref["score"] == "chrf" and free_ref["accuracy"] == 1.0
    assert (free_ref["accuracy_lo"], free_ref["accuracy_hi"]) == (1.0, 1.0)  # tau 1.0 against itself
    one_word = ag.chrf(low_free[0]["output"], ref_free[0]["output"])
    assert free["accuracy"] == pytest.approx((5 * one_word + 15) / 20) == free["agreement_chrf"]
    assert free["accuracy_delta"] == pytest.approx(free["accuracy"] - 1.0)
    assert free["agreement"] == 0.75 and free["fidelity"] == 1.0 and free["metric"].startswith("chrf vs")

    avg, avg_ref = cell[(0.9, "Average")], cell[(1.0, "Average")]
    assert avg["accuracy"] == pytest.approx(0.46)  # only the metric-scored entry
    assert avg["accuracy_delta"] == pytest.approx(-0.04) and avg["accuracy_delta_hi"] < 0
    assert avg["tokens_per_forward"] == pytest.approx(2.0)  # both entries run at 2 tokens per forward
    assert (avg["tokens_per_forward_lo"], avg["tokens_per_forward_hi"]) == (2.0, 2.0)
    assert avg["agreement"] == pytest.approx((0.9 + 0.75) / 2)
    assert avg["agreement_lo"] < avg["agreement"] < avg["agreement_hi"]
    assert (avg["accuracy_lo"], avg["accuracy_hi"]) == (qa["accuracy_lo"], qa["accuracy_hi"])  # one metric entry
    assert avg_ref["accuracy_delta"] == 0.0

    # files: every field in the CSV header, the JSON equal to the returned points
    header = (store.root / "points.csv").read_text().splitlines()[0].split(",")
    assert header == list(FIELDS)
    assert json.loads((store.root / "points.json").read_text()) == json.loads(json.dumps(points))


def test_compare_pairs_documents_with_another_run(handmade, tmp_path):
    from mars.evaluation.aggregate import collect_points

    store, tasks, ref_qa, *_ = handmade
    other = ResultsDir(tmp_path / "ar_sft")
    better = [dict(r, score=1.0) if r["doc_id"] in (1, 3) else r for r in ref_qa]  # 2 more right answers
    _write(other, 1.0, "qa", better)
    _write(other, 1.0, "free", [_sample(i, 1.0, f"the quick brown fox {i} jumps") for i in range(20)])
    write_json(other.root / "points.json", [{"label": "AR-SFT", "task": "QA", "threshold": 1.0}])
    points = collect_points(_plan(store.root, tasks, compare=[other.root]), store)
    cell = {(p["threshold"], p["task"]): p for p in points}
    at_ar, at_09 = cell[(1.0, "QA")], cell[(0.9, "QA")]
    assert at_ar["compare_label"] == "AR-SFT" and at_ar["compare_delta"] == pytest.approx(-0.02)
    assert at_ar["compare_n"] == 100 and at_ar["compare_delta_lo"] < -0.02 < at_ar["compare_delta_hi"]
    assert at_09["compare_delta"] is None and at_09["compare_threshold"] is None  # the other run has no 0.9
    assert at_09["compare_ar_delta"] == pytest.approx(-0.06)  # MARS at 0.9 vs the other model's AR
    assert cell[(0.9, "Average")]["compare_ar_delta"] == pytest.approx(-0.06)
    assert len(at_09["compare"]) == 1 and at_09["compare"][0]["path"] == str(other.root)


def test_unknown_score_kind_is_refused():
    from mars.evaluation.aggregate import score_kinds

    assert score_kinds({"tasks": [{"name": "a"}, {"name": "b", "score": "chrf"}, "c"]}) == {"a": "metric", "b": "chrf"}
    with pytest.raises(ValueError, match=r"'b'.*score must be one of.*'bleu'"):
        score_kinds({"tasks": [{"name": "b", "score": "bleu"}]})


def test_table_shows_intervals_agreement_and_comparisons(handmade, tmp_path):
    from mars.evaluation.aggregate import collect_points
    from mars.evaluation.report import fmt_interval, render_table

    assert fmt_interval(0.312, 0.298, 0.325) == "31.2 [29.8, 32.5]"
    assert fmt_interval(-0.004, -0.011, 0.002, sign=True) == "-0.4 [-1.1, 0.2]"
    assert fmt_interval(1.52, 1.47, 1.58, ".2f", 1.0) == "1.52 [1.47, 1.58]"
    assert fmt_interval(None, 0, 1) == "–" and fmt_interval(0.5, None, None) == "50.0"

    store, tasks, ref_qa, *_ = handmade
    other = ResultsDir(tmp_path / "ar_sft")
    _write(other, 1.0, "qa", ref_qa)
    write_json(other.root / "points.json", [{"label": "AR-SFT"}])
    plan = _plan(store.root, tasks, compare=[other.root])
    points = collect_points(plan, store)
    table = render_table(plan, points)
    qa = next(p for p in points if p["threshold"] == 0.9 and p["task"] == "QA")
    ci = (
        f"[{100 * qa['accuracy_lo']:.1f}, {100 * qa['accuracy_hi']:.1f}] (Δ [{100 * qa['accuracy_delta_lo']:+.1f}, "
        f"{100 * qa['accuracy_delta_hi']:+.1f}])"
    )
    free = next(p for p in points if p["threshold"] == 0.9 and p["task"] == "Free")
    free_acc = f"{100 * free['accuracy']:.1f} ({100 * free['accuracy_delta']:+.1f})"
    assert f"| **0.9** | acc | 46.0 (-4.0) | {free_acc} | 46.0 (-4.0) |" in table  # Free: chrF vs tau=1.0
    assert f"|  | 95% CI | {ci} |" in table
    assert "|  | tok/fwd | 2.00 [2.00, 2.00] |" in table
    assert "## Agreement with the τ = 1.0 output" in table
    assert "| 0.9 | QA | 100 | 90.0 [" in table
    assert "## Paired comparisons" in table and "### vs AR-SFT" in table
    assert "|  | vs its AR | -4.0 [" in table  # QA at 0.9 against the other run's tau 1.0 (same docs as ref)
    assert "Free (chrf)" in table  # says which columns are scored against the tau=1.0 output


def test_points_record_their_interval_method_and_the_plot_names_it(handmade):
    """The figure says which interval it draws: Wilson for right/wrong scores, none for a score against
    the tau = 1.0 output at tau = 1.0 itself, the tasks' intervals combined for the Average."""
    from mars.evaluation.aggregate import collect_points
    from mars.evaluation.plots import pareto_figure

    store, tasks, *_ = handmade
    points = collect_points(_plan(store.root, tasks), store)
    by = {(p["task"], p["threshold"]): p for p in points}
    assert by[("QA", 1.0)]["accuracy_interval"] == "Wilson"
    assert by[("Free", 1.0)]["accuracy_interval"] == "none" and by[("Free", 0.9)]["accuracy_interval"] == "bootstrap"
    assert by[("Average", 1.0)]["accuracy_interval"] == "combined"

    def caption(task):
        fig = pareto_figure(task, {"hand B=4": [p for p in points if p["task"] == task]})
        return " ".join(t.get_text() for t in fig.texts)

    assert "τ=1.0 bar and band: Wilson interval; other τ: paired bootstrap of the change" in caption("QA")
    assert "τ=1.0 is the reference itself" in caption("Free")
    assert "the tasks' intervals combined" in caption("Average")


def test_pareto_draws_error_bars_and_the_ar_band(handmade):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from mars.evaluation.aggregate import collect_points
    from mars.evaluation.plots import _errors, render_pareto

    store, tasks, *_ = handmade
    points = collect_points(_plan(store.root, tasks), store)
    qa = [p for p in points if p["task"] == "QA"]
    ordered = sorted(qa, key=lambda p: -p["threshold"])  # tau 1.0, then 0.9
    low, high = _errors(ordered, "accuracy", 100.0)
    assert low[0] == pytest.approx(100 * (qa[0]["accuracy"] - qa[0]["accuracy_lo"])) and all(v >= 0 for v in high)
    low_p, high_p = _errors(ordered, "accuracy", 100.0, paired=True)
    assert low_p[0] == low[0]  # the reference keeps its own interval
    p = ordered[1]  # below 1.0: the paired interval of the change, around the point (narrower here)
    assert low_p[1] == pytest.approx(100 * (p["accuracy_delta"] - p["accuracy_delta_lo"])) and low_p[1] < low[1]
    assert high_p[1] == pytest.approx(100 * (p["accuracy_delta_hi"] - p["accuracy_delta"]))
    assert _errors([{"accuracy": 0.5}], "accuracy", 100.0) is None

    calls = {"errorbar": [], "axhspan": []}
    original = {name: getattr(Axes, name) for name in calls}

    def spy(name):
        def wrapped(self, *args, **kwargs):
            calls[name].append((args, kwargs))
            return original[name](self, *args, **kwargs)

        return wrapped

    for name in calls:
        setattr(Axes, name, spy(name))
    try:
        png = render_pareto("QA", {"hand B=4": qa})
    finally:
        for name, fn in original.items():
            setattr(Axes, name, fn)
    assert png[:4] == b"\x89PNG"
    # two panels: against tokens per forward, then against the measured speed-up (no interval along it)
    (_args, kwargs), (speed_args, speed_kwargs) = calls["errorbar"]
    by_speed = sorted(qa, key=lambda p: p["speedup"])
    assert list(speed_args[0]) == [p["speedup"] for p in by_speed] and speed_kwargs["xerr"] is None
    # x: each point's own tokens-per-forward interval around it (the plot orders points by tokens per forward)
    by_tpf = sorted(qa, key=lambda p: p["tokens_per_forward"])
    tpf = [(p["tokens_per_forward"], p["tokens_per_forward_lo"], p["tokens_per_forward_hi"]) for p in by_tpf]
    assert kwargs["xerr"] == [[pytest.approx(v - lo) for v, lo, _ in tpf], [pytest.approx(hi - v) for v, _, hi in tpf]]
    assert [p["threshold"] for p in by_tpf] == [p["threshold"] for p in ordered] and kwargs["yerr"] == [low_p, high_p]
    (band, _), (speed_band, _) = calls["axhspan"]
    ref = next(p for p in qa if p["is_reference"])
    assert band == pytest.approx((100 * ref["accuracy_lo"], 100 * ref["accuracy_hi"])) == speed_band
