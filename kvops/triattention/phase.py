"""Mean-phase coefficients of a scoring round: C_f and S_f for every due request.

C_f = mean over o in O of cos((p + o) w_f), S_f likewise with sin, O = {1, 2, 4, ..., 65536}, p the round
start. Positions reach 2^24 and beyond, where an fp32 angle has lost every digit of its phase, so the angle
and its cos/sin are computed in float64 (one tiny launch per round: R x 17 x F), then stored as fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks import check_device, check_float32
from .._dispatch import python_op, triton_launcher
from .reference import PHASE_OFFSETS, mean_phase_torch

_BLOCK_F = 64


@triton.jit
def _mean_phase_kernel(round_starts, omega, phase, F, NUM_OFFSETS: tl.constexpr, BLOCK_F: tl.constexpr):
    r = tl.program_id(0)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    live = f < F
    w = tl.load(omega + f, mask=live, other=0.0).to(tl.float64)
    p = tl.load(round_starts + r).to(tl.float64)
    c = tl.zeros([BLOCK_F], dtype=tl.float64)
    s = tl.zeros([BLOCK_F], dtype=tl.float64)
    o = 1.0
    for _ in tl.static_range(NUM_OFFSETS):
        angle = (p + o) * w
        c += tl.cos(angle)
        s += tl.sin(angle)
        o *= 2.0
    row = phase + r.to(tl.int64) * 2 * F
    tl.store(row + f, (c / NUM_OFFSETS).to(tl.float32), mask=live)
    tl.store(row + F + f, (s / NUM_OFFSETS).to(tl.float32), mask=live)


def _mean_phase_launch(round_starts: torch.Tensor, omega: torch.Tensor, phase: torch.Tensor) -> None:
    launch = triton_launcher(_mean_phase_kernel, round_starts.device)
    if launch is None:
        mean_phase_torch(round_starts, omega, phase)
        return
    F = omega.shape[0]
    launch[(round_starts.shape[0], triton.cdiv(F, _BLOCK_F))](round_starts, omega, phase, F,
                                                              NUM_OFFSETS=len(PHASE_OFFSETS), BLOCK_F=_BLOCK_F)


_mean_phase_op = python_op("triattention_mean_phase_", mutates_args={"phase"})(_mean_phase_launch)


def mean_phase(round_starts: torch.Tensor, omega: torch.Tensor, phase: torch.Tensor | None = None) -> torch.Tensor:
    """The mean phase of each request's round: the means over the offsets O of cos and sin of (p + o) omega_f.

    Parameters
    ----------
    round_starts : torch.Tensor
        int32 or int64 ``[R]``: each request's logical position p (>= 0).
    omega : torch.Tensor
        float32 ``[F]``: the RoPE inverse frequencies, on the same device.
    phase : torch.Tensor, optional
        A bound float32 ``[R, 2, F]`` buffer to write (no allocation, graph-capturable).

    Returns
    -------
    torch.Tensor
        float32 ``[R, 2, F]``: ``phase[:, 0]`` = C, ``phase[:, 1]`` = S.
    """
    what = "mean_phase"
    device = check_device(what, round_starts=round_starts, omega=omega)
    if round_starts.dtype not in (torch.int32, torch.int64) or round_starts.dim() != 1:
        raise ValueError(f"{what}: round_starts must be a 1-D int32 or int64 tensor, got {round_starts.dtype} "
                         f"{tuple(round_starts.shape)}")
    if omega.dtype != torch.float32 or omega.dim() != 1:
        raise ValueError(f"{what}: omega must be a 1-D float32 tensor, got {omega.dtype} {tuple(omega.shape)}")
    shape = (round_starts.shape[0], 2, omega.shape[0])
    if phase is None:
        phase = torch.empty(shape, dtype=torch.float32, device=device)
    else:
        check_float32(what, device, phase=(phase, shape))
    _mean_phase_op(round_starts, omega.contiguous(), phase)
    return phase
