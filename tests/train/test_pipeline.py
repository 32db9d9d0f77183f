"""`specloop train-draft` end to end on a tiny random target (CPU, seconds): loss falls,
the trained head beats the untrained one on its training distribution, the card's sha256
matches the file, the head loads by path with its card checked, and a run resumes."""

import json

import pytest
import torch

from specloop.models import load_model
from specloop.models.drafters._heads import file_sha256
from specloop.models.testing import write_tiny_checkpoint
from specloop.train import TrainableMtpHead, TrainConfig, offline_acceptance, run
from specloop.train import _trainer
from specloop.train._distill import load_sequences

# The module's tests share one trained head (the `setup` fixture, ~4 s CPU): one xdist
# worker runs them all, so it is trained once per run, not once per worker. Slow (~11 s of
# CPU in all): training runs; the fast subset keeps tests/train/test_eagle3.py's pipeline
# run (trains and serves a head) and the trainer's unit tests.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("train_pipeline")]

WORDS = "cat dog tree river music code fox bread stone cloud paper lamp".split()


def _config(tiny_dir, prompts, out, **optim):
    return TrainConfig.from_dict({
        "target": {"model": str(tiny_dir), "dtype": "float32", "device": "cpu"},
        "data": {"num_train_prompts": 32, "num_eval_prompts": 6, "prompts_file": str(prompts)},
        "generate": {"batch_size": 16, "max_new_tokens": 20, "max_seq_len": 80},
        "head": {"draft_vocab_size": 96, "ttt_steps": 3},
        "optim": {"lr": 3e-3, "max_steps": 40, "batch_size": 8, "warmup_steps": 4,
                  "checkpoint_every": 10, "time_budget_s": 1e6, **optim},
        "eval": {"k": 3, "engine_prompts": 0},
        "output": {"dir": str(out), "name": "tiny-eagle"}})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    tiny_dir = write_tiny_checkpoint(root / "tiny", vocab_size=384, num_layers=2, hidden=64,
                                     seed=1)
    prompts = root / "prompts.jsonl"
    lines = [{"split": "train", "text": f"Tell me about the {WORDS[i % 12]} number {i}.",
              "source": "test", "form": "question"} for i in range(32)]
    lines += [{"split": "eval", "text": f"What is a {WORDS[(5 * i) % 12]}?",
               "source": "test-eval", "form": "question"} for i in range(6)]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = root / "run"
    card = run(_config(tiny_dir, prompts, out), command="test", device="cpu")
    return tiny_dir, prompts, out, card


def test_loss_falls_and_head_beats_untrained(setup):
    tiny_dir, _, out, card = setup
    training = card["training"]
    assert training["steps"] == 40
    assert training["final_loss"] < 0.8 * training["first_loss"]
    loaded = load_model(tiny_dir)
    seqs = [s for s in load_sequences(out / "sequences.pt") if s.split == "train"]
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    heads = {}
    for name in ("untrained", "trained"):
        head = TrainableMtpHead(loaded.args, loaded.model.embed_tokens,
                                loaded.model.lm_head_weight, ckpt["d2t"], 128)
        head.init_from_target(loaded.model, 0)
        if name == "trained":
            head.load_state_dict(ckpt["head"])
        heads[name] = offline_acceptance(head, loaded.model, seqs, 3, "cpu")
    assert heads["trained"]["al"] > heads["untrained"]["al"] + 0.1, heads


def test_card_names_data_and_hash(setup):
    _, _, out, card = setup
    path = out / "tiny-eagle.safetensors"
    assert card["sha256"] == file_sha256(path)
    on_disk = json.loads((out / "tiny-eagle.json").read_text())
    assert on_disk["sha256"] == card["sha256"]
    assert set(on_disk["data"]["prompts"]) == {"train:test", "eval:test-eval"}
    assert len(on_disk["evaluation_held_out"]["offline_greedy"]["per_position"]) == 3
    assert on_disk["target"] == {"model": on_disk["config"]["target"]["model"],
                                 "hidden_size": 64, "vocab_size": 384, "num_layers": 2}


def test_exported_head_holds_only_the_drafters_own_weights(setup):
    """The file holds exactly what MtpEagleHead loads (its own_state, bf16) plus d2t: no
    target embedding or LM head, which the drafter shares with the target."""
    from safetensors.torch import load_file

    from specloop.models.drafters import MtpEagleHead

    tiny_dir, _, out, _ = setup
    tensors = load_file(str(out / "tiny-eagle.safetensors"))
    own = MtpEagleHead(load_model(tiny_dir).model, dtype=torch.float32, device="cpu").own_state()
    assert set(tensors) == set(own) | {"d2t"}
    assert all(t.dtype == torch.bfloat16 for k, t in tensors.items() if k != "d2t")
    assert tensors["d2t"].shape == (96,)


def test_interrupted_run_resumes_to_the_same_head(setup, tmp_path, monkeypatch):
    tiny_dir, prompts, out, _ = setup
    runs = {}
    for name in ("straight", "resumed"):
        d = tmp_path / name
        d.mkdir()
        for f in ("prompts.jsonl", "sequences.pt"):        # stages resume from files
            (d / f).write_bytes((out / f).read_bytes())
        runs[name] = d
    cfg = _config(tiny_dir, prompts, None, max_steps=12, checkpoint_every=5)
    run(cfg, command="test", out_dir=str(runs["straight"]), device="cpu")
    real, calls = _trainer.step_losses, []

    def dies_at_step_8(*a, **kw):
        calls.append(1)
        if len(calls) == 8:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(_trainer, "step_losses", dies_at_step_8)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, command="test", out_dir=str(runs["resumed"]), device="cpu")
    monkeypatch.setattr(_trainer, "step_losses", real)
    assert torch.load(runs["resumed"] / "checkpoint.pt", weights_only=False)["step"] == 5
    run(cfg, command="test", out_dir=str(runs["resumed"]), device="cpu")
    a, b = (torch.load(d / "checkpoint.pt", weights_only=False) for d in runs.values())
    assert a["step"] == b["step"] == 12
    for name, tensor in a["head"].items():
        torch.testing.assert_close(b["head"][name], tensor, rtol=0, atol=0)


def test_max_epochs_caps_the_steps(setup, tmp_path):
    tiny_dir, prompts, out, _ = setup
    for f in ("prompts.jsonl", "sequences.pt"):
        (tmp_path / f).write_bytes((out / f).read_bytes())
    train_answers = sum(s.split == "train" for s in load_sequences(out / "sequences.pt"))
    cfg = _config(tiny_dir, prompts, None, max_steps=1000, max_epochs=1.0)
    card = run(cfg, command="test", out_dir=str(tmp_path), device="cpu")
    assert card["training"]["steps"] == -(-train_answers // 8)       # one pass, batch 8


def _greedy(loaded, model_name, prompts_ids, max_tokens, speculative):
    """(answers, acceptance summary) of greedy runs through the engine."""
    import anyio
    from specloop.engine import AsyncEngine, EngineConfig
    from specloop.samplers import SamplingParams
    from specloop.train import AcceptanceCounter

    k = speculative.get("num_draft_tokens", 1)
    config = EngineConfig.from_dict({
        "model": {"name": model_name, "dtype": "float32", "device": "cpu",
                  "max_seq_len": 128, "chat_template": False},
        "scheduler": {"max_batch_size": 4, "seed": 0}, "speculative": speculative})
    counter, answers = AcceptanceCounter(k), [[] for _ in prompts_ids]

    async def main():
        async with AsyncEngine(config, model=loaded, observers=[counter]) as engine:
            async def one(i, ids):
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                        ignore_eos=True)
                async for out in engine.generate(ids, params):
                    answers[i].extend(out.token_ids)
            async with anyio.create_task_group() as tg:
                for i, ids in enumerate(prompts_ids):
                    tg.start_soon(one, i, ids)

    anyio.run(main)
    return answers, counter


def test_engine_acceptance_equals_the_trainers_chains(setup):
    """Drafting through the engine accepts, iteration by iteration, exactly what the
    trainer's teacher-forced chains predict: chain p = L - 2 (h_{L-2}, t_{L-1}) drafts
    tokens L.. . A drafter or trainer one position off from the other fails this."""
    from safetensors.torch import load_file
    from specloop.train._trainer import Teacher

    tiny_dir, _, out, _ = setup
    loaded = load_model(tiny_dir)
    seqs = [s for s in load_sequences(out / "sequences.pt") if s.split == "train"][:4]
    prompts = [list(s.tokens[:s.prompt_len]) for s in seqs]
    k, n = 3, 16
    truth, _ = _greedy(loaded, str(tiny_dir), prompts, n + k + 1, {"method": "none"})
    # The trainer's chains are float32: the engine's head too (not bf16 on an AMX CPU).
    spec = {"method": "mtp_eagle", "num_draft_tokens": k, "draft_dtype": "float32",
            "draft_weights": str(out / "tiny-eagle.safetensors")}
    answers, counter = _greedy(loaded, str(tiny_dir), prompts, n, spec)
    assert answers == [t[:n] for t in truth]
    state = load_file(str(out / "tiny-eagle.safetensors"))
    head = TrainableMtpHead(loaded.args, loaded.model.embed_tokens,
                            loaded.model.lm_head_weight, state["d2t"], 128)
    head.load_state_dict({name: v.float() if v.is_floating_point() else v
                          for name, v in state.items()})
    hits, rows = [0] * k, 0
    for ids, full in zip(prompts, truth):
        seq = torch.tensor([ids + full])
        with torch.no_grad():
            steps = head.unroll(seq, Teacher(loaded.model, 1, 128).hidden(seq), k)
        drafts = [head.d2t[s[0].argmax(-1)].tolist() for s in steps]   # [k][chain p]
        L = len(ids)
        while L - len(ids) < n:
            p, accepted = L - 2, 0
            while accepted < k and drafts[accepted][p] == seq[0, L + accepted]:
                accepted += 1
            rows += 1
            for j in range(accepted):
                hits[j] += 1
            L += accepted + 1
    assert rows == counter.rows and hits == counter.hits, (rows, hits, counter.summary())
    assert sum(hits) > 0          # the check has something to compare
