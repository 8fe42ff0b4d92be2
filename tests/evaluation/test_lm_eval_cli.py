"""``mars-lm-eval`` as lm-eval's own command line: the device lm-eval fills in by default is no request, and the
generation settings lm-eval logs and records are the ones the decoder applies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from lm_eval_fixtures import write_generation_task

from mars.evaluation.lm_eval_model import (
    MarsLM,
    _with_decoder_stats,
    cap_generation_kwargs,
    names_a_device,
)


def _fake_cli_model(monkeypatch) -> list[dict]:
    """MarsLM.create_from_arg_string records the CLI's extra arguments and builds a stand-in model."""
    built: list[dict] = []

    def create(cls, arg_string, extra=None):
        built.append(dict(extra or {}))
        return SimpleNamespace(_max_new=lambda kw: 4, gather_object=lambda obj, dst=0: [obj], task_stats={})

    monkeypatch.setattr(MarsLM, "create_from_arg_string", classmethod(create))
    return built


@pytest.mark.parametrize(
    "argv, device, expected",
    [
        (["--model", "mars", "--tasks", "t"], "cuda:0", None),  # lm-eval's default: the model chooses (auto)
        (["--model", "mars", "--device", "cuda:0"], "cuda:0", "cuda:0"),  # asked for: kept (and warned about)
        (["--device=cpu"], "cpu", "cpu"),
    ],
)
def test_mars_lm_eval_treats_lm_evals_default_device_as_auto_and_keeps_a_requested_one(
    monkeypatch, argv, device, expected
):
    built = _fake_cli_model(monkeypatch)
    wrapped = _with_decoder_stats(lambda *a, **k: None, device_given=names_a_device(argv))
    wrapped(model="mars", model_args="pretrained=x", device=device, batch_size=1)
    assert built[0]["device"] == expected


def test_a_model_that_picks_its_own_device_does_not_warn_about_a_missing_gpu(tiny, tmp_path, caplog, monkeypatch):
    import torch

    from mars.evaluation.store import write_json

    ckpt = tmp_path / "ckpt"
    tiny.model.save_pretrained(ckpt)
    tiny.tokenizer.save_pretrained(ckpt)
    write_json(
        ckpt / "mars_config.json",
        {"block_size": 4, "objective": "mars", "mask_token": tiny.mask.token, "mask_token_id": tiny.mask.id},
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level("WARNING"):
        MarsLM(pretrained=str(ckpt), device=None)
    assert "requested but no CUDA" not in caplog.text
    with caplog.at_level("WARNING"):
        MarsLM(pretrained=str(ckpt), device="cuda:0")
    assert "device cuda:0 requested but no CUDA device is available" in caplog.text


def _generating_task(folder, max_gen_toks: int):
    from lm_eval.tasks import TaskManager

    name = f"fx_budget_{max_gen_toks}"
    rows = [{"q": "Say hi.", "a": "hi"}]
    write_generation_task(folder, name, rows, max_gen_toks=max_gen_toks, until=["\n"], fields=("q", "a"))
    return TaskManager(include_path=str(folder), include_defaults=False).load([name])["tasks"][name]


def test_the_logged_generation_settings_carry_the_token_budget_the_decoder_applies(tiny, tmp_path):
    lm = MarsLM(model=tiny.model, tokenizer=tiny.tokenizer, mask_token_id=tiny.mask.id, max_new_tokens=32)
    long_task, short_task = _generating_task(tmp_path / "a", 256), _generating_task(tmp_path / "b", 12)
    cap_generation_kwargs({"long": long_task, "short": short_task}, lm)
    assert long_task.get_config("generation_kwargs")["max_gen_toks"] == 32  # max_new_tokens=32 wins over 256
    assert short_task.get_config("generation_kwargs")["max_gen_toks"] == 12  # the task's smaller budget stays
    assert long_task.get_config("generation_kwargs")["until"] == ["\n"]


def test_a_cli_gen_kwargs_budget_is_capped_like_the_tasks_own(monkeypatch):
    _fake_cli_model(monkeypatch)
    seen = {}
    wrapped = _with_decoder_stats(lambda *a, **k: seen.update(k), device_given=False)
    wrapped(model="mars", model_args="pretrained=x", device=None, gen_kwargs="max_gen_toks=100,temperature=0")
    assert seen["gen_kwargs"]["max_gen_toks"] == 4 and seen["gen_kwargs"]["temperature"] == 0
