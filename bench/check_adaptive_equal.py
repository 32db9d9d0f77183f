"""Adaptive K's one-rank path at a git revision against the working tree's, on the same
random sequences (batch sizes, classes, acceptance, measured times, disturbances, choices
taken early and committed): every choice, E(k) and learned time equal. For host-time work
on engine/_adaptive.py that must not change what the rule does.

    python bench/check_adaptive_equal.py [REV]      (default HEAD)
"""
import importlib.util
import pathlib
import random
import subprocess
import sys
import tempfile

from specloop.engine import _adaptive as new

rev = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
root = pathlib.Path(__file__).resolve().parents[1]
old_src = subprocess.run(["git", "show", f"{rev}:engine/_adaptive.py"], cwd=root, check=True,
                         capture_output=True, text=True).stdout
with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(old_src)
spec = importlib.util.spec_from_file_location("adaptive_ref", f.name)
ref = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ref)

def build(mod, classes):
    device = {(b, k): 0.5e-3 + 1e-5 * b * (k + 1) for b in (1, 2, 4, 8, 16, 32, 64) for k in range(4)}
    return mod.AdaptiveK([0, 1, 2, 3], mod.CostTable(device=dict(device)), classes=classes,
                         burn_in=mod.BURN_IN)

for seed in range(20):
    classes = seed % 3
    rng = random.Random(seed)
    a, b = build(ref, classes), build(new, classes)
    k = 0
    for i in range(3000):
        batch = rng.choice([1, 2, 3, 5, 8, 13, 32, 64])
        cls = None if not classes or rng.random() < 0.3 else [rng.randrange(classes + 1) for _ in range(batch)]
        if a.committed:
            ka, kb = a.choose_committed(batch), b.choose_committed(batch)
        else:
            ka, kb = a.choose([a.facts(cls)], batch), b.choose([b.facts(cls)], batch)
        assert ka == kb, (seed, i, ka, kb)
        k = ka
        acc = [min(rng.randrange(5), k) for _ in range(batch)]
        a.record(k, acc, cls); b.record(k, acc, cls)
        t = 1e-3 * (1 + 0.2 * k) * (1 + rng.random() * 0.3)
        a.measured(t); b.measured(t)
        if rng.random() < 0.05:
            a.disturb(); b.disturb()
        if rng.random() < 0.8:      # the next choice taken early, committed mostly
            stay = rng.random() < 0.1
            na = a.next_k(batch, k, stay=stay, classes=cls)
            nb = b.next_k(batch, k, stay=stay, classes=cls)
            assert na == nb, (seed, i, na, nb)
            if rng.random() < 0.9:
                a.commit(na); b.commit(nb)
        assert a._expected_here(cls) == b._expected_here(cls), (seed, i)
    for attr in ("measured", "switch", "rest", "samples", "device"):
        assert getattr(a.cost, attr) == getattr(b.cost, attr), (seed, attr)
    assert a.reached == b.reached and a.accepted == b.accepted and a.chosen == b.chosen
print(f"equal to {rev} on 20 sequences of 3,000 iterations")
