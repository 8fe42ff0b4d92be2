"""vLLM with MARS drafters (``make test-vllm``; vLLM runs in ``.venv-vllm``): the drafter's proposals for each step
are this project's mask predictions for the same prefix, vLLM with the drafter decodes exactly as vLLM's AR, and
vLLM's per-position acceptance is the one the project's masks reach on the same steps.  Two vLLM processes in
all (a tiny model, the embedded one), a few eager engines each."""

import json

import pytest

from mars.integrations.export import export_for_vllm
from mars.integrations.vllm_compare import compare_run, vllm_figures

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_job():
    from mars.integrations.vllm_env import run_job

    return run_job


# vLLM's CPU attention takes head sizes of 32 and more: the default tiny model's 16 is refused
TINY = {"hidden_size": 128, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 256}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, vllm_job):
    """A tiny gated adapter as a vLLM drafter (K=3) for its own base model, and vLLM's AR of that base."""
    from mars_checkpoints import make_gated_checkpoint

    from mars.models import load_model

    folder = tmp_path_factory.mktemp("tiny-vllm")
    gated_checkpoint = make_gated_checkpoint(folder / "adapter", tiny=TINY)
    drafter = export_for_vllm(gated_checkpoint, folder / "gated")
    base = load_model("tiny-random", tiny=TINY)
    base.model.save_pretrained(folder / "base")
    base.tokenizer.save_pretrained(folder / "base")
    lm = load_model(str(gated_checkpoint))
    prompts = [lm.tokenizer(p)["input_ids"] for p in ("hello there", "what is two and two", "a short story:")]
    job = {
        "model": str(folder / "base"),
        "prompts": prompts,
        "max_tokens": 24,
        "ignore_eos": True,
        "runs": [{"name": "AR"}, {"name": "gated K=3", "drafter": {"model": str(drafter), "k": 3}, "record": True}],
    }
    return lm, prompts, vllm_job(job, log=folder / "vllm.log")


def test_tiny_gated_drafter_proposes_the_projects_mask_predictions_and_keeps_vllms_ar_output(tiny):
    lm, prompts, result = tiny
    ar, drafted = result["runs"]
    assert drafted["outputs"] == ar["outputs"]
    comparison = compare_run(lm.model, prompts, drafted, lm.mask.id)
    assert comparison.positions > 0 and comparison.equal_share >= 0.99, comparison.first_differences
    # the first draft comes from the bonus, where the gate is off: the base model's own next token
    assert comparison.acceptance("project")[0] == 1.0


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, vllm_job):
    """The embedded model with the shipped adapter: vLLM AR, the gated drafter at K=3, the merged drafter at K=2."""
    from transformers import AutoModelForCausalLM

    from mars.integrations.vllm_bench import ADAPTER, heldout_prompts
    from mars.models import embedded_model_dir, load_model
    from mars.paths import data_dir

    folder = tmp_path_factory.mktemp("embedded-vllm")
    adapter = data_dir() / ADAPTER
    gated = export_for_vllm(adapter, folder / "gated")
    merged = export_for_vllm(adapter, folder / "merged", merge=True)
    lm = load_model(str(adapter))
    prompts = heldout_prompts(lm.tokenizer, 4)
    job = {
        "model": str(embedded_model_dir()),
        "prompts": prompts,
        "max_tokens": 32,
        "runs": [
            {"name": "AR"},
            {"name": "gated K=3", "drafter": {"model": str(gated), "k": 3}, "record": True},
            {"name": "merged K=2", "drafter": {"model": str(merged), "k": 2}, "record": True},
        ],
    }
    merged_model = AutoModelForCausalLM.from_pretrained(merged).eval()
    return lm, merged_model, prompts, vllm_job(job, log=folder / "vllm.log")


def test_vllm_with_the_mars_drafter_decodes_as_vllm_ar_and_as_this_projects_ar(embedded):
    from mars.decoding import generate

    lm, _, prompts, result = embedded
    ar = result["runs"][0]["outputs"]
    for run in result["runs"][1:]:
        assert run["outputs"] == ar, run["name"]
    ours = generate(lm.model, lm.tokenizer, prompts, max_new_tokens=32).token_ids
    assert ours == ar


def test_the_gated_drafters_proposals_are_the_shipped_adapters_mask_predictions(embedded):
    lm, _, prompts, result = embedded
    comparison = compare_run(lm.model, prompts, result["runs"][1], lm.mask.id)
    assert comparison.equal_share >= 0.99, json.dumps(comparison.first_differences)
    figures = vllm_figures(result["runs"][1])
    assert figures["acceptance_by_position"][0] == 1.0  # the bonus's prediction is the base's own next token
    # vLLM's per-position acceptance against the project's masks on the same steps: within 3 points each
    for theirs, ours in zip(figures["acceptance_by_position"], comparison.acceptance("project")):
        assert abs(theirs - ours) <= 0.03, (figures, comparison.as_dict())


def test_the_merged_drafters_proposals_are_the_merged_weights_predictions(embedded):
    lm, merged_model, prompts, result = embedded
    comparison = compare_run(merged_model, prompts, result["runs"][2], lm.mask.id)
    assert comparison.equal_share >= 0.99, json.dumps(comparison.first_differences)
