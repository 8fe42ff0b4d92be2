"""Per-token fidelity: does each generated token equal the model's own greedy AR choice at its position?

Whole-output agreement with the threshold-1.0 output breaks at the first differing token (after which
two outputs share nothing), and in bf16 different input shapes flip near-tied greedy choices, so it
understates fidelity.  This measure checks every token against the AR prediction given *the output's own
prefix*, with one extra forward per row: a MARS output whose mask-accepted tokens all equal the AR
argmax is exactly what greedy AR would have produced from the same prefix, token by token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


@torch.inference_mode()
def ar_predictions(
    model,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    batch_size: int = 8,
    suppress_ids: Sequence[int] = (),
) -> list[list[int]]:
    """The greedy AR token at every output position given the prompt and the output's own prefix, among
    the tokens a decoder may output (``suppress_ids``: the mask token, which no decoder emits)."""
    device = next(model.parameters()).device
    preds: list[list[int]] = [[] for _ in outputs]
    order = sorted(range(len(outputs)), key=lambda i: -(len(prompts[i]) + len(outputs[i])))
    for start in range(0, len(order), batch_size):
        batch = [i for i in order[start : start + batch_size] if outputs[i]]
        if not batch:
            continue
        seqs = [list(prompts[i]) + list(outputs[i][:-1]) for i in batch]
        width = max(map(len, seqs))
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        att = torch.zeros((len(batch), width), dtype=torch.long)
        for r, seq in enumerate(seqs):  # right padding: real positions keep ids 0..n-1
            ids[r, : len(seq)] = torch.tensor(seq)
            att[r, : len(seq)] = 1
        logits = model(input_ids=ids.to(device), attention_mask=att.to(device)).logits
        if suppress_ids:
            logits[..., list(suppress_ids)] = float("-inf")
        for r, i in enumerate(batch):
            n_prompt, n_out = len(prompts[i]), len(outputs[i])
            preds[i] = logits[r, n_prompt - 1 : n_prompt - 1 + n_out].argmax(-1).tolist()
    return preds


def token_fidelity(
    outputs: Sequence[Sequence[int]],
    predictions: Sequence[Sequence[int]],
    from_mask: Sequence[Sequence[bool]] | None = None,
) -> list[dict[str, int]]:
    """Per row: tokens, tokens equal to the AR prediction, mask-accepted tokens and how many of those
    equal the AR prediction (the share the masks got right)."""
    rows = []
    for r, (out, pred) in enumerate(zip(outputs, predictions)):
        flags = list(from_mask[r]) if from_mask is not None else [True] * len(out)
        same = [int(t == p) for t, p in zip(out, pred)]
        rows.append(
            {
                "tokens": len(out),
                "ar_equal": sum(same),
                "mask_tokens": sum(flags[: len(out)]),
                "mask_ar_equal": sum(s for s, f in zip(same, flags) if f),
            }
        )
    return rows
