"""The checks of ``certify``, as functions of the engine's outputs (no engine here).

Distribution: per prompt, params and generated position j, the engine's tokens against the
target's own distribution at j given each sample's prefix (teacher-forced forward of the
sampled sequences; position 1 is the exact marginal, later positions the sum of the
per-sample conditionals). A control tests the same tokens against a wrong temperature.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch

from specloop.models import LoadedModel
from specloop.models._grad import inference_mode
from specloop.samplers import SamplingBatch, SamplingParams, compute_probs
from specloop.samplers._stats import Chi2Result, chi2_counts

PASS, FAIL, INCONCLUSIVE, SKIPPED = "pass", "fail", "inconclusive", "skipped"


@attrs.frozen
class CheckResult:
    name: str
    status: str
    summary: str
    details: Any = None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "summary": self.summary,
                "details": self.details}


def worst(statuses: Sequence[str]) -> str:
    """fail > inconclusive > pass; skipped counts as nothing (all skipped: skipped)."""
    for status in (FAIL, INCONCLUSIVE, PASS):
        if status in statuses:
            return status
    return SKIPPED


# Distribution ---------------------------------------------------------------------------
@inference_mode
def expected_counts(loaded: LoadedModel, prompt: Sequence[int], samples: torch.Tensor,
                    params: SamplingParams, *, chunk: int = 64) -> torch.Tensor:
    """f64 [P, V]: sum over samples [N, P] of the target's p(. | prompt, sample[:j]) at each
    generated position j, with ``params`` applied (temperature, top-k/p, min-p)."""
    model = loaded.model
    n, positions = samples.shape
    device = next(model.parameters()).device
    first = len(prompt) - 1                      # logits index predicting position 1
    total = torch.zeros(positions, loaded.args.vocab_size, dtype=torch.float64)
    for lo in range(0, n, chunk):
        rows = samples[lo:lo + chunk]
        b = rows.shape[0]
        seqs = torch.cat([torch.tensor([list(prompt)]).expand(b, -1),
                          rows[:, :positions - 1]], dim=1).to(device)
        cache = model.make_cache(b, seqs.shape[1])
        hidden = model(seqs, torch.zeros(b, dtype=torch.int64, device=device),
                       torch.arange(b, device=device), cache)
        logits = model.logits(hidden[:, first:first + positions])          # [b, P, V]
        batch = SamplingBatch.from_params([params] * b, [0] * b, device=device)
        total += compute_probs(logits, batch).double().sum(dim=0).cpu()
    return total


def position_verdict(result: Chi2Result, control: Chi2Result) -> str:
    if not result.passed:
        return FAIL
    return PASS if not control.passed else INCONCLUSIVE


def distribution_rows(loaded: LoadedModel, prompt: Sequence[int], params: SamplingParams,
                      samples: torch.Tensor, control_ratio: float) -> list[dict[str, Any]]:
    """One row per generated position: statistic, df, threshold, verdict, and the control."""
    wrong = attrs.evolve(params, temperature=params.temperature * control_ratio)
    exact = expected_counts(loaded, prompt, samples, params)
    control = expected_counts(loaded, prompt, samples, wrong)
    rows = []
    for j in range(samples.shape[1]):
        observed = torch.bincount(samples[:, j], minlength=exact.shape[1])
        result, ctl = chi2_counts(observed, exact[j]), chi2_counts(observed, control[j])
        rows.append({"position": j + 1, **result.as_dict(),
                     "control": {"temperature": wrong.temperature, **ctl.as_dict()},
                     "verdict": position_verdict(result, ctl)})
    return rows


def distribution_check(groups: list[dict[str, Any]]) -> CheckResult:
    """groups: {"prompt", "params", "rows"} per (prompt, params) tested."""
    if not groups:
        return CheckResult("distribution", SKIPPED,
                           "no sampled params (greedy is covered by the greedy check)")
    verdicts = [row["verdict"] for g in groups for row in g["rows"]]
    status = worst(verdicts)
    bad = [f"prompt {g['prompt_index']} {g['params_text']} position {row['position']}: "
           f"chi2 {row['statistic']:.1f} vs {row['threshold']:.1f}, control "
           f"{row['control']['statistic']:.1f} vs {row['control']['threshold']:.1f}"
           for g in groups for row in g["rows"] if row["verdict"] != PASS]
    summary = (f"{verdicts.count(PASS)}/{len(verdicts)} positions pass with a failing "
               f"control" + ("" if not bad else "; " + "; ".join(bad[:4])))
    return CheckResult("distribution", status, summary, groups)


# Greedy and invariance --------------------------------------------------------------------
def compare_outputs(name: str, reference: Sequence[Sequence[int]],
                    observed: Sequence[Sequence[int]], labels: Sequence[str], what: str
                    ) -> CheckResult:
    """Token-for-token equality of each job's output with the reference."""
    mismatches: list[dict[str, Any]] = [{"job": label, "expected": list(a), "got": list(b)}
                  for label, a, b in zip(labels, reference, observed) if tuple(a) != tuple(b)]
    status = FAIL if mismatches else PASS
    summary = (f"{len(reference) - len(mismatches)}/{len(reference)} {what} identical"
               + ("" if not mismatches else
                  "; first mismatch: " + mismatches[0]["job"]))
    return CheckResult(name, status, summary, {"mismatches": mismatches,
                                               "num_jobs": len(reference)})


def skipped(name: str, why: str) -> CheckResult:
    return CheckResult(name, SKIPPED, why)
