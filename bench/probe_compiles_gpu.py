# The session probe behind bench/results/h200_1202d_probe_*.txt (kept as it ran; the GPU test
# tests/graphs/test_chain_adaptive.py::test_every_move_with_ragged_prompts_on_cuda: its scenario).
#     python bench/probe_compiles_gpu.py [eagle3|ngram]
"""GPU: which Triton kernels compile a new specialisation after warm-up while an adaptive
eagle3 engine (tiny random model and head, CUDA graphs) serves K switches of every kind and
prompts of many lengths. Prints, per new cache entry: the kernel, the engine state it
appeared in, the iteration's K and batch, and the specialisation key."""
import sys, pathlib, tempfile, importlib, json
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))     # the tests' helpers
import anyio, torch
from tests.engine.test_adaptive import cycle_k
from specloop.engine import AsyncEngine, EngineConfig
from specloop.models import load_model
from specloop.models.testing import write_tiny_checkpoint
from specloop.samplers import SamplingParams
dev = "cuda" if torch.cuda.is_available() else "cpu"
from tests.triton_variants import compiled_variants as keys, jit_functions
print("jit functions", len(jit_functions()))
seen = [None]
found = []
class Obs:
    def on_transition(self, e):
        if seen[0] is None: return
        now = keys()
        for n, ks in now.items():
            for k in ks - seen[0].get(n, set()):
                found.append({"kernel": n, "state": e.state.value, "k": e.num_draft_tokens,
                              "batch": e.batch_size, "key": k[:300]})
        seen[0] = now
d = write_tiny_checkpoint(pathlib.Path(tempfile.mkdtemp()) / "t", vocab_size=384,
                          num_layers=2, hidden=64, seed=1)
loaded = load_model(d, dtype=torch.bfloat16 if dev == "cuda" else torch.float32, device=dev)
cfg = EngineConfig.from_dict({
    "model": {"name": str(d), "dtype": "bfloat16" if dev == "cuda" else "float32",
              "device": dev, "max_seq_len": 1024, "chat_template": False},
    "scheduler": {"max_batch_size": 4},
    "speculative": {"method": sys.argv[1] if len(sys.argv) > 1 else "eagle3",
                    "num_draft_tokens": 3, "adaptive": True},
    "components": {"graph_cache": "cuda" if dev == "cuda" else "eager"},
    "graphs": {"batch_buckets": [1, 2, 4]}})
pattern = [3, 0, 0, 1, 1, 2, 2, 3, 3, 1, 3, 2, 0, 2, 1, 0, 3, 0]   # every (a, b) move
async def main():
    async with AsyncEngine(cfg, model=loaded, observers=[Obs()]) as engine:
        cycle_k(engine.worker.adaptive, pattern)
        seen[0] = keys()
        print("after warm-up", sum(map(len, seen[0].values())), "entries")
        async def one(i, n):
            p = SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=i, max_tokens=90,
                               ignore_eos=True)
            prompt = [5 + (j * 7 + i) % 300 for j in range(n)]
            async for _ in engine.generate(prompt, p, request_id=f"r{i}"):
                pass
        for round_ in range(3):
            async with anyio.create_task_group() as tg:
                for i, n in enumerate([1, 2, 15, 16, 17, 31, 32, 33][round_ % 2::2]):
                    tg.start_soon(one, 10 * round_ + i, n + round_)
anyio.run(main)
print("new entries after warm-up", len(found))
by = {}
for f in found:
    by.setdefault((f["kernel"], f["state"], f["k"]), []).append(f["key"])
for (kern, state, k), ks in sorted(by.items(), key=str):
    print(f"{kern:40s} {state:15s} K={k} n={len(ks)}  e.g. {ks[0][:220]}")
