import pytest
import torch

from specloop.samplers import Stream, rejection_sample, uniform

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("point_mass", [False, True])
def test_cuda_matches_cpu_bit_for_bit(method, point_mass):
    g = torch.Generator().manual_seed(0)
    B, K, V = 128, 4, 3000
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, -1)
    d = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K)
    seeds, pos = torch.arange(B) * 3 + 1, torch.arange(B) + 9
    assert torch.equal(uniform(seeds, pos, Stream.ACCEPT),
                       uniform(seeds.cuda(), pos.cuda(), Stream.ACCEPT).cpu())
    q = None if point_mass else q
    cpu = rejection_sample(d, p, q, seeds=seeds, positions=pos, method=method)
    gpu = rejection_sample(d.cuda(), p.cuda(), None if q is None else q.cuda(),
                           seeds=seeds.cuda(), positions=pos.cuda(), method=method)
    assert torch.equal(cpu.token_ids, gpu.token_ids.cpu())
