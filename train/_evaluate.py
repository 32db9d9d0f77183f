"""Acceptance on the held-out split: offline (teacher-forced chains) and through the engine.

Offline: for every start p in a greedy held-out answer, the head drafts K tokens in a
chain (its own hidden states; the data tokens, which greedy verification would accept);
position j counts as accepted when drafts 1..j all equal the target's greedy tokens.
Engine: the held-out prompts run through AsyncEngine with the exported head; an
iteration observer counts, per VERIFY row, how many drafts were accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio
import torch

from specloop.engine import AsyncEngine, EngineConfig, TransitionEvent
from specloop.models._grad import no_grad
from specloop.samplers import SamplingParams

from ._mtp_head import _shift
from ._trainer import Teacher, pad_batch

if TYPE_CHECKING:
    from specloop.models import DecoderModel, LoadedModel

    from ._distill import Sequence as Answer
    from ._mtp_head import TrainableMtpHead


@no_grad
def offline_acceptance(head: TrainableMtpHead, target: DecoderModel, seqs: Sequence[Answer],
                       k: int, device: torch.device | str, batch_size: int = 16
                       ) -> dict[str, Any]:
    """-> {"per_position": [acc_1..acc_K], "al": 1 + sum, "starts": count}."""
    hits = torch.zeros(k, dtype=torch.float64)
    starts = 0
    greedy = [s for s in seqs if s.mode == "greedy"]
    if not greedy:
        return {"per_position": [0.0] * k, "al": 1.0, "starts": 0}
    teacher = Teacher(target, batch_size, max(len(s.tokens) for s in greedy) + k + 1,
                      head.feature_layers)
    for i in range(0, len(greedy), batch_size):
        tokens, answer = pad_batch(greedy[i:i + batch_size], device)
        steps = head.unroll(tokens, teacher.both(tokens)[1], k)
        # truth[p] = token p + 2 (the first draft's target), padded to the T - 1 starts.
        truth = torch.cat([tokens[:, 2:], torch.zeros_like(tokens[:, :1])], dim=1)
        # A start counts when all K predicted tokens are answer tokens (p+2 .. p+1+K).
        valid = _shift(answer[:, 1:], 1) & _shift(answer[:, 1:], k)
        ok = torch.ones_like(valid)
        for j, logits in enumerate(steps):
            ok = ok & (head.d2t[logits.argmax(-1)] == _shift(truth, j))
            hits[j] += float((ok & valid).sum())
        starts += int(valid.sum())
    per = (hits / max(starts, 1)).tolist()
    return {"per_position": [round(a, 4) for a in per], "al": round(1 + sum(per), 3),
            "starts": starts}


class AcceptanceCounter:
    """IterationObserver: per-position acceptance over VERIFY rows."""

    def __init__(self, k: int) -> None:
        self.k, self.rows = k, 0
        self.hits = [0] * k

    def on_transition(self, event: TransitionEvent) -> None:
        if event.accepted is None:
            return
        for n in event.accepted:
            self.rows += 1
            for j in range(min(n, self.k)):
                self.hits[j] += 1

    def summary(self) -> dict[str, Any]:
        per = [h / max(self.rows, 1) for h in self.hits]
        return {"per_position": [round(a, 4) for a in per], "al": round(1 + sum(per), 3),
                "verify_rows": self.rows}


def engine_acceptance(loaded: LoadedModel, model_name: str, prompts_ids: Sequence[list[int]],
                      speculative: dict[str, Any], *,
                      temperature: float, top_p: float, max_tokens: int, device: str,
                      dtype: str, batch_size: int = 64, seed: int = 0) -> dict[str, Any]:
    """Run the prompts through the engine with ``speculative``; -> acceptance summary."""
    k = speculative.get("num_draft_tokens", 4)
    config = EngineConfig.from_dict({
        "model": {"name": model_name, "dtype": dtype, "device": device,
                  "max_seq_len": max(len(p) for p in prompts_ids) + max_tokens + k + 2,
                  "chat_template": False},
        "scheduler": {"max_batch_size": batch_size, "seed": seed,
                      "max_num_tokens": 4096},
        "speculative": {"use_rejection_sampling": temperature > 0, **speculative}})
    counter = AcceptanceCounter(k)

    async def main() -> None:
        async with AsyncEngine(config, model=loaded, observers=[counter]) as engine:
            async def one(i: int, ids: list[int]) -> None:
                params = SamplingParams(temperature=temperature, top_p=top_p,
                                        max_tokens=max_tokens, seed=seed + i)
                async for _ in engine.generate(ids, params):
                    pass
            async with anyio.create_task_group() as tg:
                for i, ids in enumerate(prompts_ids):
                    tg.start_soon(one, i, ids)

    anyio.run(main)
    return {**counter.summary(), "k": k, "temperature": temperature, "top_p": top_p,
            "prompts": len(prompts_ids), "max_tokens": max_tokens}
