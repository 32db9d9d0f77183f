"""How n-gram K = 4's iterations split by the length of the match they drafted from, and
what verifying one row where the match is short would give (issue 12's n-gram bar).

Greedy SmolLM2 (fp32, CPU) continues the first ``--prompts`` held-out chat prompts by
``--tokens`` tokens; then each continuation is replayed as greedy n-gram speculation would
run it (the engine's ``NgramDrafter.match_row``: the latest earlier occurrence of the last n
tokens, n = ngram_max .. ngram_min, the K tokens after it, the last token repeated where
none matches or the draft runs past the end), each iteration (after the prefill's first
token) accepting the drafts that equal the continuation and adding one token. The replay's AL is the engine's (greedy
speculation commits the same tokens as greedy decoding). For each minimum match
length m it reports the iterations that would draft (match >= m), their share, the AL,
and, at the given iteration times (``--t-none`` decode, ``--t-draft`` a K + 1-row VERIFY;
default: the H200's at batch 1 with the shipped table, docs/performance-history.md, "n-gram:
half its iterations draft from no match"), tokens/s over no speculation and that over AL —
the bar's 0.8 x AL — for a drafter that verifies one row (no draft) below m:

    cd bench && python ngram_match_study.py [--prompts 16] [--tokens 128]
"""

from __future__ import annotations

import argparse
import collections
import json

import anyio

from _common import HELD_OUT, chat_prompts, engine_config, held_out_texts, load_smol


def ngram_drafter(k: int, n_max: int, n_min: int):
    """The engine's host n-gram drafter (``NgramDrafter.match_row``), no device."""
    import types  # noqa: PLC0415

    from specloop.models.drafters import NgramDrafter  # noqa: PLC0415
    spec = types.SimpleNamespace(num_draft_tokens=k, ngram_min=n_min, ngram_max=n_max)
    return NgramDrafter(types.SimpleNamespace(speculative=spec),
                        types.SimpleNamespace(target_cache=None))


def replay(prompt: list[int], continuation: list[int], k: int, n_max: int, n_min: int,
           min_match: int = 0, late: bool = False) -> list[tuple[int, bool, int]]:
    """(match length, drafted, accepted drafts) per iteration of greedy n-gram
    speculation. With ``min_match`` an iteration drafts only where the match is at least
    that long (K = 0 otherwise: one row, one token); ``late``: where the previous
    iteration's match was (computed whether or not it drafted; what a host can know when
    it queues a chained step), the first iteration drafting."""
    drafter = ngram_drafter(k, n_max, n_min)     # its index fills as the row grows
    done, out, before = 1, [], min_match     # the prefill gives the first token
    while done < len(continuation):
        n, drafts = drafter.match_row(0, prompt + continuation[:done], k)
        drafted, accepted = (before if late else n) >= min_match, 0
        before = n
        while (drafted and accepted < k and done + accepted < len(continuation)
               and drafts[accepted] == continuation[done + accepted]):
            accepted += 1
        out.append((n, drafted, accepted))
        done += accepted + 1
    return out


async def continuations(loaded, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from specloop.engine import AsyncEngine  # noqa: PLC0415
    from specloop.samplers import SamplingParams  # noqa: PLC0415

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    got: dict[str, list[int]] = collections.defaultdict(list)
    cfg = engine_config({"method": "none"}, len(prompts), "cpu")
    async with AsyncEngine(cfg, model=loaded) as engine:
        async for outputs in engine.generate_batch(prompts, params):
            for output in outputs:
                got[output.request_id].extend(output.token_ids)
    # A new engine's automatic ids, req-0, req-1, ..., in prompt order.
    return [got[f"req-{i}"] for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--ngram-max", type=int, default=3)
    ap.add_argument("--ngram-min", type=int, default=1)
    ap.add_argument("--t-none", type=float, default=0.497, help="ms, decode iteration")
    ap.add_argument("--t-draft", type=float, default=0.74, help="ms, K + 1-row iteration")
    ap.add_argument("--out", default=None, help="JSON of the figures")
    args = ap.parse_args()
    loaded = load_smol("cpu")
    prompts = chat_prompts(loaded.tokenizer, held_out_texts(HELD_OUT), args.prompts)
    conts = anyio.run(continuations, loaded, prompts, args.tokens)
    its = [it for p, c in zip(prompts, conts)
           for it in replay(p, c, args.k, args.ngram_max, args.ngram_min)]
    # AL: tokens over iterations (the prefill's first token included, a last iteration's
    # bonus past the end not), as the engine's stats count it.
    committed = sum(len(c) for c in conts)
    by_n = collections.Counter(n for n, _, _ in its)
    acc_by_n = {n: sum(a for m, _, a in its if m == n) / by_n[n] for n in by_n}
    report = {"prompts": len(prompts), "tokens": args.tokens, "iterations": len(its),
              "al": committed / len(its),
              "share_by_match": {n: round(by_n[n] / len(its), 3) for n in sorted(by_n)},
              "accepted_by_match": {n: round(acc_by_n[n], 3) for n in sorted(acc_by_n)},
              "min_match": {}}
    print(f"{len(prompts)} prompts x {args.tokens} tokens: {len(its)} iterations, "
          f"AL {report['al']:.3f} (n-gram K = {args.k}, n = {args.ngram_min}..{args.ngram_max})")
    print("match length: share of iterations, drafts accepted an iteration")
    for n in sorted(by_n):
        print(f"  {n}: {by_n[n] / len(its):.3f}  {acc_by_n[n]:.3f}")
    for m in range(1, args.ngram_max + 1):
        # Below m: no draft, one row verified, one token. A skipped draft moves the later
        # iterations, so each gate replays afresh.
        for late in (False, True):
            gated = [it for p, c in zip(prompts, conts) for it in replay(
                p, c, args.k, args.ngram_max, args.ngram_min, min_match=m, late=late)]
            drafting = sum(1 for _, d, _ in gated if d)
            al = committed / len(gated)
            t = (drafting * args.t_draft + (len(gated) - drafting) * args.t_none) / len(gated)
            ratio = al * args.t_none / t
            row = {"drafting_share": round(drafting / len(gated), 3), "al": round(al, 3),
                   "ratio": round(ratio, 3), "ratio_over_al": round(ratio / al, 3)}
            report["min_match"].setdefault(m, {})["one_late" if late else "now"] = row
            print(f"draft only at match >= {m}{', chosen one iteration late' if late else ''}: "
                  f"{row['drafting_share']:.3f} of iterations draft, AL {al:.3f}, "
                  f"tok/s {ratio:.3f}x none = {ratio / al:.3f} x AL")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
