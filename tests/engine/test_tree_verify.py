"""A draft tree's VERIFY on the reference path (engine/_verify.py make_tree_verify_step,
the decoder's TreeMask, KVCache.keep_path), against plain sequential decoding on the tiny
float64 model: each tree row's hidden state is its path's as a chain, the accepted path
is greedy decoding's tokens (a seeded sampled row's: sampled decoding's, with the same
draws), and after the path's K/V moved into place the cache decodes on as if the path
had been decoded one token at a time."""

import pytest
import torch

from specloop.engine._runner import ModelRunner
from specloop.engine._verify import make_tree_verify_step
from specloop.models import TreeMask
from specloop.samplers import DefaultSampler, SamplingBatch, SamplingParams
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


GREEDY = SamplingParams(temperature=0.0)


def _decode(runner, slot, ids, n, params=GREEDY, seed=0):
    """n tokens after ids (already prefilled but the last) on ``slot``, one at a time,
    greedy or sampled with the strict draw at each position (``strict_targets``);
    -> (tokens, the hidden state / features at each fed position, the logits)."""
    one = SamplingBatch.from_params([params], [seed])
    out, feats, logits, last, pos = [], [], [], ids[-1], len(ids) - 1
    for _ in range(n):
        hidden, f = runner.forward(torch.tensor([[last]]), torch.tensor([pos]),
                                   torch.tensor([slot]))
        logits.append(runner.model.logits(hidden)[0, -1])
        last = int(DefaultSampler().strict_targets(logits[-1][None, None], one,
                                                   torch.tensor([[pos + 1]])))
        out.append(last)
        feats.append(f[0, -1])
        pos += 1
    return out, torch.stack(feats), torch.stack(logits)


def _tree_step(runner, params):
    """The tree's VERIFY for len(params) rows (seeds 11, 12, ...) and its sampling
    columns."""
    batch = SamplingBatch.from_params(params, [11 + i for i in range(len(params))])
    template = batch if batch.all_greedy else SamplingBatch.padding(len(params),
                                                                     all_greedy=False)
    step = make_tree_verify_step(runner, DefaultSampler(), template, TREE, kv_len=None)
    return step, batch.columns()


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


SAMPLED = SamplingParams(temperature=1.3, top_p=0.95)


@pytest.mark.parametrize("feature_layers, params", [
    ((), (GREEDY, GREEDY)), ((0, 2, 3), (GREEDY, GREEDY)), ((), (SAMPLED, GREEDY)),
    ((0, 2, 3), (GREEDY, SAMPLED))])
def test_the_tree_accepts_decodings_path_and_decodes_on_from_it(tiny_loaded,
                                                                feature_layers, params):
    """Row 0 has decoding's tokens (greedy, or sampled with the row's seed) on the path
    (1,) (1, 0) (1, 0, 0) and wrong ones elsewhere: it accepts 3 and emits the 4th; row
    1's are on (0,) only: it accepts 1. Then each row decodes 3 more tokens from the
    tree's slot: the tokens and logits of the slot that decoded them one at a time (a
    path left where the tree put it, or moved wrong, moves the logits; a sampled row
    drawn at the wrong position emits another token)."""
    runner = _runner(tiny_loaded, feature_layers)
    decoded, feats, logits = [], [], []
    for b, ids in enumerate(PROMPTS):
        _prefill(runner, 2 + b, ids)
        tokens, f, lg = _decode(runner, 2 + b, ids, 7, params[b], 11 + b)
        decoded.append(tokens)
        feats.append(f)
        logits.append(lg)
    rows = []
    for b, (ids, want) in enumerate(zip(PROMPTS, decoded)):
        true = {(1,), (1, 0), (1, 0, 0)} if b == 0 else {(0,)}
        rows.append([ids[-1]] + [want[len(p) - 1] if p in true else
                                 (want[len(p) - 1] + 1 + b) % 384 for p in TREE.paths])
        _prefill(runner, b, ids)
    step, columns = _tree_step(runner, params)
    out = step({"tokens": torch.tensor(rows),
                "start_pos": torch.tensor([len(p) - 1 for p in PROMPTS]),
                "slots": torch.tensor([0, 1]), **columns})
    assert out["num_accepted"].tolist() == [3, 1]
    assert out["token_ids"][0].tolist() == decoded[0][:4]
    assert out["token_ids"][1].tolist() == decoded[1][:2] + [-1, -1]
    assert torch.equal(out["packed"][:, -1], out["num_accepted"])
    # The drafter's rows: the path's hidden states / features, as decoded one at a time.
    torch.testing.assert_close(out["hidden"][0], feats[0][:4], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out["hidden"][1, :2], feats[1][:2], rtol=1e-10, atol=1e-10)
    for b, ids in enumerate(PROMPTS):
        n = int(out["num_accepted"][b])
        committed = ids + decoded[b][:n + 1]
        got, _, lg = _decode(runner, b, committed, 3, params[b], 11 + b)
        assert got == decoded[b][n + 1:n + 4]
        torch.testing.assert_close(lg, logits[b][n + 1:n + 4], rtol=1e-10, atol=1e-10)


def test_sampled_decoding_differs_from_greedy_here(tiny_loaded):
    """The sampled case above tests something: its row's decoding is not greedy's."""
    runner = _runner(tiny_loaded)
    _prefill(runner, 0, PROMPTS[0])
    greedy = _decode(runner, 0, PROMPTS[0], 7)[0]
    _prefill(runner, 0, PROMPTS[0])
    assert _decode(runner, 0, PROMPTS[0], 7, SAMPLED, 11)[0] != greedy


def test_a_tree_mask_of_the_wrong_size_is_refused(tiny_loaded):
    runner = _runner(tiny_loaded)
    with pytest.raises(ValueError, match="forward of 3"):
        runner.model(torch.tensor([[1, 2, 3]]), torch.tensor([0]), torch.tensor([0]),
                     runner.cache, tree=TreeMask(torch.tensor([0, 1]),
                                                 DraftTree.chain(1).visible()))
