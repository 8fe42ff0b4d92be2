"""The engine's own cost per step (a step minus its forward), an older engine against the working tree's, both in one
process, alternating, on the 16 held-out prompts (AR at threshold 1.0 and lossless verify, 64 new tokens):

    python benchmarks/decode_step_cpu/intel_stream/engine_ab/engine_ab.py \
        benchmarks/reproduce_smollm2-135m-amx/adapter_rank8 --old HEAD~1 --rounds 3

The old `mars/decoding/engine.py` and `rows.py` are read from git at `--old` and loaded beside the current ones (the
rest of the package is shared), so both decode with the same model, kernels and forward.  Prints each round, then
medians, and whether both engines emitted the same tokens.
"""

import argparse
import collections
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mars.threads import apply_process_defaults

apply_process_defaults()

import torch  # noqa: E402

import mars.decoding.api as api  # noqa: E402
from mars.decoding import engine as current  # noqa: E402
from mars.evaluation.throughput import VERIFIED  # noqa: E402
from mars.models import load_model  # noqa: E402
from mars.threads import configure_threads  # noqa: E402

ROOT = Path(__file__).resolve().parents[4]
DECODERS = {"ar": dict(decoder="mars", cache="cursor", threshold=1.0), "verify": VERIFIED}


def old_engine(rev: str):
    """`mars.decoding.engine` as it was at `rev` (with that revision's rows.py), as a module of the package."""

    def load(name: str, path: str, replace: tuple[str, str] | None = None):
        source = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
        if replace:
            source = source.replace(*replace)
        spec = importlib.util.spec_from_loader(f"mars.decoding.{name}", loader=None)
        module = importlib.util.module_from_spec(spec)
        module.__package__ = "mars.decoding"
        sys.modules[spec.name] = module
        exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
        return module

    load("_rows_at_old", "src/mars/decoding/rows.py")
    return load("_engine_at_old", "src/mars/decoding/engine.py", ("from .rows import", "from ._rows_at_old import"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--old", default="HEAD~1", help="the git revision of the engine to compare against")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    args = p.parse_args()
    configure_threads("auto")
    lm = load_model(args.checkpoint, dtype=torch.float32)
    prompts = [json.loads(line)["prompt"] for line in open(ROOT / "data/prompts/heldout.jsonl")][: args.prompts]
    engines = {"old": old_engine(args.old), "new": current}
    spent, calls = collections.defaultdict(float), collections.Counter()
    for module in engines.values():
        for name in ("_step_rows", "_forward"):
            method = getattr(module.DecodeEngine, name)

            def timed(*a, _method=method, _name=name, **k):
                start = time.perf_counter()
                out = _method(*a, **k)
                spent[_name] += time.perf_counter() - start
                calls[_name] += 1
                return out

            setattr(module.DecodeEngine, name, timed)

    def decode(module, kwargs, count: int):
        api.DecodeEngine = module.DecodeEngine
        return [
            api.generate(lm.model, lm.tokenizer, [q], max_new_tokens=64, chat_template=True, **kwargs).token_ids
            for q in prompts[:count]
        ]

    for kwargs in DECODERS.values():
        for module in engines.values():
            decode(module, kwargs, 1)
    results = collections.defaultdict(list)
    for r in range(args.rounds):
        order = list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]
        for decoder, kwargs in DECODERS.items():
            for label, module in order:
                spent.clear()
                calls.clear()
                start = time.perf_counter()
                ids = decode(module, kwargs, len(prompts))
                wall = time.perf_counter() - start
                per_step = (spent["_step_rows"] - spent["_forward"]) / calls["_step_rows"] * 1e3
                results[decoder, label].append((per_step, wall, ids))
                print(
                    f"round {r} {decoder:6s} {label}: engine {per_step:.3f} ms per step "
                    f"({calls['_step_rows']} steps), wall {wall:.2f} s",
                    flush=True,
                )
    print(f"\nengine ms per step outside the forward, medians of {args.rounds} rounds (old = {args.old}):")
    print("| decoder | old | new | new - old | wall old / new (s) | same tokens |")
    print("|---|---|---|---|---|---|")
    for decoder in DECODERS:
        old, new = results[decoder, "old"], results[decoder, "new"]
        eo, en = statistics.median(x[0] for x in old), statistics.median(x[0] for x in new)
        wo, wn = statistics.median(x[1] for x in old), statistics.median(x[1] for x in new)
        same = all(a[2] == b[2] for a, b in zip(old, new))
        print(f"| {decoder} | {eo:.3f} | {en:.3f} | {en - eo:+.3f} | {wo:.2f} / {wn:.2f} | {same} |")


if __name__ == "__main__":
    main()
