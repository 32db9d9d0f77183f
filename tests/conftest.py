import logging

import pytest
import structlog
import torch

from . import smollm2 as smol


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    if not torch.cuda.is_available():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)


@pytest.fixture(autouse=True, scope="session")
def _quiet_structlog():
    # Tests may configure structlog (the library never does): warnings and up only, so
    # per-iteration debug events cost nothing; capture_logs tests lower it themselves.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        processors=[structlog.dev.ConsoleRenderer(colors=False)])
    yield


# SmolLM2 (slow tests only): loaded and its transformers reference computed once per
# session, shared by tests/models/test_smollm2.py and tests/engine/test_smollm2_engine.py.
@pytest.fixture(scope="session")
def smollm2_dir():
    """The converted SmolLM2 checkpoint (converted once into $SPECLOOP_CACHE)."""
    smol.require_smollm2()
    from specloop.models import ensure_model_cached  # noqa: PLC0415
    return ensure_model_cached("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    from specloop.models import load_model  # noqa: PLC0415
    return load_model(smollm2_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    return smol.load_hf(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_reference(smollm2, smollm2_hf):
    """transformers' greedy tokens for smol.PROMPTS, smol.NEW_TOKENS each."""
    return smol.hf_greedy(smollm2_hf, smollm2.tokenizer)
