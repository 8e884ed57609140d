"""Mean-phase coefficients against the float64 reference, on every path."""

import pytest
import torch

from conftest import DEVICES, opcheck, poison_, requires_cuda
from kvops.triattention.phase import mean_phase
from kvops.triattention.reference import mean_phase_reference, mean_phase_torch
from kvops.triattention.rope import rope_parameters

OMEGAS = {"qwen3": rope_parameters(dict(head_dim=128, rope_theta=1e6))[0],
          "yarn": rope_parameters(dict(head_dim=64, rope_theta=150000, rope_scaling={
              "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}))[0],
          "random": torch.rand(40) * 2}


def _starts(device, n=33):
    far = torch.randint(2 ** 23, 2 ** 24, (n // 3,))  # up to 2^24: an fp32 angle would be noise here
    return torch.cat([torch.tensor([0, 1, 2 ** 24 - 1]), torch.randint(0, 70000, (n - 3 - n // 3,)), far]).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(OMEGAS))
def test_matches_float64_reference(device, name):
    omega, p = OMEGAS[name].to(device), _starts(device)
    phase = poison_(torch.empty(p.shape[0], 2, omega.shape[0], device=device))
    mean_phase(p, omega, phase)
    C, S = mean_phase_reference(p, omega)
    assert (phase[:, 0].cpu().double() - C).abs().max() < 1e-5
    assert (phase[:, 1].cpu().double() - S).abs().max() < 1e-5
    assert torch.equal(mean_phase(p.int(), omega), phase)  # int32 starts, allocated output


@pytest.mark.parametrize("device", DEVICES)
def test_matches_the_batched_torch_path(device):
    """The op (csrc/triattention, CPU or CUDA) against reference.mean_phase_torch, int64 and int32 starts."""
    p, w = torch.randint(0, 2**24, (9,), device=device), torch.rand(40, device=device)
    b = torch.empty(9, 2, 40, device=device)
    mean_phase_torch(p, w, b)
    for starts in (p, p.int()):
        a = mean_phase(starts, w, poison_(torch.empty_like(b)))
        assert (a - b).abs().max() < 1e-6, (a - b).abs().max()


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_and_compile(device):
    p, omega = _starts(device, 8), OMEGAS["random"].to(device)
    phase = torch.empty(8, 2, omega.shape[0], device=device)
    opcheck(torch.ops.kvops.triattention_mean_phase_.default, (p, omega, phase))
    compiled = torch.compile(lambda p, w: mean_phase(p, w) * 2, fullgraph=True,
                             backend="aot_eager" if device == "cpu" else "inductor")
    assert torch.allclose(compiled(p, omega), mean_phase(p, omega) * 2)


@requires_cuda
def test_cuda_graph_replay_fresh_starts():
    omega = OMEGAS["qwen3"].cuda()
    p = _starts("cuda", 16)
    phase = torch.empty(16, 2, 64, device="cuda")
    mean_phase(p, omega, phase)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mean_phase(p, omega, phase)
    for _ in range(2):
        p.copy_(_starts("cuda", 16))
        graph.replay()
        C, _ = mean_phase_reference(p, omega)
        assert (phase[:, 0].cpu().double() - C).abs().max() < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments(device):
    p, omega = _starts(device, 4), OMEGAS["random"].to(device)
    with pytest.raises(ValueError, match="round_starts"):
        mean_phase(p.float(), omega)
    with pytest.raises(ValueError, match=r"round_starts\[1\] = -5; it must be >= 0"):  # host starts are read
        mean_phase(torch.tensor([3, -5]), omega.cpu())
    with pytest.raises(ValueError, match="omega"):
        mean_phase(p, omega.double())
    with pytest.raises(ValueError, match="phase must be"):
        mean_phase(p, omega, torch.empty(4, 2, 3, device=device))
    phase = torch.empty(4, 2, omega.shape[0], device=device)
    with pytest.raises(ValueError, match="phase shares memory with omega"):  # the op itself checks too
        torch.ops.kvops.triattention_mean_phase_(p, phase[0, 0], phase)
    with pytest.raises(ValueError, match="round_starts must be a contiguous 1-D"):
        torch.ops.kvops.triattention_mean_phase_(p.view(2, 2), omega, phase)
