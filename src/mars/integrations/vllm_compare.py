"""vLLM's parallel drafting against this project's own mask predictions, step by step.

For each step vLLM recorded (:mod:`mars.integrations.vllm_runner`: the bonus token's position ``p`` and the ``K``
drafts), the project's model -- the gated adapter as :func:`mars.models.load_model` applies it, or the merged
weights -- runs one forward over the same prefix ``sequence[: p + 1]`` followed by ``K - 1`` masks; its argmax at
the bonus and at each mask is what the drafter should have proposed.  The same predictions, checked against the
greedy continuation ``sequence[p + 1 : p + 1 + K]``, give the acceptance per draft position that the project's
masks reach on exactly the steps vLLM took (vLLM's ``accepted_per_position`` counts a position when it and every
position before it passed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@torch.inference_mode()
def mask_predictions(model, prefix: Sequence[int], k: int, mask_id: int) -> list[int]:
    """Argmax at the last real token of ``prefix`` and at ``k - 1`` masks after it (no token suppressed: vLLM's
    greedy drafter takes the plain argmax)."""
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([list(prefix) + [mask_id] * (k - 1)], device=device)
    logits = model(input_ids=ids, logits_to_keep=k).logits[0, -k:]
    return logits.argmax(-1).tolist()


class PrefixPredictor:
    """:func:`mask_predictions` for growing prefixes of one sequence, with a KV cache of the real tokens: each
    step feeds only the tokens since the last one, then the bonus and the masks, which are dropped again."""

    def __init__(self, model, sequence: Sequence[int], mask_id: int):
        from transformers import DynamicCache

        self.model, self.sequence, self.mask_id = model, list(sequence), mask_id
        self.cache = DynamicCache(config=model.config)
        self.device = model.get_input_embeddings().weight.device

    def _forward(self, tokens: list[int], start: int, keep: int) -> torch.Tensor:
        ids = torch.tensor([tokens], device=self.device)
        positions = torch.arange(start, start + len(tokens), device=self.device).unsqueeze(0)
        from mars.hf_generate import cache_keyword

        out = self.model(
            input_ids=ids,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=keep,
            **{cache_keyword(self.model): self.cache},
        )
        return out.logits[0, -keep:]

    @torch.inference_mode()
    def at(self, position: int, k: int) -> list[int]:
        """The predictions for the prefix ``sequence[: position + 1]`` and ``k - 1`` masks after it."""
        cached = self.cache.get_seq_length()
        if position < cached:
            raise ValueError(f"prefixes must grow: position {position} is inside the {cached} cached tokens")
        if position > cached:
            self._forward(self.sequence[cached:position], cached, 1)
        logits = self._forward([self.sequence[position]] + [self.mask_id] * (k - 1), position, k)
        self.cache.crop(-k)  # drop the bonus and the masks: the next step feeds the bonus as a real token
        return logits.argmax(-1).tolist()


@dataclass
class StepComparison:
    positions: int = 0  # draft positions compared
    equal: int = 0  # ... where vLLM's draft is the project's prediction
    steps: int = 0  # verified steps (the continuation covers all K drafts)
    project_accepted: list[int] = field(default_factory=list)  # per position: steps whose first d+1 predictions hold
    vllm_accepted: list[int] = field(default_factory=list)  # the same for vLLM's recorded drafts
    first_differences: list[dict[str, Any]] = field(default_factory=list)

    @property
    def equal_share(self) -> float:
        return self.equal / self.positions if self.positions else 1.0

    def acceptance(self, which: str) -> list[float]:
        counts = self.project_accepted if which == "project" else self.vllm_accepted
        return [c / self.steps for c in counts] if self.steps else []

    def as_dict(self) -> dict[str, Any]:
        return {
            "positions": self.positions,
            "equal": self.equal,
            "equal_share": self.equal_share,
            "steps": self.steps,
            "project_acceptance_by_position": self.acceptance("project"),
            "vllm_recorded_acceptance_by_position": self.acceptance("vllm"),
            "first_differences": self.first_differences,
        }


def _leading(predicted: Sequence[int], truth: Sequence[int]) -> int:
    run = 0
    while run < len(predicted) and predicted[run] == truth[run]:
        run += 1
    return run


def compare_run(model, prompts: Sequence[Sequence[int]], run: dict[str, Any], mask_id: int) -> StepComparison:
    """Every recorded step of ``run`` (its ``proposals`` per prompt and ``outputs``) against ``model``."""
    k = int(run["drafter"]["k"])
    result = StepComparison(project_accepted=[0] * k, vllm_accepted=[0] * k)
    for prompt, output, steps in zip(prompts, run["outputs"], run["proposals"]):
        sequence = list(prompt) + list(output)
        predictor = PrefixPredictor(model, sequence, mask_id)
        for step in steps:
            p = int(step["bonus_position"])
            if p >= len(sequence):
                continue  # proposed after the request's last token (the budget or an EOS ended it): never used
            if sequence[p] != step["bonus"]:
                raise ValueError(f"a recorded step's bonus {step['bonus']} at {p} is not the output's token there")
            ours = predictor.at(p, k)
            theirs = list(step["drafts"])
            result.positions += k
            result.equal += sum(a == b for a, b in zip(ours, theirs))
            if ours != theirs and len(result.first_differences) < 5:
                result.first_differences.append({"position": p, "project": ours, "vllm": theirs})
            truth = sequence[p + 1 : p + 1 + k]
            if len(truth) < k:
                continue  # the budget ended inside this step's window: vLLM verifies it partly or not at all
            result.steps += 1
            for d in range(_leading(ours, truth)):
                result.project_accepted[d] += 1
            for d in range(_leading(theirs, truth)):
                result.vllm_accepted[d] += 1
    return result


def vllm_figures(run: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own spec-decode figures of a run: mean acceptance length (1 + accepted / drafts), draft acceptance
    rate, per-position acceptance (accepted at position d / drafts)."""
    spec = run["spec"]
    drafts = spec["drafts"]
    return {
        "drafts": drafts,
        "mean_acceptance_length": 1 + spec["accepted_tokens"] / drafts if drafts else None,
        "draft_acceptance_rate": spec["accepted_tokens"] / spec["draft_tokens"] if spec["draft_tokens"] else None,
        "acceptance_by_position": [a / drafts for a in spec["accepted_per_position"]] if drafts else None,
    }
