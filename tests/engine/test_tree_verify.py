"""A draft tree's VERIFY on the reference path (engine/_verify.py make_tree_verify_step,
the decoder's TreeMask, KVCache.keep_path), against plain sequential decoding on the tiny
float64 model: each tree row's hidden state is its path's as a chain, the accepted path
is greedy decoding's tokens, and after the path's K/V moved into place the cache decodes
on as if the path had been decoded one token at a time."""

import pytest
import torch

from specloop.engine._runner import ModelRunner
from specloop.engine._verify import make_tree_verify_step
from specloop.models import TreeMask
from specloop.samplers._tree import DraftTree

TREE = DraftTree([(0,), (1,), (0, 0), (1, 0), (1, 1), (0, 0, 0), (1, 0, 0)])
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [8, 300, 12]]


def _runner(loaded, feature_layers=()):
    runner = ModelRunner(loaded, num_slots=4, max_seq_len=64, max_prefill_tokens=64)
    runner.feature_layers = feature_layers
    return runner


def _prefill(runner, slot, ids):
    """K/V of ids[:-1] at positions 0.. of ``slot`` (the last token is VERIFY's root)."""
    runner.pages.resize(slot, len(ids) + TREE.size + 2)
    runner.model(torch.tensor([ids[:-1]]), torch.tensor([0]), torch.tensor([slot]),
                 runner.cache)


def _greedy(runner, slot, ids, n):
    """n greedy tokens after ids (already prefilled but the last) on ``slot``, one at a
    time; -> (tokens, the hidden state / features at each fed position, the logits)."""
    out, feats, logits, last, pos = [], [], [], ids[-1], len(ids) - 1
    for _ in range(n):
        hidden, f = runner.forward(torch.tensor([[last]]), torch.tensor([pos]),
                                   torch.tensor([slot]))
        logits.append(runner.model.logits(hidden)[0, -1])
        last = int(logits[-1].argmax())
        out.append(last)
        feats.append(f[0, -1])
        pos += 1
    return out, torch.stack(feats), torch.stack(logits)


def test_each_tree_rows_hidden_state_is_its_path_decoded_as_a_chain(tiny_loaded):
    runner = _runner(tiny_loaded)
    ids = PROMPTS[0]
    _prefill(runner, 0, ids)
    gen = torch.Generator().manual_seed(3)
    nodes = torch.randint(0, 384, (TREE.size,), generator=gen).tolist()
    rows = [ids[-1]] + nodes
    mask = TreeMask(torch.tensor(TREE.depths), TREE.visible())
    tree_hidden = runner.model(torch.tensor([rows]), torch.tensor([len(ids) - 1]),
                               torch.tensor([0]), runner.cache, tree=mask)[0]
    for row, path in enumerate(TREE.ancestors):
        chain = [rows[r] for r in path[:TREE.depths[row] + 1]]
        _prefill(runner, 1, ids)
        want = runner.model(torch.tensor([chain]), torch.tensor([len(ids) - 1]),
                            torch.tensor([1]), runner.cache)[0, -1]
        torch.testing.assert_close(tree_hidden[row], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("feature_layers", [(), (0, 2, 3)])
def test_the_tree_accepts_greedy_decodings_path_and_decodes_on_from_it(tiny_loaded,
                                                                      feature_layers):
    """Row 0 has greedy decoding's tokens on the path (1,) (1, 0) (1, 0, 0) and wrong
    ones elsewhere: it accepts 3 and emits the 4th; row 1's are on (0,) only: it accepts
    1. Then each row decodes 3 more tokens from the tree's slot: the tokens and logits
    of the slot that decoded them one at a time (a path left where the tree put it, or
    moved wrong, moves the logits)."""
    runner = _runner(tiny_loaded, feature_layers)
    greedy, feats, logits = [], [], []
    for b, ids in enumerate(PROMPTS):
        _prefill(runner, 2 + b, ids)
        tokens, f, lg = _greedy(runner, 2 + b, ids, 7)
        greedy.append(tokens)
        feats.append(f)
        logits.append(lg)
    rows = []
    for b, (ids, want) in enumerate(zip(PROMPTS, greedy)):
        true = {(1,), (1, 0), (1, 0, 0)} if b == 0 else {(0,)}
        rows.append([ids[-1]] + [want[len(p) - 1] if p in true else
                                 (want[len(p) - 1] + 1 + b) % 384 for p in TREE.paths])
        _prefill(runner, b, ids)
    step = make_tree_verify_step(runner, TREE, kv_len=None)
    out = step({"tokens": torch.tensor(rows),
                "start_pos": torch.tensor([len(p) - 1 for p in PROMPTS]),
                "slots": torch.tensor([0, 1])})
    assert out["num_accepted"].tolist() == [3, 1]
    assert out["token_ids"][0].tolist() == greedy[0][:4]
    assert out["token_ids"][1].tolist() == greedy[1][:2] + [-1, -1]
    assert torch.equal(out["packed"][:, -1], out["num_accepted"])
    # The drafter's rows: the path's hidden states / features, as decoded one at a time.
    torch.testing.assert_close(out["hidden"][0], feats[0][:4], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out["hidden"][1, :2], feats[1][:2], rtol=1e-10, atol=1e-10)
    for b, ids in enumerate(PROMPTS):
        n = int(out["num_accepted"][b])
        committed = ids + greedy[b][:n + 1]
        got, _, lg = _greedy(runner, b, committed, 3)
        assert got == greedy[b][n + 1:n + 4]
        torch.testing.assert_close(lg, logits[b][n + 1:n + 4], rtol=1e-10, atol=1e-10)


def test_a_tree_mask_of_the_wrong_size_is_refused(tiny_loaded):
    runner = _runner(tiny_loaded)
    with pytest.raises(ValueError, match="forward of 3"):
        runner.model(torch.tensor([[1, 2, 3]]), torch.tensor([0]), torch.tensor([0]),
                     runner.cache, tree=TreeMask(torch.tensor([0, 1]),
                                                 DraftTree.chain(1).visible()))
