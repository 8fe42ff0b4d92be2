"""``mars-bench probe`` on a tiny exported checkpoint and on a Lightning checkpoint of a run."""

import json
import math

import pytest

from mars.bench.probe import main

PROMPTS = ["Say hi.", "Count to three.", "Name a fish."]
# Below 1/vocab (49,152 tokens: the top probability is at least 1/49,152), so every prediction of the
# window is accepted: each forward commits block_size tokens until the row stops.
ACCEPT_ALL = 1e-5


def _probe(checkpoint, prompts, out):
    argv = ["--checkpoint", str(checkpoint), "--prompts", str(prompts), "--n", "3"]
    argv += ["--thresholds", str(ACCEPT_ALL), "--max-new-tokens", "8", "--out", str(out)]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_probe_reports_tokens_per_forward_and_fidelity(tmp_path, compose_cfg, tiny_train_overrides):
    from mars.decoding import generate
    from mars.models import load_model
    from mars.training.run import run

    cfg = compose_cfg("train", tiny_train_overrides + ["trainer.max_steps=2", "checkpoint_every=1"])
    hf = run(cfg)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in PROMPTS))
    exported = _probe(hf, prompts, tmp_path / "probe-hf.json")
    ref, low = exported["results"]
    assert exported["block_size"] == 4 and exported["prompts"] == 3
    assert ref["threshold"] == 1.0 and ref["identical_to_tau_1"] == 1.0 and ref["tokens_per_forward"] == 1.0
    assert ref["mask_tokens_share"] == 0.0 and ref["mask_fidelity"] is None

    # the same figures recomputed from generate's own outputs and statistics
    loaded = load_model(str(hf))
    tok = loaded.tokenizer
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in PROMPTS
    ]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    runs = {
        thr: generate(
            loaded.model, tok, ids, threshold=thr, block_size=4, max_new_tokens=8, mask_token_id=loaded.mask.id
        )
        for thr in (1.0, ACCEPT_ALL)
    }
    direct = runs[ACCEPT_ALL]
    tokens = [len(t) for t in direct.token_ids]
    assert direct.stats.per_row_forwards == [math.ceil(n / 4) for n in tokens]  # every window accepted whole
    assert low["threshold"] == ACCEPT_ALL and low["generated_tokens"] == sum(tokens)
    rates = [n / f for n, f in zip(tokens, direct.stats.per_row_forwards)]
    assert low["tokens_per_forward"] == pytest.approx(sum(rates) / len(rates), abs=5e-4)  # the mean per request
    assert low["tokens_per_forward"] > 1.0
    masks = sum(map(sum, direct.from_mask))
    assert low["mask_tokens_share"] == pytest.approx(masks / sum(tokens), abs=5e-4)
    same = sum(a == b for a, b in zip(direct.token_ids, runs[1.0].token_ids))
    assert low["identical_to_tau_1"] == pytest.approx(same / len(PROMPTS), abs=5e-4)

    # the run's Lightning checkpoint holds the same weights: the same figures, read through the base model
    from_ckpt = _probe(hf.parent / "checkpoints" / "last.ckpt", prompts, tmp_path / "probe-ckpt.json")
    drop = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert drop(from_ckpt["results"]) == drop(exported["results"])
    assert from_ckpt["block_size"] == 4
