"""Gated and plain LoRA adapters (mars.adapters): where they act, what they save, what they refuse."""

import json

import pytest
import torch
from decoding_fixtures import give_adapter_weights
from safetensors.torch import load_file, save_file

from mars.adapters import (
    MASK_DELTA_KEY,
    AdapterError,
    AdapterSettings,
    attach_adapter,
    base_digest,
    load_adapter,
    merge_adapter,
    recorded_base_digest,
    save_adapter,
    truncate_adapter_rank,
    warm_start_adapter,
)
from mars.models import build_tiny_random

MASK_ID = 16


def tiny(seed: int = 0):
    return build_tiny_random(vocab_size=97 + MASK_ID, hidden_size=32, num_layers=2, intermediate_size=64, seed=seed)


def ids_with_masks(n=2, length=12, masks_from=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(MASK_ID + 1, 97, (n, length), generator=g)
    masked = ids.clone()
    masked[:, masks_from:] = MASK_ID
    return ids, masked


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_gated_adapter_leaves_every_real_column_bit_identical_and_changes_mask_columns():
    base = tiny()
    adapted = tiny()
    attach_adapter(adapted, AdapterSettings(kind="gated_lora", rank=4), MASK_ID)
    give_adapter_weights(adapted, seed=1)
    ids, masked = ids_with_masks()
    assert torch.equal(logits(adapted, ids), logits(base, ids))  # no mask token: exactly the base model
    out, ref = logits(adapted, masked), logits(base, masked)
    assert torch.equal(out[:, :8], ref[:, :8])  # real columns before the masks
    assert (out[:, 8:] - ref[:, 8:]).abs().amax() > 1e-2  # the adapter acts at mask columns


def test_plain_lora_acts_on_every_column_and_merges_into_a_plain_model():
    base_params = sum(p.numel() for p in tiny().parameters())
    adapted = tiny()
    attach_adapter(adapted, AdapterSettings(kind="lora", rank=4), MASK_ID)
    give_adapter_weights(adapted, seed=1)
    ids, masked = ids_with_masks()
    assert (logits(adapted, ids) - logits(tiny(), ids)).abs().amax() > 1e-2
    before = logits(adapted, masked)
    merged = merge_adapter(adapted)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert sum(p.numel() for p in merged.parameters()) == base_params
    # tied embeddings: the merged mask-embedding delta also moves the mask token's own head row (a token
    # decoding never emits); every other logit is the adapter model's
    keep = torch.arange(before.shape[-1]) != MASK_ID
    torch.testing.assert_close(logits(merged, masked)[..., keep], before[..., keep], atol=1e-4, rtol=1e-4)


def test_gated_adapter_cannot_be_merged():
    model = tiny()
    attach_adapter(model, AdapterSettings(kind="gated_lora", rank=2), MASK_ID)
    with pytest.raises(AdapterError, match="cannot be merged"):
        merge_adapter(model)


def test_only_the_adapter_trains():
    model = tiny()
    attach_adapter(model, AdapterSettings(kind="gated_lora", rank=2, top_layers=1, mask_embedding=False), MASK_ID)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "layers.1." in n for n in trainable)


def save(model, folder, **meta):
    return save_adapter(
        model, folder, {"base_model": "tiny", "base_digest": base_digest(model), "block_size": 4, **meta}
    )


def test_saved_adapter_reloads_to_the_same_outputs(tmp_path):
    model = tiny()
    attach_adapter(model, AdapterSettings(kind="gated_lora", rank=4), MASK_ID)
    give_adapter_weights(model, seed=1)
    folder = save(model, tmp_path / "adapter", mask_token_id=MASK_ID)
    files = {p.name for p in folder.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "mars_adapter.json"} <= files
    stored = load_file(folder / "adapter_model.safetensors")
    recorded = json.loads((folder / "mars_adapter.json").read_text())["adapter_parameters"]
    assert recorded == sum(t.numel() for t in stored.values()) > 0
    fresh = tiny()
    load_adapter(fresh, folder, MASK_ID, block_size=4)
    _, masked = ids_with_masks()
    assert torch.equal(logits(fresh, masked), logits(model, masked))


def test_an_adapter_refuses_another_base_a_second_application_and_another_block_size(tmp_path):
    model = tiny()
    attach_adapter(model, AdapterSettings(kind="gated_lora", rank=2), MASK_ID)
    folder = save(model, tmp_path / "adapter")
    with pytest.raises(AdapterError, match="another base model"):
        load_adapter(tiny(seed=5), folder, MASK_ID)
    with pytest.raises(AdapterError, match="already carries an adapter"):
        load_adapter(model, folder, MASK_ID)
    with pytest.raises(AdapterError, match="block size 4, not 8"):
        load_adapter(tiny(), folder, MASK_ID, block_size=8)


def test_an_adapter_records_its_base_before_training_casts_it(tmp_path):
    """bf16-true training (CPUs with native bf16) casts the whole model after the adapter is attached; the
    export must record the fp32 base the adapter will be loaded onto, or loading it refuses its own base."""
    model = tiny()
    attach_adapter(model, AdapterSettings(kind="gated_lora", rank=2), MASK_ID)
    model.to(torch.bfloat16)
    assert base_digest(model) != base_digest(tiny()) and recorded_base_digest(model) == base_digest(tiny())
    folder = save_adapter(
        model, tmp_path / "adapter", {"base_model": "tiny", "base_digest": recorded_base_digest(model)}
    )
    load_adapter(tiny(), folder, MASK_ID)
    with pytest.raises(AdapterError, match="another base model"):
        load_adapter(tiny(seed=5), folder, MASK_ID)


def trained_adapter(tmp_path, **meta):
    model = tiny()
    attach_adapter(model, AdapterSettings(kind="gated_lora", rank=2), MASK_ID)
    give_adapter_weights(model, seed=1)
    return save(model, tmp_path / "adapter", mask_token_id=MASK_ID, **meta)


def test_an_adapter_missing_tensors_is_refused_naming_them(tmp_path):
    """Loaded anyway, the layer whose tensors are missing would keep lora_B at zero: silently unadapted."""
    folder = trained_adapter(tmp_path)
    weights = folder / "adapter_model.safetensors"
    state = load_file(weights)
    save_file({k: v for k, v in state.items() if ".layers.1." not in k}, weights)
    with pytest.raises(AdapterError, match=r"adapter_model.safetensors lacks 14 of the adapter's tensors.*layers\.1\."):
        load_adapter(tiny(), folder, MASK_ID)
    save_file({k: v for k, v in state.items() if k != MASK_DELTA_KEY}, weights)
    with pytest.raises(AdapterError, match=f"lacks 1 of the adapter's tensors, e.g. \\['{MASK_DELTA_KEY}'\\]"):
        load_adapter(tiny(), folder, MASK_ID)


@pytest.mark.parametrize("digest", ["absent", None, "", "  "])
def test_an_adapter_without_a_base_digest_is_refused_before_the_base_loads(tmp_path, digest):
    """Without the digest the base check cannot run, and the adapter would be applied to any base model."""
    from mars.models import load_model

    folder = trained_adapter(tmp_path)
    meta_path = folder / "mars_adapter.json"
    meta = json.loads(meta_path.read_text())
    meta["base_model"] = str(tmp_path / "no" / "such" / "base")  # reached, it would fail differently
    if digest == "absent":
        del meta["base_digest"]
    else:
        meta["base_digest"] = digest
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(AdapterError, match="mars_adapter.json records no base_digest"):
        load_adapter(tiny(), folder, MASK_ID)
    with pytest.raises(AdapterError, match="records no base_digest"):
        load_model(str(folder))


def test_a_truncated_adapter_file_is_refused_naming_the_file(tmp_path):
    from mars.models import load_model

    folder = trained_adapter(tmp_path)
    weights = folder / "adapter_model.safetensors"
    whole = weights.read_bytes()
    for size in (4, len(whole) // 2):
        weights.write_bytes(whole[:size])
        with pytest.raises(AdapterError, match=f"{weights}.* truncated"):
            load_adapter(tiny(), folder, MASK_ID)
    meta = json.loads((folder / "mars_adapter.json").read_text())
    (folder / "mars_adapter.json").write_text(json.dumps({**meta, "base_model": str(tmp_path / "no-base")}))
    with pytest.raises(AdapterError, match=f"{weights}.* truncated"):
        load_model(str(folder))  # before the base model loads


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"kind": "qlora"}, "adapter.kind"),
        ({"kind": "gated_lora", "rank": 0}, "adapter.rank"),
        ({"kind": "lora", "dropout": 1.0}, "adapter.dropout"),
        ({"kind": "lora", "top_layers": 0}, "adapter.top_layers"),
        ({"kind": "lora", "ranks": 4}, "unknown adapter settings"),
    ],
)
def test_bad_adapter_settings_fail_naming_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        AdapterSettings.from_dict(bad)


def test_a_forward_without_input_ids_is_refused_rather_than_silently_ungated():
    model = tiny()
    attach_adapter(model, AdapterSettings(kind="gated_lora", rank=2), MASK_ID)
    embeds = model.get_input_embeddings()(ids_with_masks()[0])
    with pytest.raises(ValueError, match="needs input_ids"):
        model(inputs_embeds=embeds)


def test_truncating_the_rank_keeps_a_low_rank_product_and_never_touches_real_columns():
    base = tiny()
    adapted = tiny()
    attach_adapter(adapted, AdapterSettings(kind="gated_lora", rank=4), MASK_ID)
    give_adapter_weights(adapted, seed=1)
    with torch.no_grad():  # give every product B A rank 2: its rows of A beyond the second repeat the first two
        for name, p in adapted.named_parameters():
            if "lora_A" in name:
                p[2:] = p[:2] * torch.tensor([[0.5], [-2.0]])
    ids, masked = ids_with_masks()
    before = logits(adapted, masked)
    assert truncate_adapter_rank(adapted, 2) > 1 - 1e-9  # nothing of a rank-2 product is lost
    layers = [m for m in adapted.modules() if hasattr(m, "lora_A")]
    assert all(m.lora_A["default"].weight.shape[0] == 2 and m.lora_B["default"].weight.shape[1] == 2 for m in layers)
    after = logits(adapted, masked)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    assert truncate_adapter_rank(adapted, 1) < 0.999  # a rank-2 product loses energy at rank 1
    out, ref = logits(adapted, masked), logits(base, masked)
    assert torch.equal(out[:, :8], ref[:, :8])  # real columns: still exactly the base model
    assert (out[:, 8:] - after[:, 8:]).abs().amax() > 1e-3  # the masks' logits moved
    assert torch.equal(logits(adapted, ids), logits(base, ids))


def test_truncating_the_rank_refuses_a_plain_lora_no_adapter_and_a_bad_rank():
    plain = tiny()
    attach_adapter(plain, AdapterSettings(kind="lora", rank=4), MASK_ID)
    with pytest.raises(AdapterError, match="only a gated adapter"):
        truncate_adapter_rank(plain, 2)
    with pytest.raises(AdapterError, match="no MARS adapter"):
        truncate_adapter_rank(tiny(), 2)
    gated = tiny()
    attach_adapter(gated, AdapterSettings(kind="gated_lora", rank=4), MASK_ID)
    with pytest.raises(AdapterError, match="integer >= 1"):
        truncate_adapter_rank(gated, 0)


def test_an_adapter_checkpoint_saved_at_a_lower_rank_reloads_as_the_truncated_adapter(tmp_path, capsys):
    from mars.decoding import generate
    from mars.models import load_model
    from mars.training.adapter_rank import main
    from mars.training.export import export_adapter

    base = load_model("tiny-random")
    trained = load_model("tiny-random")
    attach_adapter(trained.model, AdapterSettings(kind="gated_lora", rank=4, alpha=8), trained.mask.id)
    give_adapter_weights(trained.model, seed=1)
    meta = dict(
        block_size=4,
        objective="mars",
        mask_token=trained.mask.token,
        mask_token_id=trained.mask.id,
        base_model="tiny-random",
        base_num_parameters=sum(p.numel() for p in base.model.parameters()),
    )
    source = export_adapter(trained.model, trained.tokenizer, tmp_path / "rank4", meta, dtype=torch.bfloat16)
    main([str(source), str(tmp_path / "rank2"), "--rank", "2"])
    assert "rank 4 -> 2" in capsys.readouterr().out

    reference = load_model(str(source))
    kept = truncate_adapter_rank(reference.model, 2)
    lower = load_model(str(tmp_path / "rank2"))
    assert lower.model.mars_adapter.rank == 2 and lower.model.mars_adapter.alpha == 4  # scaling alpha / r stays 2
    pairs = list(zip(reference.model.named_parameters(), lower.model.named_parameters()))
    factors = [(name, a, b) for (name, a), (_, b) in pairs if "lora_" in name]
    assert factors
    for name, a, b in factors:  # rank 2, stored in the source file's bf16
        assert (b.shape[0] if "lora_A" in name else b.shape[1]) == 2
        assert torch.equal(b, a.to(torch.bfloat16).float())
    layers = [m for m in lower.model.modules() if hasattr(m, "lora_A")]
    assert all(m.scaling["default"] == 2.0 for m in layers)
    written = json.loads((tmp_path / "rank2" / "mars_adapter.json").read_text())
    assert written["truncated_from_rank"] == 4 and written["energy_kept"] == pytest.approx(kept, abs=1e-6)
    assert kept < 1  # random rank-4 products lose energy at rank 2
    # the gate still leaves real columns to the base: threshold 1.0 and verify decode as the base does
    prompts = ["hello there", "what is two and two"]
    ar = generate(base.model, base.tokenizer, prompts, decoder="ar", max_new_tokens=12)
    for kwargs in (dict(threshold=1.0), dict(verify=True)):
        out = generate(lower.model, lower.tokenizer, prompts, block_size=4, max_new_tokens=12, **kwargs)
        assert out.token_ids == ar.token_ids, kwargs


@pytest.mark.parametrize(
    "args,match",
    [
        (["--rank", "4"], "adapter's rank 4"),
        (["--rank", "0"], "adapter's rank 4"),
        (["--rank", "2", "--same-folder"], "is the source checkpoint"),
        (["--rank", "2", "--no-adapter"], "not an adapter checkpoint"),
        (["--rank", "2", "--no-weights"], "no adapter_model.safetensors"),
    ],
)
def test_saving_at_a_lower_rank_refuses_before_loading_a_model(tmp_path, capsys, args, match):
    from mars.training.adapter_rank import main

    source = tmp_path / "source"
    model = tiny()
    attach_adapter(model, AdapterSettings(kind="gated_lora", rank=4), MASK_ID)
    save(model, source, mask_token_id=MASK_ID)
    if "--no-adapter" in args:
        (source / "mars_adapter.json").unlink()
    if "--no-weights" in args:
        (source / "adapter_model.safetensors").unlink()
    out = source if "--same-folder" in args else tmp_path / "out"
    flags = [a for a in args if not a.startswith("--same") and not a.startswith("--no-")]
    with pytest.raises(SystemExit):
        main([str(source), str(out), *flags])
    assert match in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_warm_start_predicts_as_the_saved_adapter_at_a_higher_rank_and_every_direction_learns(tmp_path):
    """Training continued from a committed adapter (``adapter.init_from``): rank 4 at scale 2 into rank 8 at
    scale 1 gives the saved adapter's mask-column logits; the new directions start with B at zero and A random,
    so the first backward reaches them."""
    saved = tiny()
    attach_adapter(saved, AdapterSettings(kind="gated_lora", rank=4, alpha=8), MASK_ID)
    give_adapter_weights(saved, seed=3)
    folder = save(saved, tmp_path / "rank4")
    _, masked = ids_with_masks()
    model = tiny()
    attach_adapter(model, AdapterSettings(kind="gated_lora", rank=8, alpha=8, init_from=str(folder)), MASK_ID)
    fresh = logits(model, masked)
    warm_start_adapter(model, folder, block_size=4)
    out = logits(model, masked)
    assert (fresh[:, 8:] - out[:, 8:]).abs().amax() > 1e-2  # the start moved off the fresh init
    torch.testing.assert_close(out, logits(saved, masked), atol=1e-5, rtol=1e-5)
    model(masked).logits[:, 8:].square().sum().backward()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            assert p.grad[:, 4:].abs().amax() > 0, name  # the four new directions train


def test_a_warm_start_refuses_an_adapter_that_does_not_fit(tmp_path):
    saved = tiny()
    attach_adapter(saved, AdapterSettings(kind="gated_lora", rank=4), MASK_ID)
    folder = save(saved, tmp_path / "rank4")
    cases = [
        (tiny(), AdapterSettings(kind="gated_lora", rank=2), 4, "rank: 4 there, above 2 here"),
        (tiny(), AdapterSettings(kind="lora", rank=4), 4, "kind: 'gated_lora' there"),
        (tiny(seed=5), AdapterSettings(kind="gated_lora", rank=4), 4, "another base model"),
        (tiny(), AdapterSettings(kind="gated_lora", rank=4), 8, "block size 4"),
    ]
    for model, settings, block, message in cases:
        attach_adapter(model, settings, MASK_ID)
        with pytest.raises(AdapterError, match=message):
            warm_start_adapter(model, folder, block_size=block)
    with pytest.raises(ValueError, match="needs adapter.kind"):
        AdapterSettings(kind="none", init_from=str(folder))
