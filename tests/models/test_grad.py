"""models/_grad: the grad-mode decorators enter torch's inference mode exactly as
``torch.inference_mode()`` does, through its guard."""

from __future__ import annotations

import pytest
import torch

from specloop.models import _grad
from specloop.models._grad import inference, inference_mode


@pytest.mark.parametrize("guard", [True, False])
def test_inference_mode_runs_the_body_in_inference_mode_and_restores_it(monkeypatch, guard):
    if not guard:      # a torch without the guard: the public decorator
        monkeypatch.setattr(_grad, "_GUARD", None)

    @inference_mode
    def body(fail: bool) -> tuple[bool, bool]:
        if fail:
            raise ValueError("raised inside")
        return torch.is_inference_mode_enabled(), torch.ones(2).is_inference()

    def steps():
        for _ in range(2):
            yield torch.is_inference_mode_enabled(), torch.ones(1).is_inference()

    assert body(False) == (True, True)
    assert not torch.is_inference_mode_enabled()
    with pytest.raises(ValueError, match="raised inside"):
        body(True)
    assert not torch.is_inference_mode_enabled()
    # A generator's body runs at each step, after the call returned: in the mode there too.
    gen = inference_mode(steps)()
    assert list(gen) == [(True, True)] * 2
    assert not torch.is_inference_mode_enabled()
    with inference():
        assert torch.is_inference_mode_enabled() and torch.zeros(1).is_inference()
        with torch.inference_mode(False):      # nested: torch's own switch still works
            assert not torch.zeros(1).is_inference()
    assert not torch.is_inference_mode_enabled()
    assert body.__name__ == "body"
