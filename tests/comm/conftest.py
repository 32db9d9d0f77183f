import pytest

from specloop.comm import LocalGroup


@pytest.fixture(params=[2, 4], ids=["2ranks", "4ranks"])
def group(request) -> LocalGroup:
    # Short timeout: tests that wait for it stay fast; symmetric ones never hit it.
    return LocalGroup(request.param, timeout=0.3)
