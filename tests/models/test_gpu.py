"""The decoder on CUDA: matches CPU, and a static-shape decode step replays in a CUDA graph."""

import pytest
import torch

from specloop.models import load_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu = load_model(tiny_dirs["qwen2"])
    gpu = load_model(tiny_dirs["qwen2"], device="cuda")
    return cpu.model, gpu.model


def _prefill(model, ids, slots, cache):
    B, T = ids.shape
    dev = model.device
    zeros = torch.zeros(B, dtype=torch.long, device=dev)
    return model(ids.to(dev), zeros, slots.to(dev), cache)


def test_cuda_matches_cpu(pair):
    cpu, gpu = pair
    ids = torch.randint(0, cpu.args.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    slots = torch.tensor([1, 0, 2])
    ref = cpu.logits(_prefill(cpu, ids, slots, cpu.make_cache(3, 128)))
    out = gpu.logits(_prefill(gpu, ids, slots, gpu.make_cache(3, 128)))
    torch.testing.assert_close(out.cpu(), ref, atol=2e-4, rtol=2e-4)


def test_embedding_lookup_equals_f_embedding_at_every_count(pair):
    """The lookup indexes the table from 2 tokens and uses F.embedding for 1 (their CUDA
    kernels' costs differ by count, DecoderModel.embed): the same rows either way."""
    import torch.nn.functional as F
    _, gpu = pair
    gen = torch.Generator().manual_seed(3)
    for shape in ((1, 1), (1, 2), (1, 16), (4, 5), (2, 40)):
        ids = torch.randint(0, gpu.args.vocab_size, shape, generator=gen).cuda()
        assert torch.equal(gpu.embed(ids), F.embedding(ids, gpu.embed_tokens)), shape


def test_cuda_graph_decode_step(pair):
    """Capture one batched decode step at kv_len=max_seq_len; replays equal eager steps."""
    _, gpu = pair
    V, B, S = gpu.args.vocab_size, 2, 128
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (B, 10), generator=gen)
    slots = torch.tensor([0, 1], device="cuda")
    cache, eager_cache = gpu.make_cache(B, S), gpu.make_cache(B, S)
    _prefill(gpu, prompt, slots, cache)
    _prefill(gpu, prompt, slots, eager_cache)
    tokens = torch.zeros(B, 1, dtype=torch.long, device="cuda")
    start = torch.full((B,), 10, dtype=torch.long, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the side stream, as capture requires
        for _ in range(2):
            gpu(tokens, start, slots, gpu.make_cache(B, S), kv_len=S)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = gpu.logits(gpu(tokens, start, slots, cache, kv_len=S)[:, -1])
    steps = torch.randint(0, V, (4, B), generator=gen)
    for i, step in enumerate(steps):
        tokens.copy_(step[:, None])
        start.fill_(10 + i)
        graph.replay()
        ref = gpu.logits(gpu(step[:, None].cuda(), start.clone(), slots, eager_cache)[:, -1])
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_cuda_bf16_runs(tiny_dirs):
    lm = load_model(tiny_dirs["llama"], dtype=torch.bfloat16, device="cuda")
    cache = lm.model.make_cache(2, 64)
    ids = torch.randint(0, lm.args.vocab_size, (2, 7), device="cuda")
    out = lm.model.logits(lm.model(ids, torch.tensor([0, 3], device="cuda"), torch.tensor([0, 1], device="cuda"), cache))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


@pytest.mark.parametrize("T", [1, 5, 33])
def test_fused_kernels_match_reference_bf16(tiny_dirs, T):
    """Decode, VERIFY-sized and prefill-sized steps over ragged rows crossing pages: the
    Triton path's bf16 error against an fp32 forward is no worse than the reference path's
    (both round differently; neither equals fp32)."""
    from specloop.models import PageTable

    out = {}
    for name, dtype, fused in (("fp32", torch.float32, False), ("ref", torch.bfloat16, False),
                               ("fused", torch.bfloat16, True)):
        model = load_model(tiny_dirs["llama"], dtype=dtype, device="cuda").model
        model.kernels = fused
        V, starts = model.args.vocab_size, torch.tensor([0, 7, 19, 30])
        pages = PageTable(4, 128, 4, device="cuda")
        cache = model.make_cache(4, 128, pages=pages)
        g = torch.Generator().manual_seed(T)
        for slot, start in enumerate(starts.tolist()):
            pages.resize(slot, start + T)
            if start:
                ids = torch.randint(0, V, (1, start), generator=g).cuda()
                model(ids, torch.tensor([0]).cuda(), torch.tensor([slot]).cuda(), cache)
        tokens = torch.randint(0, V, (4, T), generator=g).cuda()
        out[name] = model.logits(model(tokens, starts.cuda(), torch.arange(4).cuda(), cache))
    err_ref = (out["ref"] - out["fp32"]).abs().max().item()
    err_fused = (out["fused"] - out["fp32"]).abs().max().item()
    assert err_fused <= 1.5 * err_ref + 1e-3, (err_fused, err_ref)


def test_fused_tree_forward_matches_reference_bf16(tiny_dirs):
    """A draft tree's VERIFY rows (RoPE at their depth, the attention's visibility words)
    through the Triton kernels in bf16: no further from the fp32 reference tree forward
    than the bf16 reference path's (tests/models/test_kernels.py checks the same in the
    interpreter, float32)."""
    from specloop.models import PageTable, TreeMask
    from specloop.samplers._tree import DraftTree

    tree = DraftTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    out = {}
    for name, dtype, fused in (("fp32", torch.float32, False), ("ref", torch.bfloat16, False),
                               ("fused", torch.bfloat16, True)):
        model = load_model(tiny_dirs["llama"], dtype=dtype, device="cuda").model
        model.kernels = fused
        mask = TreeMask(torch.tensor(tree.depths, device="cuda"), tree.visible("cuda"))
        V, starts = model.args.vocab_size, torch.tensor([5, 30])
        pages = PageTable(2, 128, 4, device="cuda")
        cache = model.make_cache(2, 128, pages=pages)
        g = torch.Generator().manual_seed(0)
        for slot, start in enumerate(starts.tolist()):
            pages.resize(slot, start + 8)
            ids = torch.randint(0, V, (1, start), generator=g).cuda()
            model(ids, torch.tensor([0]).cuda(), torch.tensor([slot]).cuda(), cache)
        tokens = torch.randint(0, V, (2, 8), generator=g).cuda()
        out[name] = model.logits(model(tokens, starts.cuda(), torch.arange(2).cuda(), cache,
                                       tree=mask))
    err_ref = (out["ref"] - out["fp32"]).abs().max().item()
    err_fused = (out["fused"] - out["fp32"]).abs().max().item()
    assert err_fused <= 1.5 * err_ref + 1e-3, (err_fused, err_ref)


def test_eagle3_head_fused_norms_match_reference_bf16(tiny_dirs):
    """The eagle3 head's enorm/hnorm/fnorm as one fused kernel each == the plain ops."""
    from specloop.models import KVCache
    from specloop.models.drafters._eagle3 import Eagle3Head

    target = load_model(tiny_dirs["llama"], dtype=torch.bfloat16, device="cuda").model
    head = Eagle3Head(target, dtype=torch.bfloat16, device="cuda", feature_layers=(0, 1))
    head.init_random()
    with torch.no_grad():
        head.fnorm.copy_(torch.rand_like(head.fnorm) + 0.5)
        head.hnorm.copy_(torch.rand_like(head.hnorm) + 0.5)
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = target.args.hidden_size
    feats = torch.randn(2, 3, 2 * h, device="cuda", generator=gen).to(torch.bfloat16) * 4
    tokens = torch.randint(0, target.args.vocab_size, (2, 3), device="cuda", generator=gen)
    start, slots = torch.tensor([0, 5], device="cuda"), torch.tensor([0, 1], device="cuda")
    outs = []
    for fused in (False, True):
        head.block.kernels = fused
        cache = KVCache(head.block.args, 2, 64, dtype=torch.bfloat16, device="cuda")
        with torch.inference_mode():
            outs.append((head.project(feats), head(tokens, feats, start, slots, cache)))
    head.block.kernels = None
    for ref, got in zip(*outs):
        torch.testing.assert_close(got.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_draft_greedy_kernel_equals_argmax_bf16(tiny_dirs):
    """The fused greedy draft token (argmax over the reduced rows, mapped to target ids
    in one kernel) == argmax over the -inf-padded target vocabulary, ties included."""
    from specloop.models.drafters._lm_head import DraftHead

    target = load_model(tiny_dirs["llama"], dtype=torch.bfloat16, device="cuda").model
    V, H = target.args.vocab_size, target.args.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    for d2t in (torch.arange(1, V, 3, device="cuda"),
                torch.randperm(V, device="cuda", generator=gen)[:300]):
        lm = DraftHead(target.lm_head_weight, lm_head_tp=False, max_rows=32, d2t=d2t)
        hidden = torch.randn(32, H, device="cuda", generator=gen).to(torch.bfloat16)
        out = torch.zeros(32, 2, dtype=torch.int64, device="cuda")
        lm.greedy(hidden, out=out[:, 1], fused=True)
        assert torch.equal(out[:, 1], lm.logits(hidden).argmax(dim=-1))
        logits = lm._matmul(hidden)
        logits[:8, 5] = logits[:8, 100] = 100.0                  # ties
        from specloop.models import _kernels
        full = logits.float().new_full((32, V), float("-inf")).index_copy_(1, d2t,
                                                                             logits.float())
        plain = lm._matmul(hidden).float()
        plain_full = plain.new_full((32, V), float("-inf")).index_copy_(1, d2t, plain)
        # One program a row, and the row split over programs (the last combines): again
        # (the second call finds the counters the first left zero), and replayed in a
        # CUDA graph.
        for split in (False, True, True):
            got = _kernels.argmax_map(logits, d2t, split=split)
            assert torch.equal(got, full.argmax(dim=-1)), split
            # A draft tree's children (top k, mapped, ties to the smallest target id): the
            # reference sorts the -inf-padded vocabulary by (-logit, id), bf16 logits
            # exact.
            for k in (1, 6):
                want = torch.argsort(-full, dim=-1, stable=True)[:, :k]    # ids ascending
                assert torch.equal(_kernels.topk_map(logits, k, d2t, split=split), want), k
            _kernels._TOP_SPLIT, before = split, _kernels._TOP_SPLIT
            try:
                for k in (1, 6):
                    want = torch.argsort(-plain_full, dim=-1, stable=True)[:, :k]
                    assert torch.equal(lm.top(hidden, k, fused=True), want), k
            finally:
                _kernels._TOP_SPLIT = before
        graph, outs = torch.cuda.CUDAGraph(), []
        with torch.cuda.graph(graph):
            outs.append(_kernels.argmax_map(logits, d2t, split=True))
            outs.append(_kernels.topk_map(logits, 6, d2t, split=True))
        for _ in range(3):
            graph.replay()
            assert torch.equal(outs[0], full.argmax(dim=-1))
            assert torch.equal(outs[1], torch.argsort(-full, dim=-1, stable=True)[:, :6])


def test_fused_feature_capture_bf16(tiny_dirs):
    """Features stored by the next norm kernel: their bf16 error against an fp32 forward
    is no worse than the reference path's (as test_fused_kernels_match_reference_bf16)."""
    tokens = torch.randint(0, 256, (2, 4), device="cuda")
    start, slots = torch.tensor([0, 3], device="cuda"), torch.tensor([0, 1], device="cuda")
    feats = {}
    for name, dtype, fused in (("fp32", torch.float32, False), ("ref", torch.bfloat16, False),
                               ("fused", torch.bfloat16, True)):
        model = load_model(tiny_dirs["llama"], dtype=dtype, device="cuda").model
        model.kernels = fused
        out = model(tokens, start, slots, model.make_cache(2, 64), capture=(0, 1))
        feats[name] = out[1].float()
    assert feats["fused"].shape == (2, 4, 2 * model.args.hidden_size)
    err_ref = (feats["ref"] - feats["fp32"]).abs().max().item()
    err_fused = (feats["fused"] - feats["fp32"]).abs().max().item()
    assert err_fused <= 1.5 * err_ref + 1e-3, (err_fused, err_ref)


def test_on_verified_does_not_wait_for_the_gpu(tiny_dirs):
    """VERIFY's rows reach the head's pending buffer without the host waiting for the work
    queued on the device (with the chain: the next DRAFT + VERIFY); a copy from pageable
    memory would wait for the stream first."""
    from types import SimpleNamespace

    from specloop.models.drafters._mtp import MtpEagleDrafter
    from specloop.models.drafters._protocol import DrafterDeps

    loaded = load_model(tiny_dirs["llama"], dtype=torch.bfloat16, device="cuda")
    spec = SimpleNamespace(num_draft_tokens=3, adaptive=False, draft_weights=None,
                           draft_dtype="auto", mtp_weights=None, method="mtp_eagle")
    config = SimpleNamespace(speculative=spec,
                             parallel=SimpleNamespace(lm_head_tp_in_adp=False))
    drafter = MtpEagleDrafter(config, DrafterDeps(loaded, loaded.model.make_cache(4, 128), 4,
                                                  128))
    hidden = torch.randn(2, 4, loaded.args.hidden_size, device="cuda").to(torch.bfloat16)
    # The gather/scatter path, then the last-rows path (the next VERIFY's positions).
    for starts, accepted in (([5, 9], [2, 1]), ([8, 11], [0, 0])):
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)      # ~0.2 s of GPU work queued ahead
        queued = torch.cuda.Event()
        queued.record()
        drafter.on_verified([0, 1], starts, hidden, accepted)
        assert not queued.query(), "on_verified waited for the queued GPU work"
        torch.cuda.synchronize()
    # Slot 0 holds VERIFY's rows 0..2 (first call), then row 0 appended (second call).
    assert drafter.pending.counts([0]) == [4]
    assert torch.equal(drafter.pending.buffer[0, :3], hidden[0, :3])
    assert torch.equal(drafter.pending.buffer[0, 3], hidden[0, 0])


def test_page_table_sync_through_the_staging_ring():
    """The device table equals the host's after random growth, rewinds and releases
    synced while GPU work is queued: more syncs than the ring has buffers (each buffer
    written again only after its copy), and a sync of more entries than the buffers held
    (the ring grows while its old buffers' copies are pending)."""
    import random

    from specloop.models import PageTable

    rng = random.Random(0)
    pages = PageTable(64, 4096, 16, device="cuda")
    lengths = [0] * 64
    x = torch.randn(2048, 2048, device="cuda")
    for i in range(400):
        if i % 10 == 0:
            for _ in range(10):
                x = x @ x / 45      # queued work: the copies wait behind it
        for _ in range(rng.randrange(1, 6)):
            slot = rng.randrange(64)
            lengths[slot] = rng.choice([0, lengths[slot] + rng.randrange(1, 40),
                                        max(lengths[slot] - rng.randrange(1, 40), 0)])
            pages.resize(slot, min(lengths[slot], 4096))
        if i == 200:    # 8 full slots at once: 2,048 entries, 6,144 words > 1,024
            for slot in range(8):
                lengths[slot] = 4096
                pages.resize(slot, 4096)
        pages.sync()
        if i % 50 == 49 or i == 200:
            torch.cuda.synchronize()
            assert torch.equal(pages.table.cpu(), pages.host), f"after sync {i}"


@pytest.mark.parametrize("walk,warps", [("store", None), ("registers", None), ("store", 1)])
def test_tree_greedy_verify_walks_equal_accept_tree_cuda(walk, warps):
    """The tree's greedy VERIFY kernel (``tree_greedy_verify``) with the parents' targets
    through memory and in registers (``walk``), at its default warps (4 for these trees:
    ``tree_warps``) and at one, equals samplers/_tree.accept_tree of the argmax on bf16
    logits over SmolLM2's vocabulary, a 15- and a 30-node tree, eager and replayed in a
    CUDA graph."""
    from specloop.samplers._tree import DraftTree, TreeTables, accept_tree
    from specloop.samplers._triton_greedy import tree_greedy_verify

    gen = torch.Generator(device="cuda").manual_seed(0)
    trees = [DraftTree([(a,) for a in range(6)] + [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0),
                                                    (0, 0, 0), (0, 0, 1), (0, 1, 0),
                                                    (1, 0, 0)]),
             DraftTree([(a,) for a in range(9)] + [(0, b) for b in range(6)]
                       + [(1, 0), (1, 1), (2, 0), (3, 0), (4, 0)]
                       + [(0, 0, c) for c in range(4)] + [(0, 1, 0), (1, 0, 0), (0, 2, 0)]
                       + [(0, 0, 0, 0), (0, 0, 1, 0), (0, 1, 0, 0)])]
    for tree in trees:
        tables = TreeTables.of(tree, "cuda")
        B, R, V = 8, tree.size + 1, 49152
        tokens = torch.randint(0, 4, (B, R), device="cuda", generator=gen)
        logits = torch.randn(B, R, V, device="cuda", generator=gen).bfloat16()
        best = torch.randint(0, 4, (B, R), device="cuda", generator=gen)
        logits.scatter_(2, best[..., None], 30.0)
        want = accept_tree(tables, tokens, logits.argmax(-1))
        assert want.num_accepted.max() > 0
        args = (tokens, logits, tables.parents, tables.ancestors, tables.depths)
        packed, path = tree_greedy_verify(*args, walk=walk, warps=warps)
        assert torch.equal(packed[:, :-1], want.token_ids), (tree.size, walk)
        assert torch.equal(packed[:, -1], want.num_accepted) and torch.equal(path, want.path)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            packed_g, path_g = tree_greedy_verify(*args, walk=walk, warps=warps)
        graph.replay()
        assert torch.equal(packed_g, packed) and torch.equal(path_g, path)
