"""Acceptance on the held-out split: offline (teacher-forced chains) and through the engine.

Offline: for every start p in a greedy held-out answer, the head drafts K tokens in a
chain (its own hidden states; the data tokens, which greedy verification would accept);
position j counts as accepted when drafts 1..j all equal the target's greedy tokens.
Engine: the held-out prompts run through AsyncEngine with the exported head; an
iteration observer counts, per VERIFY row, how many drafts were accepted.

The two differ by what they average over, not by how well the head drafts (the engine's
drafts are the offline chain's, token for token: tests/train/test_eagle3.py). The offline
figure weighs every start of the whole answers alike; the engine starts only after each
VERIFY (a hard stretch, one token per iteration, holds more starts than an easy one, K + 1
tokens per iteration) and only in its first ``max_tokens`` tokens (later parts of answers
are easier: SmolLM2's eagle3 head accepts .51 at position 1 over an answer's first 64
tokens, .71 over tokens 128-191). ``offline_acceptance``'s ``engine_window`` gives both
over the engine's window: every start there, and the WALK, the engine's own starts (from
the prompt's end, draft K from the chain, accept the matching prefix n, move n + 1), which
is what greedy decoding through the engine at that K should measure on these answers.
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


def _rates(hits: Sequence[float], rows: int) -> dict[str, Any]:
    """Per-position hits over ``rows`` drafts -> {"per_position", "al"} (offline and engine
    figures alike)."""
    per = [h / max(rows, 1) for h in hits]
    return {"per_position": [round(a, 4) for a in per], "al": round(1 + sum(per), 3)}


def _summary(counts: torch.Tensor, k: int) -> dict[str, Any]:
    """Accepted counts (one per start) -> {"per_position", "al", "starts"}."""
    starts = int(counts.numel())
    return {**_rates([float((counts > j).sum()) for j in range(k)], starts), "starts": starts}


def walk(accepted: Sequence[int], first: int, end: int) -> list[int]:
    """The engine's starts through one answer, given the chain's accepted count at every
    start p (``accepted[p]``): from ``first`` (the prompt's end, P - 2), each VERIFY
    accepts n and commits n + 1 tokens; starts at ``end`` or later are not taken.
    -> the accepted count per start taken."""
    out, p = [], first
    while p < end:
        n = int(accepted[p])
        out.append(n)
        p += n + 1
    return out


@no_grad
def offline_acceptance(head: TrainableMtpHead, target: DecoderModel, seqs: Sequence[Answer],
                       k: int, device: torch.device | str, batch_size: int = 16,
                       window: int | None = None, walk_ks: Sequence[int] = ()
                       ) -> dict[str, Any]:
    """-> {"per_position": [acc_1..acc_K], "al": 1 + sum, "starts": count} over every
    start of the whole answers, and "engine_window": {"answer_tokens": window, "every":
    ..., "walk_k<K>": ...} (the same keys) over the starts before each answer's
    ``window``-th token (None: the whole answer): every start there, and the engine's walk
    drafting K = k and each smaller K of ``walk_ks`` (a K-chain is the k-chain's prefix)."""
    greedy = [s for s in seqs if s.mode == "greedy"]
    # Accepted counts: per valid start, per start in the window, per start of the walk.
    counts = [torch.zeros(0, dtype=torch.int64)]
    window_counts = [torch.zeros(0, dtype=torch.int64)]
    walks: dict[int, list[int]] = {kk: [] for kk in sorted({k, *walk_ks}) if 0 < kk <= k}
    teacher = Teacher(target, batch_size, max((len(s.tokens) for s in greedy), default=0)
                      + k + 1, head.feature_layers)
    for i in range(0, len(greedy), batch_size):
        tokens, answer = pad_batch(greedy[i:i + batch_size], device)
        steps = head.unroll(tokens, teacher.both(tokens)[1], k)
        # truth[p] = token p + 2 (the first draft's target), padded to the T - 1 starts.
        truth = torch.cat([tokens[:, 2:], torch.zeros_like(tokens[:, :1])], dim=1)
        # A start counts when all K predicted tokens are answer tokens (p+2 .. p+1+K).
        valid = (_shift(answer[:, 1:], 1) & _shift(answer[:, 1:], k)).cpu()
        ok = torch.ones_like(truth, dtype=torch.bool)
        accepted = torch.zeros_like(truth)
        for j, logits in enumerate(steps):
            ok = ok & (head.d2t[logits.argmax(-1)] == _shift(truth, j))
            accepted += ok
        accepted = accepted.cpu()
        counts.append(accepted[valid])
        # The engine's window: starts after fewer than ``window`` generated tokens.
        first = answer.int().argmax(1).cpu() - 2             # P - 2 per row
        span = torch.arange(valid.shape[1])[None, :] - first[:, None]
        inside = valid & (span < (window if window is not None else valid.shape[1]))
        window_counts.append(accepted[inside])
        for row in range(len(first)):
            taken = inside[row].nonzero()[:, 0].tolist()    # contiguous, from P - 2
            for kk, out in walks.items():
                if taken:
                    out += walk(accepted[row].clamp(max=kk).tolist(), taken[0], taken[-1] + 1)
    return {**_summary(torch.cat(counts), k), "engine_window": {
        "answer_tokens": window, "every": _summary(torch.cat(window_counts), k),
        **{f"walk_k{kk}": _summary(torch.tensor(out, dtype=torch.int64), kk)
           for kk, out in walks.items()}}}


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
        return {**_rates(self.hits, self.rows), "verify_rows": self.rows}


def engine_acceptance(loaded: LoadedModel, model_name: str, prompts_ids: Sequence[list[int]],
                      speculative: dict[str, Any], *,
                      temperature: float, top_p: float, max_tokens: int, device: str,
                      dtype: str, batch_size: int = 64, seed: int = 0) -> dict[str, Any]:
    """Run the prompts through the engine with ``speculative``; -> acceptance summary."""
    k = speculative.get("num_draft_tokens", 4)
    # The draft rows a VERIFY writes past a request: a draft tree's nodes, else K.
    rows = len(speculative.get("tree") or ()) or k
    config = EngineConfig.from_dict({
        "model": {"name": model_name, "dtype": dtype, "device": device,
                  "max_seq_len": max(len(p) for p in prompts_ids) + max_tokens + rows + 2,
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
