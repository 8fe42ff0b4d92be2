"""python -m mars.evaluation.probe on a tiny exported checkpoint and on a Lightning checkpoint of a run."""

import json

from mars.evaluation.probe import main


def test_probe_reports_tokens_per_forward_and_fidelity(tmp_path, compose_cfg, tiny_train_overrides):
    from mars.train import run

    cfg = compose_cfg("train", tiny_train_overrides + ["trainer.max_steps=2", "checkpoint_every=1"])
    hf = run(cfg)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": q}) + "\n" for q in ["Say hi.", "Count to three.", "Name a fish."])
    )
    for checkpoint in (hf, hf.parent / "checkpoints" / "last.ckpt"):
        out = tmp_path / f"probe-{checkpoint.name}.json"
        assert (
            main(
                [
                    "--checkpoint",
                    str(checkpoint),
                    "--prompts",
                    str(prompts),
                    "--n",
                    "3",
                    "--thresholds",
                    "0.3",
                    "--max-new-tokens",
                    "8",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        result = json.loads(out.read_text())
        ref, low = result["results"]
        assert ref["threshold"] == 1.0 and ref["identical_to_tau_1"] == 1.0 and ref["tokens_per_forward"] == 1.0
        assert ref["mask_tokens_share"] == 0.0
        assert low["threshold"] == 0.3 and low["tokens_per_forward"] >= 1.0
        assert result["block_size"] == 4
