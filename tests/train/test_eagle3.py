"""eagle3: the target's feature layers, the trainable head == the drafter's head chained,
the engine wiring (the target captures only for eagle3), the engine's acceptance == the
offline walk, and the pipeline end to end."""

import json

import pytest
import torch
from safetensors.torch import save_file

from specloop.models import load_model
from specloop.models._layers import rms_norm
from specloop.models.drafters import Eagle3Head
from specloop.models.drafters._eagle3 import default_feature_layers
from specloop.models.testing import write_tiny_checkpoint
from specloop.train import TrainableEagle3Head, TrainableMtpHead, TrainConfig, run
from specloop.train._distill import Sequence as Answer
from specloop.train._evaluate import _summary, offline_acceptance, walk
from specloop.train._trainer import Teacher


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("e") / "m", vocab_size=384,
                                 num_layers=4, hidden=64, seed=5)
    return path, load_model(path, dtype=torch.float64)


def test_default_layers():
    assert default_feature_layers(30) == (1, 14, 26)      # SmolLM2-135M
    assert default_feature_layers(4) == (0, 1)
    assert default_feature_layers(2) == (0, 1)


def test_captured_features_are_the_residual_streams(tiny):
    _, loaded = tiny
    model = loaded.model
    tokens = torch.randint(0, 384, (2, 9), generator=torch.Generator().manual_seed(0))
    args = (tokens, torch.tensor([0, 0]), torch.tensor([0, 1]))
    plain = model(*args, model.make_cache(2, 32))
    hidden, feats = model(*args, model.make_cache(2, 32), capture=(1, 3))
    assert torch.equal(hidden, plain)
    h = model.args.hidden_size
    for j, layer in enumerate((1, 3)):
        # The final norm of the residual after layer i is an early exit at i + 1 layers.
        exit_i = model(*args, model.make_cache(2, 32), num_layers=layer + 1)
        torch.testing.assert_close(rms_norm(feats[..., j * h:(j + 1) * h], model.norm,
                                            model.args.rms_norm_eps), exit_i)


def test_unrolled_steps_equal_chained_drafting(tiny, tmp_path):
    _, loaded = tiny
    model, layers = loaded.model, (0, 2, 3)
    d2t = torch.arange(0, 384, 2)
    train = TrainableEagle3Head(loaded.args, model.embed_tokens, model.lm_head_weight, d2t,
                                64, layers)
    train.init_from_target(model, seed=5)
    with torch.no_grad():
        for p in train.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    train = train.double()
    save_file({k: v.contiguous() for k, v in train.export_state().items()},
              str(tmp_path / "h.safetensors"))
    head = Eagle3Head(model, dtype=torch.float64, device="cpu", feature_layers=layers)
    head.load(str(tmp_path / "h.safetensors"))
    T, steps = 12, 3
    tokens = torch.randint(0, 384, (1, T), generator=torch.Generator().manual_seed(0))
    hidden, feats = Teacher(model, 1, 64, layers).both(tokens)
    with torch.no_grad():
        unrolled = train.unroll(tokens, feats, steps)
        for p in (0, 5, 8):
            cache = head.block.make_cache(1, 64)
            g = head(tokens[:, 1:p + 2], feats[:, :p + 1], torch.tensor([0]),
                     torch.tensor([0]), cache)[:, -1]
            for j in range(steps):
                if j:
                    g = head(tokens[:, p + 1 + j:p + 2 + j], g[:, None], torch.tensor([p + j]),
                             torch.tensor([0]), cache)[:, 0]
                want = torch.nn.functional.linear(g, model.lm_head_weight[d2t])
                torch.testing.assert_close(unrolled[j][0, p], want[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method, layers", [("eagle3", (0, 1)), ("mtp_eagle", ())])
def test_engine_captures_only_for_eagle3(tiny, method, layers):
    from specloop.engine import AsyncEngine, EngineConfig
    import anyio

    path, loaded = tiny

    async def main():
        config = EngineConfig.from_dict({
            "model": {"name": str(path), "dtype": "float64", "device": "cpu",
                      "max_seq_len": 64, "chat_template": False},
            "scheduler": {"max_batch_size": 2}, "speculative": {"method": method, "num_draft_tokens": 2}})
        async with AsyncEngine(config, model=loaded) as engine:
            runner, drafter = engine.worker.runner, engine.worker.drafter
            return runner.feature_layers, drafter.pending.buffer.shape[-1]

    got, width = anyio.run(main)
    assert got == layers
    assert width == 64 * max(1, len(layers))


def test_walk_takes_the_engines_starts():
    # accepted count per start p; from p = 1: accept 2 (commit 3) -> p = 4: 0 -> p = 5: 3
    # -> p = 9 >= end.
    assert walk([9, 2, 9, 9, 0, 3, 9, 9, 9, 9], 1, 9) == [2, 0, 3]
    assert walk([0, 0, 0], 0, 3) == [0, 0, 0]
    assert walk([1], 0, 0) == []


@pytest.mark.parametrize("method", ["eagle3", "mtp_eagle"])
def test_engine_drafts_as_the_offline_chains(tiny, tmp_path, monkeypatch, method):
    """Greedy through the engine, the drafter's hidden state at every draft step of every
    DRAFT equals the trainable head's chain from the same start on the same tokens (the
    committed ones, then the drafts), fp64: the catch-up of the accepted rows from the
    target's features, the positions, the feature layers as the trained head's. And per
    request the engine accepts what the offline chains accept along the engine's starts
    on its own answers (the walk the card reports as engine_window.walk_k<K>: the figure
    to compare the engine's with, not the every-start one); d2t skips id 0, so an index/id
    mix-up in the reduced vocabulary shows."""
    from specloop.engine import AsyncEngine, EngineConfig
    from specloop.models.drafters._lm_head import DraftHead
    from specloop.models.drafters._mtp import MtpEagleDrafter
    from specloop.samplers import SamplingParams
    import anyio

    path, loaded = tiny
    model, k, window = loaded.model, 3, 20
    d2t = torch.arange(1, 384)
    if method == "eagle3":
        head = TrainableEagle3Head(loaded.args, model.embed_tokens, model.lm_head_weight, d2t,
                                   64, (0, 2, 3))
    else:
        head = TrainableMtpHead(loaded.args, model.embed_tokens, model.lm_head_weight, d2t, 64)
    head.init_from_target(model, seed=5)     # drafts the target's own next token: loops pass
    head = head.double()
    head.embed, head.draft_lm = model.embed_tokens, model.lm_head_weight[d2t]  # not via fp32
    meta = {"method": method}
    if method == "eagle3":
        meta["feature_layers"] = "0,2,3"
    save_file({k: v.contiguous() for k, v in head.export_state().items()},
              str(tmp_path / "h.safetensors"), metadata=meta)

    # Each DRAFT: (committed tokens per row, drafts [B, K], hidden per step [B, H]).
    hidden: list[torch.Tensor] = []
    drafts: list[tuple[list[list[int]], list[list[int]], list[torch.Tensor]]] = []
    logits, propose = DraftHead.logits, MtpEagleDrafter.propose

    def record_logits(self, h):
        hidden.append(h.clone())
        return logits(self, h)

    async def record_propose(self, ctx):
        seen = len(hidden)
        out = await propose(self, ctx)
        drafts.append(([list(t) for t in ctx.token_ids], out.token_ids.tolist(), hidden[seen:]))
        return out

    monkeypatch.setattr(DraftHead, "logits", record_logits)
    monkeypatch.setattr(MtpEagleDrafter, "propose", record_propose)
    rows: dict[str, list[int]] = {}

    class Rows:
        def on_transition(self, event):
            for rid, n in zip(event.request_ids, event.accepted or ()):
                rows.setdefault(rid, []).append(n)

    config = EngineConfig.from_dict({
        "model": {"name": str(path), "dtype": "float64", "device": "cpu", "max_seq_len": 64,
                  "chat_template": False},
        "scheduler": {"max_batch_size": 4},
        "speculative": {"method": method, "num_draft_tokens": k,
                        "draft_weights": str(tmp_path / "h.safetensors")}})
    # Answers k + 1 tokens past the window: every start in it has all k targets inside.
    params = SamplingParams(temperature=0.0, max_tokens=window + k + 1, ignore_eos=True)
    prompts = [[1, 5 + i, 17 * i % 384, 40 + i] for i in range(4)]
    answers: dict[int, tuple[str, list[int]]] = {}

    async def main():
        async with AsyncEngine(config, model=loaded, observers=[Rows()]) as engine:
            async def one(i):
                outs = [o async for o in engine.generate(prompts[i], params)]
                answers[i] = (outs[0].request_id, [t for o in outs for t in o.token_ids])
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)

    anyio.run(main)
    teacher = Teacher(model, 1, 64, head.feature_layers)
    assert drafts
    for committed, drafted, steps in drafts:
        assert len(steps) == k
        for b, (seq, d) in enumerate(zip(committed, drafted)):
            tokens = torch.tensor([seq + d[:-1]])
            want = head.unroll_hidden(tokens, teacher.both(tokens)[1], k)
            for j in range(k):
                torch.testing.assert_close(steps[j][b], want[j][0, len(seq) - 2],
                                           rtol=1e-9, atol=1e-9)
    taken = []
    for i, prompt in enumerate(prompts):
        rid, answer = answers[i]
        engine, generated = [], 0
        for n in rows[rid]:                  # the engine's rows inside the window
            if generated < window:
                engine.append(n)
            generated += n + 1
        seq = Answer(tuple(prompt + answer), len(prompt), "eval", "greedy")
        got = offline_acceptance(head, model, [seq], k, "cpu", window=window)
        assert got["engine_window"]["walk_k3"] == _summary(torch.tensor(engine), k), i
        taken += engine
    assert max(taken) == k and min(taken) == 0      # full chains and rejections both seen


def test_pipeline_trains_and_serves_an_eagle3_head(tmp_path):
    tiny_dir = write_tiny_checkpoint(tmp_path / "tiny", vocab_size=384, num_layers=4,
                                     hidden=64, seed=1)
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"split": "train", "text": f"Tell me about item {i}.", "source": "test",
              "form": "question"} for i in range(12)]
    lines += [{"split": "eval", "text": f"What is {i}?", "source": "test-eval",
               "form": "question"} for i in range(3)]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = TrainConfig.from_dict({
        "target": {"model": str(tiny_dir), "dtype": "float32", "device": "cpu"},
        "data": {"num_train_prompts": 12, "num_eval_prompts": 3, "prompts_file": str(prompts)},
        "generate": {"batch_size": 8, "max_new_tokens": 12, "max_seq_len": 64,
                     "backend": "batched", "answers_per_prompt": 2},
        "head": {"method": "eagle3", "draft_vocab_size": 96, "ttt_steps": 2},
        "optim": {"lr": 3e-3, "max_steps": 12, "batch_size": 8, "warmup_steps": 2,
                  "checkpoint_every": 100, "time_budget_s": 1e6, "bf16_autocast": True},
        "eval": {"k": 2, "engine_prompts": 2, "engine_max_tokens": 8, "ngram": False},
        "output": {"dir": str(tmp_path / "run"), "name": "tiny-eagle3"}})
    card = run(cfg, command="test", device="cpu")
    assert card["method"] == "eagle3"
    assert card["data"]["sequences"]["train"] > 12          # two answers per prompt
    assert card["training"]["final_loss"] < card["training"]["first_loss"]
    # The engine loaded the head (feature layers from its metadata) and drafted with it.
    assert card["evaluation_held_out"]["engine_greedy_k2"]["verify_rows"] > 0
    # The offline figures over the engine's window too (walk_k3: K = 3 > eval.k = 2, none).
    offline = card["evaluation_held_out"]["offline_greedy"]
    window = offline["engine_window"]
    assert set(window) == {"answer_tokens", "every", "walk_k2"} and window["answer_tokens"] == 8
    assert offline["starts"] >= window["every"]["starts"] >= window["walk_k2"]["starts"] > 0
