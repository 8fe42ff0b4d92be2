"""mars-bench calibrate: the prompts' split, its refusals before a model loads, and the stored result."""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from mars.bench import calibrate


def prompts_file(path, n: int):
    path.write_text("".join(json.dumps({"id": f"p-{i}", "prompt": f"question {i}"}) + "\n" for i in range(n)))
    return path


def test_the_prompts_split_in_two_halves_by_id_whatever_their_order_in_the_file(tmp_path):
    fit, held = calibrate.split_by_id(prompts_file(tmp_path / "a.jsonl", 9), None)
    assert len(fit) == 4 and len(held) == 5 and not set(fit) & set(held)
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    (tmp_path / "b.jsonl").write_text("\n".join(reversed(lines)) + "\n")
    assert calibrate.split_by_id(tmp_path / "b.jsonl", None) == (fit, held)
    small = calibrate.split_by_id(tmp_path / "a.jsonl", 4)
    assert len(small[0]) == 2 and len(small[1]) == 2
    with pytest.raises(SystemExit, match="need 2 at least"):
        calibrate.split_by_id(tmp_path / "a.jsonl", 1)


def test_a_folder_that_is_no_mars_checkpoint_is_refused_before_a_model_loads(tmp_path):
    with pytest.raises(SystemExit, match="no such folder"):
        calibrate.main(["--checkpoint", str(tmp_path / "nope")])
    with pytest.raises(SystemExit, match="no mars_config.json"):
        calibrate.main(["--checkpoint", str(tmp_path)])


def exit_message_without_root(run) -> str:
    """What ``run()`` exits with (its SystemExit message), run in a child process as an unprivileged user when
    this one is root (root writes into a read-only folder, so only another user meets the permissions)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            run()
            text = "returned"
        except SystemExit as done:
            text = f"exit: {done.code}"
        except BaseException as err:  # noqa: BLE001 -- reported to the parent, which asserts on it
            text = f"raised: {type(err).__name__}: {err}"
        os.write(write, text.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as handle:
        text = handle.read()
    os.waitpid(pid, 0)
    return text


def test_a_read_only_checkpoint_folder_is_refused_before_the_model_loads(tmp_path):
    from mars.metadata import MarsMetadata, write_metadata

    root = Path(tempfile.mkdtemp())  # not under pytest's root-only folder: the unprivileged child must reach it
    try:
        root.chmod(0o755)
        folder = root / "ckpt"
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(b"not weights: loading them would fail otherwise")
        write_metadata(folder, MarsMetadata(block_size=4, objective="mars", mask_token="<m>", mask_token_id=7))
        prompts = prompts_file(root / "p.jsonl", 6)
        prompts.chmod(0o644)
        folder.chmod(0o555)
        args = ["--checkpoint", str(folder), "--prompts", str(prompts)]
        said = exit_message_without_root(lambda: calibrate.main(args))
        assert said.startswith(f"exit: --checkpoint {folder}: {folder / 'mars_config.json'} cannot be updated: ")
        assert "is not writable" in said and "--dry-run" in said
        assert sorted(p.name for p in folder.iterdir()) == ["adapter_model.safetensors", "mars_config.json"]
    finally:
        (root / "ckpt").chmod(0o755)
        shutil.rmtree(root)


@pytest.mark.slow
def test_the_command_fits_and_stores_a_calibration_that_the_loader_attaches(tmp_path, capsys, monkeypatch):
    from decoding_fixtures import give_adapter_weights

    from mars.adapters import AdapterSettings, attach_adapter
    from mars.models import load_model
    from mars.training.export import export_adapter

    trained = load_model("tiny-random")
    attach_adapter(trained.model, AdapterSettings(kind="gated_lora", rank=2), trained.mask.id)
    give_adapter_weights(trained.model, seed=1)
    meta = dict(block_size=3, objective="mars", mask_token=trained.mask.token, mask_token_id=trained.mask.id)
    folder = export_adapter(
        trained.model, trained.tokenizer, tmp_path / "adapter", {**meta, "base_model": "tiny-random"}
    )
    args = ["--checkpoint", str(folder), "--prompts", str(prompts_file(tmp_path / "p.jsonl", 6))]
    args += ["--max-new-tokens", "12", "--batch-size", "3"]
    calibrate.main([*args, "--dry-run"])
    assert "| mask depth | T | ECE before | ECE after |" in capsys.readouterr().out
    assert json.loads((folder / "mars_config.json").read_text()).get("calibration") is None
    import mars.metadata

    writes = []
    real = mars.metadata.atomic_write_json
    monkeypatch.setattr(mars.metadata, "atomic_write_json", lambda *a, **k: writes.append(a[0]) or real(*a, **k))
    calibrate.main(args)
    assert writes == [folder / "mars_config.json"]  # the temperatures and the acceptance table in one write
    stored = json.loads((folder / "mars_config.json").read_text())["calibration"]
    assert stored["block_size"] == 3 and len(stored["temperatures"]) == 2 and stored["fit_prompts"] == 3
    loaded = load_model(str(folder)).model
    assert loaded.mars_calibration.temperatures == tuple(stored["temperatures"])
    acceptance = json.loads((folder / "mars_config.json").read_text())["draft_acceptance"]
    assert len(acceptance["conditional"]) == 2 and all(len(row) == 4 for row in acceptance["conditional"])
    assert acceptance["block_size"] == 3 and acceptance["checkpoint"] == stored["checkpoint"]
    assert loaded.mars_draft_acceptance == acceptance  # what tree=auto reads
