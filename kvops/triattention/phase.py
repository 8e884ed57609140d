"""Mean-phase coefficients of a scoring round: C_f and S_f for every due request (``kvops::triattention_mean_phase_``,
csrc/triattention: CUDA and CPU).

C_f = mean over o in O of cos((p + o) w_f), S_f likewise with sin, O = {1, 2, 4, ..., 65536}, p the round
start. Positions reach 2^24 and beyond, where an fp32 angle has lost every digit of its phase, so the angle
and its cos/sin are computed in float64 (one tiny launch per round: R x 17 x F), then stored as fp32.
"""

from __future__ import annotations

import torch

from .._checks import check_device, check_float32, check_no_meta_mix, check_nonnegative


@torch.library.register_fake("kvops::triattention_mean_phase_")
def _mean_phase_fake(round_starts, omega, phase):
    check_no_meta_mix("triattention_mean_phase_", round_starts, omega, phase)


def check_round_starts(what: str, round_starts: torch.Tensor, device: torch.device | None = None) -> torch.device:
    """round_starts int32 or int64 [R] on one real device (`device` when given), >= 0 when on the host
    (check_nonnegative); returns the device."""
    device = check_device(what, device, round_starts=round_starts)
    if round_starts.dtype not in (torch.int32, torch.int64) or round_starts.dim() != 1:
        raise ValueError(f"{what}: round_starts must be a 1-D int32 or int64 tensor, got {round_starts.dtype} "
                         f"{tuple(round_starts.shape)}")
    check_nonnegative(what, "round_starts", round_starts)
    return device


def mean_phase(round_starts: torch.Tensor, omega: torch.Tensor, phase: torch.Tensor | None = None) -> torch.Tensor:
    """The mean phase of each request's round: the means over the offsets O of cos and sin of (p + o) omega_f.

    Parameters
    ----------
    round_starts : torch.Tensor
        int32 or int64 ``[R]``: each request's logical position p (>= 0; checked when on the host).
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
    device = check_round_starts(what, round_starts)
    check_device(what, device, omega=omega)
    if omega.dtype != torch.float32 or omega.dim() != 1:
        raise ValueError(f"{what}: omega must be a 1-D float32 tensor, got {omega.dtype} {tuple(omega.shape)}")
    shape = (round_starts.shape[0], 2, omega.shape[0])
    if phase is None:
        phase = torch.empty(shape, dtype=torch.float32, device=device)
    else:
        check_float32(what, device, phase=(phase, shape))
    torch.ops.kvops.triattention_mean_phase_(round_starts.contiguous(), omega.contiguous(), phase)
    return phase
