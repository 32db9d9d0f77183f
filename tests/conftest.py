import logging

import pytest
import structlog
import torch


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
