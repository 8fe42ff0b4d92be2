"""The vLLM comparison's table: every run's tokens/s against its own AR (vLLM's of the same compilation mode, this
project's) and against the fastest AR of the run; no speed figure without ``--timing``."""

from mars.integrations.vllm_bench import table

SPEC = {"drafts": 4, "accepted_tokens": 2, "draft_tokens": 8, "accepted_per_position": [2, 0]}


def _report() -> dict:
    out = [[1, 2], [3]]
    vllm = [
        {"name": "AR", "outputs": out, "tokens_per_s": 10.0},
        {"name": "gated K=2", "outputs": out, "tokens_per_s": 8.0, "drafter": {"k": 2}, "spec": SPEC},
        {"name": "AR, compiled", "outputs": out, "tokens_per_s": 12.0, "compile": True},
        {
            "name": "gated K=2, compiled",
            "outputs": [[1, 2], [4]],
            "tokens_per_s": 9.0,
            "compile": True,
            "drafter": {"k": 2},
            "spec": SPEC,
        },
    ]
    project = [
        {"name": "project AR", "outputs": out, "tokens_per_s": 20.0, "mean_acceptance_length": None,
         "acceptance_by_position": None},
        {"name": "project verify", "outputs": out, "tokens_per_s": 25.0, "mean_acceptance_length": 1.5,
         "acceptance_by_position": [0.5]},
    ]  # fmt: skip
    return {"vllm": {"runs": vllm}, "project": project, "comparisons": {}}


def _row(text: str, name: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_each_run_is_held_against_its_own_ar_and_the_fastest_ar():
    text = table(_report(), timing=True)
    assert _row(text, "vLLM gated K=2")[2:5] == ["8.0", "0.80x", "0.40x"]  # eager AR 10, fastest AR 20
    assert _row(text, "vLLM gated K=2, compiled")[1:5] == ["1/2", "9.0", "0.75x", "0.45x"]  # compiled AR 12
    assert _row(text, "project verify")[2:5] == ["25.0", "1.25x", "1.25x"]
    assert _row(text, "project AR")[3:5] == ["1.00x", "1.00x"]


def test_without_timing_no_speed_figure_is_shown():
    text = table(_report(), timing=False)
    assert _row(text, "project verify")[2:5] == ["-", "-", "-"]


def test_verify_names_its_draft_layout_and_shows_only_the_depths_it_drafts():
    report = _report()
    report["project"][1] |= {"tree": "1", "acceptance_by_position": [0.5, 0.0, 0.0]}
    row = _row(table(report, timing=False), "project verify (tree `1`)")
    assert row[5:7] == ["1.50", "0.50"]
