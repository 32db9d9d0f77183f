"""Training labels sit where drafting reads them: chain p's step j predicts token p + 2 + j.

An oracle head whose step-j logits are the target's own logits at position p + 1 + j
(computed here by explicit indexing, not through the trainer's shift helpers) must agree
with the labels everywhere and reach the minimum loss (the target's entropy). A trainer
that paired (h_p, t_{p+1}) with the labels of token p + 1 or p + 3 fails both checks; the
biased twin below shows the check does fail on a one-position shift.
"""

import pytest
import torch
import torch.nn.functional as F

from specloop.models import load_model
from specloop.models.testing import write_tiny_checkpoint
from specloop.train import TrainableMtpHead
from specloop.train._trainer import Teacher, step_losses

T, STEPS, PROMPT = 14, 3, 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("a") / "m", vocab_size=384,
                                 num_layers=2, hidden=64, seed=7)
    loaded = load_model(path, dtype=torch.float32)
    model = loaded.model
    d2t = torch.arange(384)                   # full vocabulary: labels are exact softmaxes
    head = TrainableMtpHead(loaded.args, model.embed_tokens, model.lm_head_weight, d2t,
                            T + STEPS + 1)
    tokens = torch.randint(0, 384, (2, T), generator=torch.Generator().manual_seed(0))
    answer = torch.zeros(2, T, dtype=torch.bool)
    answer[:, PROMPT:] = True
    answer[1, T - 3:] = False                 # a shorter second row (padding at the end)
    hidden = Teacher(model, 2, T + 1).hidden(tokens)
    return head, tokens, answer, hidden


def _oracle(hidden, shift: int):
    """Step j, chain p -> the target's hidden state at position p + shift + j (explicit
    loops), so the draft LM head gives the target's own logits there."""
    B, n = hidden.shape[0], hidden.shape[1] - 1
    out = []
    for j in range(STEPS):
        rows = torch.zeros(B, n, hidden.shape[2], dtype=hidden.dtype)
        for p in range(n):
            q = p + shift + j
            if q < hidden.shape[1]:
                rows[:, p] = hidden[:, q]
        out.append(rows)
    return out


def _expected_loss(hidden, lm, answer):
    """Per step: mean entropy of the target's next-token distribution over the chains whose
    step-j token p + 2 + j is an answer token."""
    losses = []
    for j in range(STEPS):
        total, count = 0.0, 0
        for b in range(hidden.shape[0]):
            for p in range(hidden.shape[1] - 1):
                if p + 2 + j < hidden.shape[1] and answer[b, p + 2 + j]:
                    logp = torch.log_softmax(F.linear(hidden[b, p + 1 + j], lm).double(), -1)
                    total += float(-(logp.exp() * logp).sum())
                    count += 1
        losses.append(total / count)
    return torch.tensor(losses, dtype=torch.float64)


@pytest.mark.parametrize("shift, aligned", [(1, True), (2, False), (0, False)])
def test_labels_are_the_targets_next_token_at_p_plus_2(setup, monkeypatch, shift, aligned):
    head, tokens, answer, hidden = setup
    oracle = _oracle(hidden, shift)
    monkeypatch.setattr(head, "unroll_hidden", lambda *a, **kw: oracle)
    losses, accs = step_losses(head, tokens, answer, hidden, STEPS)
    entropy = _expected_loss(hidden, head.draft_lm, answer)
    if aligned:
        assert accs.tolist() == [1.0] * STEPS
        torch.testing.assert_close(losses.double(), entropy, rtol=1e-5, atol=1e-5)
    else:   # the biased twin: one position off must be caught by both checks
        assert max(accs.tolist()) < 0.5, accs
        assert bool((losses.double() > entropy + 0.05).all()), (losses, entropy)


def test_gathered_loss_equals_the_dense_formula(setup):
    """step_losses (labelled rows only, logsumexp form) == the dense per-position soft-CE
    -(softmax(target) * log_softmax(draft)).sum over every (chain p, step j) whose token
    p + 2 + j is an answer token, with the real unrolled head (explicit loops here)."""
    head, tokens, answer, hidden = setup
    torch.manual_seed(3)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    with torch.no_grad():
        losses, accs = step_losses(head, tokens, answer, hidden, STEPS)
        steps = head.unroll(tokens, hidden, STEPS)
    for j in range(STEPS):
        total, hits, count = 0.0, 0, 0
        for b in range(tokens.shape[0]):
            for p in range(tokens.shape[1] - 1):
                if p + 2 + j < tokens.shape[1] and answer[b, p + 2 + j]:
                    tl = F.linear(hidden[b, p + 1 + j], head.draft_lm).double()
                    z = steps[j][b, p].double()
                    total += float(-(tl.softmax(-1) * z.log_softmax(-1)).sum())
                    hits += int(z.argmax() == tl.argmax())
                    count += 1
        assert abs(float(losses[j]) - total / count) < 1e-4, (j, losses, total / count)
        assert abs(float(accs[j]) - hits / count) < 1e-6
