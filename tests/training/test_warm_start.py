"""Training continued from a saved adapter (``adapter.init_from``): a long run cut into pieces on machines that
keep only the committed adapter, not the optimizer states."""

import json

import torch

from mars.models import load_model
from mars.training.run import run


def _mask_logits(loaded, ids):
    masked = torch.tensor([ids + [loaded.mask.id] * 3])
    with torch.no_grad():
        return loaded.model(masked).logits[0, -3:]


def test_a_run_started_from_a_saved_adapter_trains_on_from_its_predictions(
    compose_cfg, tiny_train_overrides, gated_checkpoint, tmp_path
):
    over = ["adapter=gated_lora", "objective=mars_gated", "adapter.rank=8", f"adapter.init_from={gated_checkpoint}"]
    # one step at a vanishing learning rate: the export is the warm start itself
    out = run(compose_cfg("train", tiny_train_overrides + over + ["trainer.max_steps=1", "optim.lr=1e-12"]))
    saved, started = load_model(str(gated_checkpoint)), load_model(str(out))
    assert started.model.mars_adapter.rank == 8
    assert json.loads((out / "mars_adapter.json").read_text())["settings"]["init_from"] == str(gated_checkpoint)
    ids = started.tokenizer("the moon is", add_special_tokens=False)["input_ids"]
    fresh = load_model("tiny-random")
    torch.testing.assert_close(_mask_logits(started, ids), _mask_logits(saved, ids), atol=1e-4, rtol=1e-4)
    assert (_mask_logits(fresh, ids) - _mask_logits(saved, ids)).abs().amax() > 1e-2  # the saved adapter moves them
