"""The loader evaluation, serving and the benchmarks share: a checkpoint in place of the model config's
``name_or_path``, with the mask token it was trained with, and the model config's own keys without one."""

import torch

from mars.decoding.fastpath import decode_dtype_name
from mars.decoding.loading import load_for_decoding
from mars.metadata import read_checkpoint

# a model config as conf/model/ spells one, with its own mask token and a one-layer tiny shape
TINY_CONFIG = {"name_or_path": "tiny-random", "tiny": {"num_layers": 1}, "mask_token": "<jupyter_code>"}


def test_the_model_config_alone_gives_its_shape_and_mask_token_in_the_decoding_dtype():
    loaded = load_for_decoding(TINY_CONFIG)  # dtype and device auto
    assert loaded.model.config.num_hidden_layers == 1 and loaded.mask.token == "<jupyter_code>"
    assert next(loaded.model.parameters()).dtype == getattr(torch, decode_dtype_name("auto", loaded.model.device))
    assert load_for_decoding(TINY_CONFIG, dtype="bfloat16", device="cpu").model.dtype == torch.bfloat16


def test_a_checkpoint_takes_the_place_of_the_model_config_with_its_own_mask_token(full_checkpoint):
    meta = read_checkpoint(str(full_checkpoint))
    assert meta["mask_token"] != TINY_CONFIG["mask_token"]
    loaded = load_for_decoding(TINY_CONFIG, checkpoint=str(full_checkpoint), checkpoint_meta=meta, dtype="float32")
    assert loaded.mask.token == meta["mask_token"] and loaded.mask.id == meta["mask_token_id"]
    assert loaded.model.config.num_hidden_layers != 1  # the checkpoint's weights, not the config's tiny shape
    assert loaded.metadata["block_size"] == meta["block_size"]
