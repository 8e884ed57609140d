"""The cold-page codec interface: configure, sizes, batching ids, and encode/decode through it."""

import torch

from conftest import DEVICES
import pytest
from kvops.codecs import LosslessColdPageCodec, NVFP4ColdPageCodec, LayerGroupPools
from kvops.config import NVFP4ColdPageConfig
from kvops.nvfp4 import PageBlobCodec, RowSpec


def _groups(device):
    hnd = [torch.randn(6, 2, 2, 8, 64, device=device).bfloat16() for _ in range(2)]
    hnd2 = [torch.randn(6, 2, 2, 8, 64, device=device).bfloat16() for _ in range(2)]
    mla = [torch.randn(6, 8, 576, device=device).bfloat16()]
    return [LayerGroupPools(0, tuple(hnd)), LayerGroupPools(1, tuple(hnd2)),
            LayerGroupPools(2, tuple(mla), plane_dim=None)]


@pytest.mark.parametrize("device", DEVICES)
def test_lossless_round_trip_and_batching(device):
    codec, groups = LosslessColdPageCodec(), _groups(device)
    assert codec.configure(groups)
    assert codec.batching_layer_group_id(0) == codec.batching_layer_group_id(1) == 0  # same layout
    assert codec.batching_layer_group_id(2) == 2
    assert codec.cold_page_bytes(0) >= 2 * 2 * 2 * 8 * 64 * 2
    assert codec.page_index_location(0) == ("device" if device == "cuda" else "host")
    blob = torch.zeros(4, codec.cold_page_bytes(0), dtype=torch.uint8, device=device)
    before = [p.clone() for p in groups[0].pools]
    pairs = torch.tensor([[0, 3], [1, 5]], dtype=torch.int32, device=device)
    codec.encode(0, blob, pairs)
    for p in groups[0].pools:
        p.zero_()
    codec.decode(0, blob, pairs.flip(1).contiguous())
    for got, want in zip(groups[0].pools, before):
        assert torch.equal(got[[3, 5]], want[[3, 5]]) and not got[0].any()
    with pytest.raises(ValueError, match="not configured"):
        codec.cold_page_bytes(9)


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_matches_the_codec_it_wraps(device):
    config = NVFP4ColdPageConfig(row_size=576, rope_range=(512, 64), skip_rope_quantization=True)
    groups = _groups(device)
    codec = NVFP4ColdPageCodec(config)
    assert not codec.configure(groups)  # a 64-wide HND row cannot take the 576-wide MLA spec: refused whole
    assert codec.configure_error.startswith("layer group 0") and "outside the row of 64" in codec.configure_error
    assert codec.configure(groups[2:]) and codec.configure_error is None
    direct = PageBlobCodec(groups[2].pools, [RowSpec((0, 512), plane_dim=None)])
    assert codec.cold_page_bytes(2) == direct.cold_page_bytes
    a = torch.zeros(2, direct.cold_page_bytes, dtype=torch.uint8, device=device)
    b = torch.zeros_like(a)
    pairs = torch.tensor([[0, 1], [1, 4]], dtype=torch.int32, device=device)
    codec.encode(2, a, pairs)
    direct.encode(groups[2].pools, b, pairs)
    assert torch.equal(a, b)
