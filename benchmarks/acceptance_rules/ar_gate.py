"""Does the exact AR confidence of a step's first token tell which masks to trust?  The masks of a step cannot
see that token (they sit in its place), so where the model is unsure of it the masks guess.  This scores every
step of the greedy answers to held-out prompts with a checkpoint's masks (as ``mars.evaluation.reliability``)
and with the AR top probability ``p0`` of the token before them, then compares, on a held-out half of the
prompts, the tokens per forward at a fidelity target of: one threshold on the masks, and one threshold plus a
gate ``p0 >= g`` (parameters chosen on the other half).

    python benchmarks/acceptance_rules/ar_gate.py <checkpoint> 120 ar_gate.npz     # scores, then the table
"""

import sys
from pathlib import Path

import numpy as np
import torch

from mars.evaluation.probe import read_prompts
from mars.evaluation.reliability import _greedy_texts, score_texts

TARGETS = (0.8, 0.9, 0.95, 0.98, 0.99)
TAUS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999)
GATES = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)


def score(checkpoint: str, n: int, out: Path) -> None:
    from mars.evaluation.probe import load
    from mars.module import MarsModule
    from mars.objectives import Objective

    torch.set_num_threads(2)
    loaded, block = load(checkpoint, None, "float32")
    prompts = read_prompts("data/prompts/heldout.jsonl", n)
    texts, lengths = _greedy_texts(loaded, block, prompts, 96, 8)
    module = MarsModule(loaded.model, loaded.mask.id, block_size=block, objective=Objective(name="mars")).eval()
    steps = score_texts(module, texts, lengths, block - 1, 8)
    p0 = np.zeros(len(steps.prompt))
    with torch.inference_mode():  # plain AR forwards: no mask token, so a gated adapter is off (the base model)
        for i, text in enumerate(texts):
            probs = torch.softmax(loaded.model(torch.tensor([text])).logits[0].float(), -1).max(-1).values.numpy()
            mine = steps.prompt == i
            p0[mine] = probs[steps.start[mine] - 1]
    np.savez(out, confidence=steps.confidence, correct=steps.correct, valid=steps.valid, prompt=steps.prompt, p0=p0)


def evaluate(accept: np.ndarray, correct: np.ndarray) -> tuple[float, float | None]:
    leading = np.cumprod(accept, axis=1).astype(bool)
    run = leading.sum(1)
    right = (leading & correct).sum(1)
    return 1 + run.mean(), (right.sum() / run.sum()) if run.sum() else None


def compare(path: Path) -> str:
    d = np.load(path)
    conf, correct, valid, prompt, p0 = d["confidence"], d["correct"], d["valid"], d["prompt"], d["p0"]
    rng = np.random.default_rng(0)
    prompts = np.unique(prompt)
    fit_prompts = rng.choice(prompts, len(prompts) // 2, replace=False)
    fit = np.isin(prompt, fit_prompts)
    rules = {
        "one threshold": [((t, 0.0), (conf >= t) & valid) for t in TAUS],
        "threshold + AR gate p0 >= g": [
            ((t, g), (conf >= t) & valid & (p0 >= g)[:, None]) for t in TAUS for g in GATES
        ],
    }
    lines = [
        f"{len(prompt)} steps, {len(prompts)} prompts; parameters chosen on half the prompts, scored on the other half",
        "",
        "| fidelity target | " + " | ".join(rules) + " |",
        "|---|" + "---|" * len(rules),
    ]
    for target in TARGETS:
        cells = []
        for cands in rules.values():
            kept = []
            for params, acc in cands:
                tpf, fid = evaluate(acc[fit], correct[fit])
                if fid is not None and fid >= target:
                    kept.append((tpf, params, acc))
            if not kept:
                cells.append("none")
                continue
            _, params, acc = max(kept, key=lambda k: k[0])
            tpf, fid = evaluate(acc[~fit], correct[~fit])
            cells.append(f"{tpf:.3f} (tau {params[0]:g}, g {params[1]:g}; {100 * (fid or 0):.1f}%)")
        lines.append(f"| {target:g} | " + " | ".join(cells) + " |")
    oracle = evaluate(correct & valid, correct)[0]
    lines += ["", f"oracle (the right leading masks only): {oracle:.3f} tokens per forward"]
    for lo, hi in ((0, 0.5), (0.5, 0.9), (0.9, 0.99), (0.99, 1.01)):
        s = (p0 >= lo) & (p0 < hi) & valid[:, 0]
        lines.append(
            f"p0 in [{lo}, {min(hi, 1)}): {s.mean():.1%} of steps, first mask right {correct[s, 0].mean():.1%}, "
            f"first mask at confidence >= 0.9 right {correct[s & (conf[:, 0] >= 0.9), 0].mean():.1%}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    checkpoint, n, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    if not out.exists():
        score(checkpoint, n, out)
    print(compare(out))
