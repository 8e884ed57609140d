"""Plain-torch statements of kvops.topk's semantics: the oracles the tests compare against, and the op's CPU path.

- ``sort_keys``: the one key rule every implementation ranks by (a float's bits as an order-preserving unsigned
  int: NaN lowest, -0.0 == +0.0). The CuTe kernel (radix_cute.py's ``_ukey``) and the native one
  (csrc/topk/topk.h's ``ukey``) each write it in their language; tests check each against this one.
- ``topk_torch``: the op in batched torch sorts over those keys (what ``kvops::topk_`` runs on the CPU).
- ``topk_reference``: the independent oracle (float64 values, Python sorts), which knows nothing of the keys.
"""

from __future__ import annotations

import torch

SIGN = 2**31  # the sign bit of a key, as an int


def sort_keys(scores: torch.Tensor) -> torch.Tensor:
    """The keys of float32 `scores`: int64 in [0, 2**32), larger for a larger float, NaN (any sign or payload)
    lowest at 0, -0.0 equal to +0.0. The bits are made order-preserving as signed ints (a negative float's
    magnitude bits flipped), then shifted by the sign bit to unsigned order."""
    bits = scores.view(torch.int32).long()                          # sign-extended: int32 arithmetic in int64
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)                        # signed order
    key = torch.where(key == -1, 0, key)                            # -0.0 ranks with +0.0
    key = torch.where((bits & 0x7FFFFFFF) > 0x7F800000, -SIGN, key)  # NaN lowest
    return key + SIGN


def topk_torch(scores: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor | None, k: int,
               out: torch.Tensor) -> None:
    """kvops::topk_ in torch sorts: writes into `out` int32 [rows, k], per row, the ascending indices (plus the
    row's offset) of the k largest keys of ``scores[row, :lengths[row]]``, lowest index first among equal keys;
    -1 pads a row shorter than k. Arguments as kvops.topk takes them."""
    rows, N = scores.shape
    keys = sort_keys(scores)
    col = torch.arange(N, device=scores.device)
    keys = torch.where(col[None] < lengths.clamp(0, N).long()[:, None], keys, -1)  # past the length: below all
    top = keys.sort(dim=1, descending=True, stable=True).indices[:, :k]              # stable: lowest index first
    picked = torch.where(keys.gather(1, top) >= 0, top, N)
    picked = torch.nn.functional.pad(picked, (0, k - picked.shape[1]), value=N).sort(dim=1).values  # k > N
    offset = 0 if offsets is None else offsets.view(-1, 1)
    out.copy_(torch.where(picked == N, -1, picked + offset).to(torch.int32))


def topk_reference(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """The independent reference (float64, Python sorts, CPU): int32 [rows, k]: per row, the ascending indices of
    the k largest of scores[row, :length]; ties go to the lowest index; NaN ranks below -inf; -1 fills a row
    shorter than k."""
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32)
    for row in range(scores.shape[0]):
        n = int(lengths[row])
        vals = scores[row, :n].double().cpu().nan_to_num(nan=-float("inf"))
        nan = torch.isnan(scores[row, :n].cpu())
        # lexicographic: value descending (NaN last), then index ascending
        order = sorted(range(n), key=lambda i: (bool(nan[i]), -float(vals[i]), i))[:k]
        out[row, :len(order)] = torch.tensor(sorted(order), dtype=torch.int32)
    return out
