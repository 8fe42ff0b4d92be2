"""Replays lossless verify policies offline on what `collect.py` recorded (each held-out prompt's greedy text and,
at every position, what a step of [last token, 3 masks] predicts there with its top probabilities), and prices
each policy's steps with per-step costs measured on this host.  Lossless verify's text is the greedy text
whatever the policy, so the replay gives each policy's forwards exactly (the default policy reproduces the
engine's 590 forwards on the 16 prompts); only the costs are a model:

    python benchmarks/decode_step_cpu/intel_stream/verify_policy_sim/simulate.py masks.pkl

Step kinds: A (one AR column), M (the last token and k masks: drafts for the next step), D (the last token and
the drafts: verified, no masks after them, as `chain_drafts=auto` does for lossless rows on a CPU).
"""

import pickle
import sys

# ms per step (forward + engine) by kind and columns, medians measured with AR and verify alternating in one
# process on the AMX reference at rank 8 (16 held-out prompts x 64 tokens; README of this folder)
REST_AR, REST_VERIFY = 1.87, 2.45
COST = {
    ("A", 1): 28.4 + REST_AR,
    ("D", 2): 30.0 + REST_VERIFY,
    ("D", 3): 31.1 + REST_VERIFY,
    ("D", 4): 32.3 + REST_VERIFY,
    ("M", 2): 31.0 + REST_VERIFY,
    ("M", 3): 32.1 + REST_VERIFY,
    ("M", 4): 33.4 + REST_VERIFY,
}
PREFILL_AR, PREFILL_VERIFY = 2490.0, 2590.0  # ms over the 16 prompts (the verify prefill carries its masks)


def replay(record: dict, masks_for, thresholds) -> list[tuple[str, int]]:
    """The steps after the prefill of one prompt under a policy: ``masks_for(last)`` masks on an M step, given
    the last D step's (passed, proposed); a draft is kept while its mask's top probability meets ``thresholds``."""
    text, rows = record["text"], record["rows"]
    n = len(text)

    def drafts_at(j: int, k: int) -> list[int]:
        tokens, top = rows[j]
        out = []
        for i in range(1, k + 1):
            if j + i >= n or top[i] < thresholds[i - 1]:
                break
            out.append(tokens[i])
        return out

    steps, j, last = [], 1, None
    drafts = drafts_at(0, masks_for(None))
    while j < n:
        if drafts:
            passed = 0
            while passed < len(drafts) and text[j + passed] == drafts[passed]:
                passed += 1
            steps.append(("D", 1 + len(drafts)))
            j, last, drafts = j + passed + 1, (passed, len(drafts)), []
        else:
            k = masks_for(last)
            drafts = drafts_at(j, k)
            steps.append(("M", 1 + k))
            j += 1
    return steps


def price(records: list[dict], masks_for, thresholds) -> dict:
    tokens = forwards = verify_ms = ar_ms = 0.0
    for record in records:
        steps = replay(record, masks_for, thresholds)
        tokens += len(record["text"])
        forwards += len(steps) + 1
        verify_ms += sum(COST[s] for s in steps)
        ar_ms += (len(record["text"]) - 1) * COST[("A", 1)]
    per_forward = tokens / forwards
    steps_only = ar_ms / verify_ms
    wall = (ar_ms + PREFILL_AR) / (verify_ms + PREFILL_VERIFY)
    return dict(per_forward=per_forward, steps=steps_only, wall=wall)


POLICIES = {
    "2 masks, draft threshold 0.3 (the default before this)": (lambda last: 2, (0.3, 0.3, 0.3)),
    "1 mask": (lambda last: 1, (0.3, 0.3, 0.3)),
    "3 masks": (lambda last: 3, (0.3, 0.3, 0.3)),
    "2 masks, second draft at 0.6": (lambda last: 2, (0.3, 0.6, 0.6)),
    "2 masks, first draft at 0.1": (lambda last: 2, (0.1, 0.3, 0.3)),
    "2 masks, draft threshold 0.15 (the default now)": (lambda last: 2, (0.15, 0.15, 0.15)),
    "2 masks, draft threshold 0.5": (lambda last: 2, (0.5, 0.5, 0.5)),
    "2 masks after a step whose drafts all passed, else 1": (
        lambda last: 2 if last is None or last[0] == last[1] else 1,
        (0.3, 0.3, 0.3),
    ),
}

if __name__ == "__main__":
    records = pickle.load(open(sys.argv[1], "rb"))
    print("| policy | tok/fwd | vs AR, steps only | ratio | vs AR, with prefill | ratio |")
    print("|---|---|---|---|---|---|")
    for name, (masks_for, thresholds) in POLICIES.items():
        r = price(records, masks_for, thresholds)
        tpf = r["per_forward"]
        print(
            f"| {name} | {tpf:.3f} | {r['steps']:.3f}x | {r['steps'] / tpf:.3f} | {r['wall']:.3f}x | {r['wall'] / tpf:.3f} |"
        )
