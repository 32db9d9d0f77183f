import subprocess
import sys

import pytest

import specloop.samplers as samplers

PUBLIC = {
    "DefaultSampler", "DraftSample", "RejectionResult", "Sampler", "SamplingBatch",
    "SamplingParams", "SamplingParamsError", "SpecMetadata", "Stream", "compute_probs",
    "derive_seed", "rejection_sample", "sample_tokens", "strict_verify",
    "uniform",
}


def test_public_names():
    assert set(samplers.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(samplers, name).__module__.startswith("specloop.samplers")


# A fresh interpreter (imports torch, ~3 s CPU): slow; test_packaging's
# test_imports_point_one_way checks the same imports statically in the fast subset.
@pytest.mark.slow
def test_imports_nothing_of_the_project():
    # `import *` resolves every public name (they load on first use).
    code = ("import sys; from specloop.samplers import *; print(sorted(m for m in sys.modules "
            "if m.startswith('specloop.') and not m.startswith('specloop.samplers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"



def test_default_sampler_satisfies_the_protocol():
    # Name -> factory lives in specloop.engine's one registry (samplers import no project).
    assert isinstance(samplers.DefaultSampler(), samplers.Sampler)
