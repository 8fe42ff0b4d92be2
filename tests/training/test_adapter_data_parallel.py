"""The lm-eval adapter's collectives (MarsLM.all_gather / gather_object / barrier), which lm-eval calls to
pad each rank's share of documents and to bring every rank's samples to rank 0.

Two torchrun CPU processes call them directly on a tiny model (cheaper than a whole lm-eval run; the
end-to-end runs are in test_evaluation.py); one process must not join any process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

RANK_SCRIPT = textwrap.dedent(
    """
    import json, os
    import torch
    from mars.evaluation.lm_eval_model import MarsLM
    from mars.models import load_model

    torch.set_num_threads(3)
    os.environ.pop("OMP_NUM_THREADS", None)  # accelerate would then pick its own thread count
    tiny = load_model("tiny-random")
    lm = MarsLM(model=tiny.model, tokenizer=tiny.tokenizer, mask_token_id=tiny.mask.id)
    r = lm.rank
    result = {
        "rank": r,
        "world_size": lm.world_size,
        "threads": torch.get_num_threads(),
        # lm-eval gathers each rank's request count as a 0-d tensor
        "counts": lm.all_gather(torch.tensor(10 + r)).tolist(),
        "rows": lm.all_gather(torch.tensor([[r, r], [r + 10, r + 10]])).tolist(),
        # runner._gather_records sends (records, stats) tuples of dicts; lists of samples go the same way
        "to_0": lm.gather_object(({"doc": r}, [r] * (r + 1)), dst=0),
        "to_1": lm.gather_object(f"rank {r}", dst=1),
    }
    lm.barrier()
    # one file per rank: both ranks share torchrun's stdout, where their lines can interleave
    with open(f"result_{r}.json", "w") as f:
        json.dump(result, f)
    """
)


@pytest.mark.slow
def test_collectives_on_two_processes(tmp_path):
    """Every collective of the lm-eval model on 2 processes; the default suite gathers through them in
    ``torchrun evaluate.py`` (tests/evaluation/test_evaluation.py::test_data_parallel_evaluate_py_writes_one_folder)."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = sorted((json.loads(path.read_text()) for path in tmp_path.glob("result_*.json")), key=lambda r: r["rank"])
    assert [(r["rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2)], proc.stdout
    for r in results:
        assert r["counts"] == [10, 11]  # one entry per rank, in rank order, on every rank
        assert r["rows"] == [[0, 0], [10, 10], [1, 1], [11, 11]]  # concatenated along the first dimension
        assert r["threads"] == 3  # the process's thread count is its own, not accelerate's choice
    # the objects arrive whole (a list stays a list) on the destination rank only
    assert results[0]["to_0"] == [[{"doc": 0}, [0]], [{"doc": 1}, [1, 1]]] and results[1]["to_0"] is None
    assert results[0]["to_1"] is None and results[1]["to_1"] == ["rank 0", "rank 1"]


def test_one_process_joins_no_group(monkeypatch):
    from mars.evaluation.lm_eval_model import MarsLM
    from mars.models import load_model

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tiny = load_model("tiny-random")
    lm = MarsLM(model=tiny.model, tokenizer=tiny.tokenizer, mask_token_id=tiny.mask.id)
    assert (lm.rank, lm.world_size, lm.accelerator) == (0, 1, None)
    assert not torch.distributed.is_initialized()
    counts = torch.tensor(7)
    assert lm.all_gather(counts) is counts
    samples = [{"doc_id": 0}]
    assert lm.gather_object(samples, dst=0) == [samples] and lm.gather_object(samples, dst=0)[0] is samples
    assert lm.barrier() is None
