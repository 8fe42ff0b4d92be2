"""Which lossless verify policy pays on a CPU: masks per step, draft threshold, adaptive back-off, simulated
on the greedy text of held-out prompts from the masks' per-step scores, with a step-cost model.

    python benchmarks/acceptance_rules/score_steps.py <checkpoint>/hf 0 200 steps.npz   # 8.6 min, 2 threads
    python benchmarks/decode_step_cpu/verify_masks/simulate_policies.py steps.npz       # seconds

A verifying row on a CPU (``chain_drafts=auto``: no masks after drafts) alternates two kinds of step:

- a mask step at last real token ``q``: the AR token plus ``m`` masks (gated adapter on); its drafts are the
  leading masks whose confidence reaches the draft threshold (the scores of the step that starts at ``q + 1``);
- a draft step: the AR token plus ``d`` drafts (no masks, no adapter); it accepts the leading right drafts plus
  the AR token after them.

Output is greedy AR whatever the policy, so only tokens per forward and time change.  Step costs, in units of an
AR step, are from the engine's own breakdown on the 40-minute gated reference (``../chain_drafts/breakdown``,
``../avx512/verify_breakdown``): a mask step 1.17 / 1.25 / 1.32 with 1 / 2 / 3 masks, a draft step 1 + 0.06 per
draft.  ``speed`` is tokens per unit of cost (AR = 1); ``ratio`` = speed / tokens per forward (issue 17 asks
>= 0.9).
"""

import sys

import numpy as np

MASK_STEP = {0: 1.0, 1: 1.17, 2: 1.25, 3: 1.32}
DRAFT_COLUMN = 0.06


class Fixed:
    """``m`` masks on every step without drafts."""

    def __init__(self, m):
        self.m = m

    def masks(self, state):
        return self.m

    def after_draft(self, state, drafts, passed):
        pass

    def after_mask(self, state, drafts):
        pass


class BackOff(Fixed):
    """After a mask step whose masks drafted nothing, ``k`` plain AR steps (hard text stays hard?)."""

    def __init__(self, m, k):
        super().__init__(m)
        self.k = k

    def masks(self, state):
        if state.get("skip", 0) > 0:
            state["skip"] -= 1
            return 0
        return self.m

    def after_mask(self, state, drafts):
        if drafts == 0:
            state["skip"] = self.k


class Expected(Fixed):
    """Masks only while a running mean of drafts passed per cycle reaches ``bar``; else AR steps, with a probe
    (a mask step) every ``probe`` steps."""

    def __init__(self, m, bar, probe, alpha=0.3):
        super().__init__(m)
        self.bar, self.probe, self.alpha = bar, probe, alpha

    def masks(self, state):
        if state.get("gain", 1.0) >= self.bar:
            return self.m
        state["n"] = state.get("n", 0) + 1
        if state["n"] >= self.probe:
            state["n"] = 0
            return self.m
        return 0

    def after_draft(self, state, drafts, passed):
        state["gain"] = (1 - self.alpha) * state.get("gain", 1.0) + self.alpha * passed

    def after_mask(self, state, drafts):
        if drafts == 0:
            state["gain"] = (1 - self.alpha) * state.get("gain", 1.0)


def simulate(steps, policy, draft_threshold):
    """Totals over prompts: tokens, forwards, cost."""
    conf, right = steps["confidence"], steps["correct"] & steps["valid"]
    index = {(int(p), int(s)): i for i, (p, s) in enumerate(zip(steps["prompt"], steps["start"]))}
    tokens = forwards = cost = 0.0
    for prompt in np.unique(steps["prompt"]):
        starts = steps["start"][steps["prompt"] == prompt]
        q, end, drafts, state = int(starts.min()) - 1, int(starts.max()) + 2, None, {}
        while q < end:
            forwards += 1
            if drafts is not None:
                passed = int(np.cumprod(drafts).sum())
                cost += 1 + DRAFT_COLUMN * len(drafts)
                tokens += 1 + passed
                q += 1 + passed
                policy.after_draft(state, len(drafts), passed)
                drafts = None
                continue
            m = policy.masks(state)
            cost += MASK_STEP[m]
            tokens += 1
            q += 1
            i = index.get((int(prompt), q))  # the masks fed after the old last token start at the new one
            if m == 0 or i is None:
                continue
            d = int(np.cumprod(conf[i, :m] >= draft_threshold).sum())
            policy.after_mask(state, d)
            drafts = right[i, :d] if d else None
    return tokens, forwards, cost


def main(path):
    steps = dict(np.load(path))
    print(f"{len(steps['prompt'])} steps, {np.unique(steps['prompt']).size} prompts\n")
    print("| policy | draft threshold | tok/fwd | speed vs AR | ratio |\n|---|---|---|---|---|")
    policies = [(f"{m} mask{'s' * (m > 1)}", Fixed(m)) for m in (3, 2, 1)]
    policies += [(f"{m} masks, back off {k} AR steps after no draft", BackOff(m, k)) for m in (3, 2) for k in (1, 4)]
    policies += [
        (f"{m} masks while drafts passed >= {b}, probe every 6", Expected(m, b, 6)) for m in (3, 2) for b in (0.3, 0.7)
    ]
    for name, policy in policies:
        for dt in (0.0, 0.3, 0.5, 0.7) if isinstance(policy, Fixed) and type(policy) is Fixed else (0.3,):
            tokens, forwards, cost = simulate(steps, policy, dt)
            tpf, speed = tokens / forwards, tokens / cost
            print(f"| {name} | {dt:g} | {tpf:.3f} | {speed:.3f} | {speed / tpf:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1])
