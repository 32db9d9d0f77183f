"""VERIFY's logits in the model's dtype where only the default sampler's all-greedy strict
verification reads them (engine/_verify.py ``_logits``): the argmax of bf16 logits is the
argmax of their exact f32 widening, so keeping bf16 changes no token and saves the f32
copy of [B, K+1, V]; any other reader, and a model an embedder hands in (the documented
``logits(hidden)``), gets f32."""

import torch

from specloop.engine._runner import ModelRunner
from specloop.engine._verify import _logits
from specloop.models import load_model
from specloop.samplers import SamplingBatch, SamplingParams
from specloop.samplers._sampler import strict_verify


def test_kept_dtype_logits_widen_to_the_f32_ones(tiny_dir):
    model = load_model(tiny_dir, dtype=torch.bfloat16).model
    hidden = torch.randn(2, 3, model.args.hidden_size).bfloat16()
    kept = model.logits(hidden, keep_dtype=True)
    assert kept.dtype == torch.bfloat16
    assert torch.equal(kept.float(), model.logits(hidden))
    assert model.logits(hidden).dtype == torch.float32


def test_strict_greedy_verify_of_bf16_equals_f32_ties_included():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, 500, generator=gen).bfloat16()
    logits[:3, :, 7] = logits[:3, :, 400] = logits[:3].amax(-1) + 1     # ties: the first
    drafts = logits[:, :3].float().argmax(-1)
    drafts[::2, 1] = 0                                                   # misses too
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.0)] * 6, list(range(6)))
    positions = torch.arange(6) + 10
    a = strict_verify(drafts, logits, batch, positions)
    b = strict_verify(drafts, logits.float(), batch, positions)
    assert torch.equal(a.token_ids, b.token_ids)
    assert torch.equal(a.num_accepted, b.num_accepted)
    assert (a.token_ids[:3, 0] == 7).all()


def test_an_embedders_model_gets_the_documented_call(tiny_dir):
    class Wrapped(torch.nn.Module):     # logits(hidden) only, as docs/internal-api.md says
        def __init__(self, inner):
            super().__init__()
            self.inner, self.args = inner, inner.args

        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

        def logits(self, hidden):
            return self.inner.logits(hidden)

    loaded = load_model(tiny_dir, dtype=torch.bfloat16)
    runner = ModelRunner(loaded, num_slots=2, max_seq_len=32, max_prefill_tokens=32)
    hidden = torch.randn(1, 2, loaded.args.hidden_size).bfloat16()
    assert _logits(runner, hidden, True).dtype == torch.bfloat16
    runner.model = Wrapped(runner.model)
    assert _logits(runner, hidden, True).dtype == torch.float32
