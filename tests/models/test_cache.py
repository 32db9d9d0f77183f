"""KV cache semantics: incremental == full, rewinding, scratch isolation, static shapes."""

import pytest
import torch

from specloop.models import KV_LEN_MULTIPLE, KVCache


def _ids(n, vocab, seed=0, batch=1):
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def _run(model, ids, start, slot, cache, **kw):
    B = ids.shape[0]
    return model.logits(model(ids, torch.full((B,), start), torch.full((B,), slot), cache, **kw))


def _slot_k(cache, slot):
    """K of every position of a slot, [L, positions, Hkv, D], read through its pages."""
    return cache.k[:, list(cache.pages.pages_of(slot))].flatten(1, 2)


def test_cache_shape_and_scratch(tiny_llama):
    a = tiny_llama.args
    cache = KVCache(a, num_slots=3, max_seq_len=32, page_size=16)
    # A standalone cache owns every slot's pages (2 each) plus the scratch page.
    assert cache.k.shape == (a.num_layers, 7, 16, a.num_kv_heads, a.head_dim)
    assert cache.scratch_slot == 3 and cache.v.shape == cache.k.shape
    assert cache.pages.table[3].tolist() == [6, 6] and cache.pages.num_free == 0


def test_prefill_then_decode_equals_full_forward(tiny_llama):
    model, V = tiny_llama.model, tiny_llama.args.vocab_size
    ids = _ids(24, V)
    full = _run(model, ids, 0, 0, model.make_cache(1, 64))
    cache = model.make_cache(1, 64)
    parts = [_run(model, ids[:, :10], 0, 0, cache)]
    parts += [_run(model, ids[:, p : p + 1], p, 0, cache) for p in range(10, 20)]
    parts.append(_run(model, ids[:, 20:], 20, 0, cache))  # a multi-token chunk after decode
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_rewind_by_overwriting(tiny_llama):
    """Rejected drafts left in the cache are ignored once their positions are rewritten."""
    model, V = tiny_llama.model, tiny_llama.args.vocab_size
    ids = _ids(16, V, seed=1)
    junk = _ids(6, V, seed=2)
    cache = model.make_cache(1, 64)
    _run(model, ids[:, :10], 0, 0, cache)
    _run(model, junk, 10, 0, cache)  # drafts at 10..15, all "rejected"
    got = _run(model, ids[:, 10:12], 10, 0, cache)  # rewind to 10, write 10..11 only
    ref = _run(model, ids[:, :12], 0, 0, model.make_cache(1, 64))[:, 10:]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_scratch_and_other_slots_do_not_disturb(tiny_llama):
    model, V = tiny_llama.model, tiny_llama.args.vocab_size
    cache = model.make_cache(2, 64)
    a, b = _ids(12, V, seed=3), _ids(12, V, seed=4)
    _run(model, a[:, :8], 0, 0, cache)
    snapshot = _slot_k(cache, 0).clone()
    _run(model, b, 0, 1, cache)  # another request in slot 1
    slot1 = _slot_k(cache, 1).clone()
    # Padding rows go to the scratch slot at arbitrary positions in the same batch.
    batch = torch.cat([a[:, 8:9], b[:, :1], b[:, 1:2]])
    out = model.logits(model(batch, torch.tensor([8, 0, 40]), torch.tensor([0, 2, 2]), cache))
    assert torch.equal(_slot_k(cache, 0)[:, :8], snapshot[:, :8])
    assert torch.equal(_slot_k(cache, 1), slot1)
    ref = _run(model, a[:, :9], 0, 0, model.make_cache(1, 64))[0, 8]
    torch.testing.assert_close(out[0, 0], ref, atol=1e-5, rtol=1e-5)


def test_static_kv_len_equals_dynamic(tiny_llama):
    model, V = tiny_llama.model, tiny_llama.args.vocab_size
    ids = _ids(20, V, seed=5, batch=2)
    dyn = _run(model, ids, 0, 0, model.make_cache(1, 256))
    static = _run(model, ids, 0, 0, model.make_cache(1, 256), kv_len=256)
    torch.testing.assert_close(static, dyn, atol=1e-5, rtol=1e-5)


def test_out_of_range_positions(tiny_llama):
    """Dynamic path: a clear error. Static path: writes land in the scratch page, no crash."""
    model, V = tiny_llama.model, tiny_llama.args.vocab_size
    cache = model.make_cache(1, 2 * KV_LEN_MULTIPLE)
    with pytest.raises(ValueError, match="max_seq_len"):
        _run(model, _ids(4, V), cache.max_seq_len - 2, 0, cache)
    before = _slot_k(cache, 0).clone()
    out = _run(model, _ids(4, V), cache.max_seq_len - 2, 0, cache, kv_len=cache.max_seq_len)
    assert torch.isfinite(out).all()
    assert torch.equal(_slot_k(cache, 0)[:, :-2], before[:, :-2])


def test_num_layers_validation(tiny_llama):
    model = tiny_llama.model
    cache = model.make_cache(1, 64)
    with pytest.raises(ValueError, match="num_layers"):
        _run(model, _ids(2, 10), 0, 0, cache, num_layers=model.args.num_layers + 1)


def test_forward_embeds_equals_forward(tiny_llama):
    model, V = tiny_llama.model, tiny_llama.args.vocab_size
    ids = _ids(9, V, seed=6)
    pos, slot = torch.tensor([0]), torch.tensor([0])
    a = model(ids, pos, slot, model.make_cache(1, 64))
    b = model.forward_embeds(model.embed(ids), pos, slot, model.make_cache(1, 64))
    assert torch.equal(a, b)
    assert model.lm_head_weight.shape == (V, model.args.hidden_size)


def test_cache_built_in_inference_mode_is_writable_outside(tiny_llama):
    model = tiny_llama.model
    with torch.inference_mode():
        cache = model.make_cache(1, 64)
    out = _run(model, _ids(3, 10), 0, 0, cache)  # forward runs under no_grad only
    with torch.inference_mode():
        again = _run(model, _ids(3, 10), 0, 0, cache)
    torch.testing.assert_close(out, again)
