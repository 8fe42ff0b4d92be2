"""The run-safety of sharded checkpoint folders without a distributed run: each rank digests the shard files it
wrote, a resume refuses a folder whose files differ from their digests (naming the file), and the swap of a new
folder into ``last.ckpt`` never leaves no checkpoint behind (a kill between its two renames is undone)."""

import json
import os

import pytest

from mars.persistence import ChecksumError
from mars.training.checkpointing import (
    recover_checkpoint_folder,
    replace_checkpoint_folder,
    staging_path,
    verify_resume_checkpoint,
    verify_sharded_checkpoint,
    write_shard_digests,
)


def sharded_folder(folder, ranks=2, payload=b"step-1"):
    """A folder laid out as torch.distributed.checkpoint and Lightning write one, digested by every rank."""
    folder.mkdir(parents=True)
    for rank in range(ranks):
        (folder / f"__{rank}_0.distcp").write_bytes(payload + bytes([rank]) * 1000)
    (folder / ".metadata").write_bytes(b"plan")
    (folder / "meta.pt").write_bytes(b"loops")
    for rank in range(ranks):
        write_shard_digests(folder, rank)
    return folder


def test_each_rank_digests_its_own_shards_and_rank_zero_the_metadata(tmp_path):
    folder = sharded_folder(tmp_path / "last.ckpt")
    rank0 = json.loads((folder / "sha256.rank0.json").read_text())
    rank1 = json.loads((folder / "sha256.rank1.json").read_text())
    assert set(rank0) == {"__0_0.distcp", ".metadata", "meta.pt"} and set(rank1) == {"__1_0.distcp"}
    assert verify_sharded_checkpoint(folder)
    verify_resume_checkpoint(folder)  # passes


@pytest.mark.parametrize("damage", ["flip", "missing", "foreign"])
def test_a_sharded_checkpoint_that_differs_from_its_digests_is_refused_naming_the_file(tmp_path, damage):
    folder = sharded_folder(tmp_path / "last.ckpt")
    shard = folder / "__1_0.distcp"
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[500] ^= 1
        shard.write_bytes(bytes(data))
        match = r"__1_0\.distcp is corrupt"
    elif damage == "missing":
        shard.unlink()
        match = r"missing \['__1_0\.distcp'\]"
    else:
        (folder / "__2_0.distcp").write_bytes(b"from another run")
        match = r"files without a digest: \['__2_0\.distcp'\]"
    with pytest.raises(ChecksumError, match=match):
        verify_resume_checkpoint(folder)


def test_a_folder_without_digests_resumes_unverified_with_a_warning(tmp_path, caplog):
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    (folder / "meta.pt").write_bytes(b"x")
    assert not verify_sharded_checkpoint(folder)
    with caplog.at_level("WARNING"):
        verify_resume_checkpoint(folder)
    assert "no recorded shard digests" in caplog.text


def test_a_new_checkpoint_replaces_the_last_one_and_a_kill_between_the_renames_is_undone(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    sharded_folder(target, payload=b"step-1")
    replace_checkpoint_folder(sharded_folder(staging_path(target), payload=b"step-2"), target)
    assert (target / "__0_0.distcp").read_bytes().startswith(b"step-2") and verify_sharded_checkpoint(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]

    real_replace, calls = os.replace, []

    def killed_at_the_second_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    staged = sharded_folder(staging_path(target), payload=b"step-3")
    monkeypatch.setattr(os, "replace", killed_at_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        replace_checkpoint_folder(staged, target)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not target.exists()  # the old one aside, the new one still staged
    recover_checkpoint_folder(target)
    assert (target / "__0_0.distcp").read_bytes().startswith(b"step-2") and verify_sharded_checkpoint(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # the half-saved one is gone


def test_a_sharded_folder_replaces_a_whole_file_checkpoint_and_its_sidecar(tmp_path):
    target = tmp_path / "last.ckpt"
    target.write_bytes(b"a full checkpoint")
    (tmp_path / "last.ckpt.sha256").write_text("0" * 64)
    replace_checkpoint_folder(sharded_folder(staging_path(target)), target)
    assert target.is_dir() and not (tmp_path / "last.ckpt.sha256").exists()
