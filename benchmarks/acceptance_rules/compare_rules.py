"""Acceptance rules compared on the same scored steps: one threshold, a threshold per mask depth (grid-searched),
the product of the leading masks' confidences, and per-depth isotonic calibration (plain and as a product).
Every rule's parameter is chosen on a random half of the prompts for the most tokens per forward at a fidelity
target, and scored on the other half.

    python benchmarks/acceptance_rules/compare_rules.py steps.npz
"""

import itertools
import sys

import numpy as np

d = np.load(sys.argv[1])
conf, correct, valid, prompt = d["confidence"], d["correct"], d["valid"], d["prompt"]
P = np.unique(prompt)
rng = np.random.default_rng(0)
perm = rng.permutation(P)
fit_p, test_p = set(perm[: len(P) // 2]), set(perm[len(P) // 2 :])
fit = np.array([p in fit_p for p in prompt])
test = ~fit
D = conf.shape[1]


def evaluate(acc_flags, sel):
    acc = np.cumprod(acc_flags[sel] & valid[sel], axis=1).astype(bool)
    run = acc.sum(1)
    right = (acc & correct[sel]).sum(1)
    return 1 + run.mean(), right.sum() / max(1, run.sum())


def single(t):
    return conf >= t


def perdepth(ts):
    return conf >= np.array(ts)[None, :]


def joint(t):
    return np.cumprod(np.where(valid, conf, 0), axis=1) >= t


# isotonic per depth fit on fit split (pool adjacent violators via sklearn if present)
try:
    from sklearn.isotonic import IsotonicRegression

    iso = []
    for k in range(D):
        m = fit & valid[:, k]
        r = IsotonicRegression(y_min=0, y_max=1, out_of_bounds="clip").fit(conf[m, k], correct[m, k])
        iso.append(r)
    cal = np.stack([iso[k].predict(conf[:, k]) for k in range(D)], 1)
except ImportError:
    cal = None
    print("no sklearn")


def calibrated(t):
    return cal >= t


def caljoint(t):
    return np.cumprod(np.where(valid, cal, 0), axis=1) >= t


grid = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999]


def frontier(rule, params, sel):
    return [(p, *evaluate(rule(p), sel)) for p in params]


def best(points, target):
    ok = [x for x in points if x[2] >= target]
    return max(ok, key=lambda x: x[1]) if ok else None


rules = {"single": (single, grid), "joint": (joint, grid)}
if cal is not None:
    rules["calibrated"] = (calibrated, grid)
    rules["cal_joint"] = (caljoint, grid)
# per-depth grid chosen on fit, evaluated on test
pd_grid = list(itertools.product(grid, repeat=D))
print("per-depth candidates", len(pd_grid))
for target in (0.8, 0.85, 0.9, 0.95, 0.99):
    line = [f"fid>={target}:"]
    for name, (rule, params) in rules.items():
        fitpts = frontier(rule, params, fit)
        b = best(fitpts, target)
        if b is None:
            line.append(f"{name} none")
            continue
        tpf, fid = evaluate(rule(b[0]), test)
        line.append(f"{name} t={b[0]} test {tpf:.3f}/{fid:.3f}")
    fitpts = [(ts, *evaluate(perdepth(ts), fit)) for ts in pd_grid]
    b = best(fitpts, target)
    if b:
        tpf, fid = evaluate(perdepth(b[0]), test)
        line.append(f"perdepth {b[0]} test {tpf:.3f}/{fid:.3f}")
    print("  ".join(line), flush=True)
print("single frontier on test:")
for p, tpf, fid in frontier(single, grid, test):
    print(f"  {p}: {tpf:.3f} {fid:.3f}")
if cal is not None:
    print("calibrated frontier on test:")
    for p, tpf, fid in frontier(calibrated, grid, test):
        print(f"  {p}: {tpf:.3f} {fid:.3f}")
# reliability by depth
for k in range(D):
    m = valid[:, k]
    for lo, hi in [(0.9, 0.95), (0.95, 0.99), (0.99, 1.01)]:
        s = m & (conf[:, k] >= lo) & (conf[:, k] < hi)
        print(f"depth {k + 1} [{lo},{hi}) n={s.sum()} right={correct[s, k].mean() if s.sum() else float('nan'):.3f}")
