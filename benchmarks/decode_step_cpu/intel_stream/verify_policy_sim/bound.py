"""The best ratio lossless verify could reach on this host if everything a verify step pays beyond its forward's
extra columns were gone.  The default policy (2 masks, draft threshold 0.15) is replayed on `collect.py`'s record
and priced as `simulate.py` prices it, then again with the adapter's cost on mask steps removed (a mask step priced
as a draft step of its width), the engine's extra time per verify step removed, and the prefills made equal, then
zero.  What remains is the forward's cost of the extra columns themselves.  The step costs were each measured by
`step_costs.py` on this host: the nineteenth session's (`simulate.py`'s), the twentieth's, after the kernel changes
of `../weight_register_ab/` and `../attention_groups/`, and the three rounds of the thirty-first's:

    python benchmarks/decode_step_cpu/intel_stream/verify_policy_sim/bound.py masks.pkl
"""

import pickle
import sys

import simulate as sim

POLICY = (lambda last: 2, (0.15, 0.15, 0.15))
# ms: AR's step forward, draft steps' forwards by columns (adapter idle), mask steps' (adapter live); the engine
# per AR / verify step; the 16 prefills of AR / verify.  None: not measured (that step kind does not occur here).
COSTS = {
    "nineteenth session": dict(
        ar=28.4,
        draft={2: 30.0, 3: 31.1, 4: 32.3},
        mask={2: 31.0, 3: 32.1, 4: 33.4},
        rest=(1.87, 2.45),
        prefill=(2490.0, 2590.0),
    ),
    "twentieth session, after the kernel changes": dict(
        ar=27.35,
        draft={2: 29.10, 3: 29.52, 4: None},
        mask={2: None, 3: 30.52, 4: None},
        rest=(1.40, 1.92),
        prefill=(2442.0, 2504.0),
    ),
}
# thirty-first session: each round of `step_costs_s31.txt` (../../emerald_rapids/), the mean forwards (their sum is
# the wall clock): the extra columns' cost swung from 1.5% of an AR step (rounds 0 and 2) to 7.7% (round 1)
for r, (ar, d2, d3, m3, rest, prefill) in enumerate(
    [
        (28.12, 27.56, 28.53, 29.26, (1.62, 1.70), (2791.0, 2724.0)),
        (26.97, 28.16, 29.06, 29.90, (1.57, 1.81), (2585.0, 2831.0)),
        (26.67, 26.29, 27.01, 27.84, (1.54, 1.67), (2571.0, 2527.0)),
    ]
):
    COSTS[f"thirty-first session, round {r}"] = dict(
        ar=ar, draft={2: d2, 3: d3, 4: None}, mask={2: None, 3: m3, 4: None}, rest=rest, prefill=prefill
    )


def price(costs: dict, records: list, adapter: bool, engine: bool, prefill: str) -> tuple[float, float, float]:
    rest_ar, rest_verify = costs["rest"]
    rest = rest_verify if engine else rest_ar
    sim.COST = {("A", 1): costs["ar"] + rest_ar}
    for columns, forward in costs["draft"].items():
        masked = costs["mask"][columns] if adapter else forward
        if forward is not None:
            sim.COST["D", columns] = forward + rest
        if masked is not None:
            sim.COST["M", columns] = masked + rest
    sim.PREFILL_AR, sim.PREFILL_VERIFY = {
        "measured": costs["prefill"],
        "equal": (costs["prefill"][0],) * 2,
        "none": (0.0, 0.0),
    }[prefill]
    r = sim.price(records, *POLICY)
    return r["per_forward"], r["steps"], r["wall"]


def main(path: str) -> None:
    records = pickle.load(open(path, "rb"))
    scenarios = [
        ("as measured", True, True, "measured"),
        ("no adapter cost on mask steps", False, True, "measured"),
        ("and no extra engine time", False, False, "measured"),
        ("and verify's prefill as AR's", False, False, "equal"),
        ("and no prefill at all", False, False, "none"),
    ]
    for name, costs in COSTS.items():
        print(f"\nStep costs of the {name}:\n")
        print("| costs | tok/fwd | vs AR, steps only (ratio) | vs AR, with prefill (ratio) |")
        print("|---|---|---|---|")
        for label, adapter, engine, prefill in scenarios:
            tpf, steps, wall = price(costs, records, adapter, engine, prefill)
            print(f"| {label} | {tpf:.3f} | {steps:.3f}x ({steps / tpf:.3f}) | {wall:.3f}x ({wall / tpf:.3f}) |")


if __name__ == "__main__":
    main(sys.argv[1])
