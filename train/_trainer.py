"""Training loop: teacher forward (no grad) -> TTT-unrolled head -> forward-KL per step.

Loss = sum_j decay^j * soft-CE(target softmax over the draft vocabulary at the predicted
position, head's draft logits at step j) / sum_j decay^j, averaged over answer tokens.
Checkpoints (head, optimizer, step, elapsed time, log) let a run resume where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import structlog
import torch
import torch.nn.functional as F

from specloop.models._grad import no_grad

from ._mtp_head import TrainableEagle3Head, TrainableMtpHead
from ._progress import progress

if TYPE_CHECKING:
    from specloop.models import DecoderModel

    from ._config import OptimSection, TrainConfig
    from ._distill import Sequence as Answer

log = structlog.get_logger(__name__)


def draft_vocab(seqs: Sequence[Answer], vocab_size: int, n: int) -> torch.Tensor:
    """The n most frequent target ids in the training answers (ties: lower id), sorted."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in seqs:
        counts += torch.bincount(torch.tensor(s.tokens[s.prompt_len:]), minlength=vocab_size)
    n = min(n, vocab_size)
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))[:n]
    return torch.tensor(sorted(order), dtype=torch.int64)


def pad_batch(seqs: Sequence[Answer], device: torch.device | str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> tokens [B, T] (pad 0), answer mask [B, T] (True on answer tokens)."""
    width = max(len(s.tokens) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.int64)
    answer = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        tokens[i, :len(s.tokens)] = torch.tensor(s.tokens)
        answer[i, s.prompt_len:len(s.tokens)] = True
    return tokens.to(device), answer.to(device)


class Teacher:
    """The target's final hidden states for padded batches, off the autograd graph."""

    def __init__(self, model: DecoderModel, max_batch: int, max_len: int, capture: tuple[int, ...] = ()
                 ) -> None:
        self.model = model
        self.cache = model.make_cache(max_batch, max_len)
        self.capture = tuple(capture)

    @no_grad
    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.both(tokens)[0]

    @no_grad
    def both(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (final hidden [B, T, H], the head's step-0 input: the same, or the captured
        feature layers [B, T, F*H])."""
        rows = tokens.shape[0]
        start = torch.zeros(rows, dtype=torch.int64, device=tokens.device)
        slots = torch.arange(rows, device=tokens.device)
        if not self.capture:
            hidden = self.model(tokens, start, slots, self.cache)
            return hidden, hidden
        hidden, features = self.model(tokens, start, slots, self.cache, capture=self.capture)
        return hidden, features


def make_head(cfg: TrainConfig, target: DecoderModel, d2t: torch.Tensor, max_len: int
              ) -> TrainableMtpHead:
    """The trainable head cfg.head.method names, for this target."""
    from specloop.models.drafters._eagle3 import default_feature_layers  # noqa: PLC0415

    args = target.args
    if cfg.head.method == "eagle3":
        layers = tuple(cfg.head.feature_layers) or default_feature_layers(args.num_layers)
        return TrainableEagle3Head(args, target.embed_tokens, target.lm_head_weight, d2t,
                                   max_len, layers)
    return TrainableMtpHead(args, target.embed_tokens, target.lm_head_weight, d2t, max_len)


def step_losses(head: TrainableMtpHead, tokens: torch.Tensor, answer: torch.Tensor,
                hidden: torch.Tensor, steps: int, features: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (per-step soft-CE [steps], per-step top-1 agreement [steps]) over answer tokens.
    ``features``: the head's step-0 input when it is not the final hidden (eagle3).

    Only the rows that carry a label go through the draft LM head: target row r (whose
    next token r + 1 is an answer token) labels chain p = r - 1 - j at every step j. The
    target's softmax over the draft vocabulary is computed once per batch for those rows,
    and soft-CE = logsumexp(z) - sum(p * z) (p sums to 1) needs no [B, T, N] tensors —
    on padded batches of long prompts most rows carry no label."""
    label = answer[:, 1:].nonzero()                                      # [n, 2]: (b, r)
    b, r = label[:, 0], label[:, 1]
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        target_logits = F.linear(hidden[b, r].float(), head.draft_lm)      # [n, N]
        probs, best = torch.softmax(target_logits, -1), target_logits.argmax(-1)
    losses, accs = [], []
    feed = hidden if features is None else features
    for j, out in enumerate(head.unroll_hidden(tokens, feed, steps)):     # [B, T-1, H]
        keep = r >= j + 1                                                # chain p >= 0
        logits = F.linear(out[b[keep], r[keep] - 1 - j], head.draft_lm).float()
        ce = torch.logsumexp(logits, -1) - (probs[keep] * logits).sum(-1)
        denom = max(int(keep.sum()), 1)
        losses.append(ce.sum() / denom)
        accs.append(((logits.argmax(-1) == best[keep]).float().sum() / denom).detach())
    return torch.stack(losses), torch.stack(accs)


def batch_at(train_seqs: list[Answer], ocfg: OptimSection, step: int, rng: random.Random
             ) -> list[Answer]:
    """The sequences of training step ``step`` (a function of the step: resumable).
    With ``optim.length_buckets`` = n > 1, every n steps draw n batches' worth of random
    sequences, sort them by length and hand out one length-homogeneous batch per step
    (random order): the batches pad little, and each sequence still appears once per draw."""
    size, n = min(ocfg.batch_size, len(train_seqs)), ocfg.length_buckets
    if n <= 1:
        rng.seed(ocfg.seed * 1_000_003 + step)
        return rng.sample(train_seqs, size)
    rng.seed(ocfg.seed * 1_000_003 + step // n)
    pool = sorted(rng.sample(train_seqs, min(n * size, len(train_seqs))),
                  key=lambda s: len(s.tokens))
    chunks = [pool[i:i + size] for i in range(0, len(pool), size)]
    order = list(range(len(chunks)))
    rng.shuffle(order)
    return chunks[order[(step % n) % len(chunks)]]


def lr_at(optim_cfg: OptimSection, step: int, elapsed: float) -> tuple[float, float]:
    """(lr, progress in [0, 1]): warmup, then cosine over steps or time, whichever leads."""
    prog = min(1.0, max(step / optim_cfg.max_steps, elapsed / optim_cfg.time_budget_s))
    warm = min(1.0, (step + 1) / max(1, optim_cfg.warmup_steps))
    return optim_cfg.lr * warm * 0.5 * (1 + math.cos(math.pi * prog)), prog


def _save(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train(cfg: TrainConfig, target: DecoderModel, seqs: Sequence[Answer], out_dir: Path,
          device: torch.device | str) -> tuple[TrainableMtpHead, dict[str, Any]]:
    """Train (or resume) the head on the training sequences; -> (head, summary)."""
    ocfg, hcfg = cfg.optim, cfg.head
    train_seqs = [s for s in seqs if s.split == "train"]
    if ocfg.max_epochs > 0:
        cap = max(1, math.ceil(ocfg.max_epochs * len(train_seqs) / ocfg.batch_size))
        ocfg = attrs.evolve(ocfg, max_steps=min(ocfg.max_steps, cap))
    max_len = max(len(s.tokens) for s in seqs) + hcfg.ttt_steps + 1
    ckpt_path = out_dir / "checkpoint.pt"
    ckpt = torch.load(ckpt_path, weights_only=False) if ckpt_path.is_file() else None
    d2t = ckpt["d2t"] if ckpt else draft_vocab(train_seqs, target.args.vocab_size,
                                               hcfg.draft_vocab_size)
    head = make_head(cfg, target, d2t, max_len).to(device)
    head.init_from_target(target, ocfg.seed)
    opt = torch.optim.AdamW(head.parameters(), lr=ocfg.lr, betas=(0.9, 0.95),
                            weight_decay=ocfg.weight_decay)
    step, elapsed, history = 0, 0.0, []
    if ckpt:
        head.load_state_dict(ckpt["head"])
        opt.load_state_dict(ckpt["optim"])
        step, elapsed, history = ckpt["step"], ckpt["elapsed"], ckpt["history"]
        log.info("train_resumed", step=step, elapsed=round(elapsed, 1))
    teacher = Teacher(target, ocfg.batch_size, max_len, head.feature_layers)
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16,
                              enabled=ocfg.bf16_autocast)
    weights = torch.tensor([hcfg.step_decay ** j for j in range(hcfg.ttt_steps)], device=device)
    rng = random.Random(ocfg.seed)
    t0 = time.perf_counter() - elapsed

    def checkpoint() -> None:
        _save(ckpt_path, {"head": head.state_dict(), "optim": opt.state_dict(), "step": step,
                          "elapsed": time.perf_counter() - t0, "history": history,
                          "d2t": d2t})

    with progress(total=ocfg.max_steps, initial=step, desc="train", unit="step") as bar:
        while True:
            lr, prog = lr_at(ocfg, step, time.perf_counter() - t0)
            if prog >= 1.0 or step >= ocfg.max_steps:
                break
            for group in opt.param_groups:
                group["lr"] = lr
            tokens, answer = pad_batch(batch_at(train_seqs, ocfg, step, rng), device)
            hidden, features = teacher.both(tokens)
            with autocast:
                losses, accs = step_losses(head, tokens, answer, hidden, hcfg.ttt_steps,
                                           features)
            loss = (losses * weights).sum() / weights.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), ocfg.grad_clip)
            opt.step()
            step += 1
            bar.update(1)
            if step % 10 == 0 or step == 1:
                rec = {"step": step, "loss": round(loss.item(), 4), "lr": lr,
                       "acc": [round(float(a), 3) for a in accs],
                       "seconds": round(time.perf_counter() - t0, 1)}
                history.append(rec)
                bar.set_postfix(loss=rec["loss"], acc0=rec["acc"][0])
            if step % ocfg.checkpoint_every == 0:
                checkpoint()
    checkpoint()
    with open(out_dir / "train-log.jsonl", "w") as f:
        for rec in history:
            f.write(json.dumps(rec) + "\n")
    summary = {"steps": step, "seconds": round(history[-1]["seconds"], 1) if history else 0,
               "final_loss": history[-1]["loss"] if history else None,
               "first_loss": history[0]["loss"] if history else None,
               "final_top1_agreement_per_step": history[-1]["acc"] if history else None,
               "batch_size": ocfg.batch_size, "lr": ocfg.lr,
               "train_sequences": len(train_seqs)}
    return head, summary
