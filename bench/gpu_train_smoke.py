"""GPU smoke check of the training path before a real run (tiny random target, bf16, CUDA):
the batched distiller's CUDA-graph decode gives the eager decode's greedy answers, and the
whole pipeline (batched distill, bf16-autocast training, export, engine eval) runs for
mtp_eagle and eagle3.  python bench/gpu_train_smoke.py /tmp/smoke"""

import json
import os
import sys
import time
from pathlib import Path

import torch

from specloop.models import load_model
from specloop.models.testing import write_tiny_checkpoint
from specloop.train import TrainConfig, run
from specloop.train._batched import _Decoder, distill_batched
from specloop.train._progress import _Silent


DEV = os.environ.get("SMOKE_DEVICE", "cuda")          # cpu: checks the script itself
DTYPE = "bfloat16" if DEV == "cuda" else "float32"


def main(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    tiny = write_tiny_checkpoint(root / "tiny", vocab_size=512, num_layers=4, hidden=128,
                                 num_heads=4, num_kv_heads=2, intermediate=256, seed=1)
    loaded = load_model(tiny, dtype=getattr(torch, DTYPE), device=DEV)
    gen = torch.Generator().manual_seed(0)
    jobs = [(torch.randint(3, 512, (int(n),), generator=gen).tolist(), 0.0, 0)
            for n in torch.randint(4, 40, (40,), generator=gen)]
    kw = dict(batch_size=16, max_new_tokens=24, max_seq_len=96, time_budget_s=1e6, seed=0,
              bar=_Silent())
    graphed = distill_batched(loaded, jobs, **kw)
    orig = _Decoder._capture
    _Decoder._capture = lambda self: (_ for _ in ()).throw(RuntimeError("eager on purpose"))
    eager = distill_batched(loaded, jobs, **kw)
    _Decoder._capture = orig
    same = sum(a == b for a, b in zip(graphed, eager))
    print(json.dumps({"graph_vs_eager_equal_answers": f"{same}/{len(jobs)}"}))
    prompts = root / "prompts.jsonl"
    lines = [{"split": "train", "text": f"Tell me about item {i}.", "source": "t",
              "form": "q"} for i in range(64)]
    lines += [{"split": "eval", "text": f"What is {i}?", "source": "e", "form": "q"}
              for i in range(8)]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    for method in ("mtp_eagle", "eagle3"):
        cfg = TrainConfig.from_dict({
            "target": {"model": str(tiny), "dtype": DTYPE, "device": DEV},
            "data": {"num_train_prompts": 64, "num_eval_prompts": 8,
                     "prompts_file": str(prompts)},
            "generate": {"batch_size": 32, "max_new_tokens": 24, "max_seq_len": 96,
                         "backend": "batched", "answers_per_prompt": 2},
            "head": {"method": method, "draft_vocab_size": 128, "ttt_steps": 3},
            "optim": {"lr": 3e-3, "max_steps": 30, "batch_size": 16, "warmup_steps": 3,
                      "checkpoint_every": 100, "time_budget_s": 1e6, "bf16_autocast": True},
            "eval": {"k": 3, "engine_prompts": 4, "engine_max_tokens": 16, "ngram": False},
            "output": {"dir": str(root / method), "name": f"tiny-{method}"}})
        start = time.perf_counter()
        card = run(cfg, command="smoke", device=DEV)
        print(json.dumps({"method": method, "seconds": round(time.perf_counter() - start, 1),
                          "loss": [card["training"]["first_loss"],
                                   card["training"]["final_loss"]],
                          "evals": {k: v["al"] for k, v in
                                    card["evaluation_held_out"].items()}}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
