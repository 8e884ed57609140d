"""The cold-page codec interface: configure, sizes, batching ids, and encode/decode through it."""

import re

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


# issue 30: bad input, second pass

def test_configure_refuses_caller_errors_and_keeps_the_previous_configuration():
    codec, groups = LosslessColdPageCodec(), _groups("cpu")
    assert codec.configure(groups[:1])
    size = codec.cold_page_bytes(0)
    twice = [groups[0], LayerGroupPools(0, groups[2].pools, plane_dim=None)]  # the second would replace the first
    with pytest.raises(ValueError, match="layer group ids must be distinct, got \\[0, 0\\]"):
        codec.configure(twice)
    with pytest.raises(TypeError, match="pools\\[1\\] must be a tensor, got list"):
        LayerGroupPools(1, (groups[1].pools[0], [1.0]))
    with pytest.raises(TypeError, match="pools must be a non-empty list or tuple"):
        LayerGroupPools(1, groups[1].pools[0])
    with pytest.raises(TypeError, match="layer_group must be an int"):
        LayerGroupPools("1", groups[1].pools)
    with pytest.raises(TypeError, match="groups\\[1\\] must be a LayerGroupPools"):
        codec.configure([groups[1], groups[1].pools])
    with pytest.raises(TypeError, match="groups must be a list or tuple"):
        codec.configure(groups[1])
    nvfp4 = NVFP4ColdPageCodec(NVFP4ColdPageConfig(row_size=576))
    assert nvfp4.configure(groups[2:])
    mla_size = nvfp4.cold_page_bytes(2)
    assert not nvfp4.configure(groups[1:])  # 576-wide NVFP4 rows do not fit group 1's 64: refused whole
    assert nvfp4.configure_error.startswith("layer group 1")
    assert nvfp4.cold_page_bytes(2) == mla_size and nvfp4.batching_layer_group_id(2) == 2  # still the first plan
    with pytest.raises(ValueError, match="layer group 1 is not configured"):
        nvfp4.cold_page_bytes(1)
    assert codec.cold_page_bytes(0) == size and codec.batching_layer_group_id(0) == 0
    with pytest.raises(ValueError, match="layer group 1 is not configured"):
        codec.cold_page_bytes(1)
    with pytest.raises(TypeError, match="layer_group must be an int"):
        codec.cold_page_bytes([0])


def test_configure_checks_the_pools_as_every_call_will():
    """Pools no later call would take are refused by configure (False, the previous plan kept), and a pool in two
    groups is a caller error; an encode's destination may not lie in any configured group's pool."""
    codec, groups = LosslessColdPageCodec(), _groups("cpu")
    assert codec.configure(groups[:2])
    a = groups[0].pools[0]
    for pools, match in (((a, a), r"pools\[0\] and pools\[1\] share memory"),
                         ((a[:1].expand(6, -1, -1, -1, -1),), "share memory"),
                         ((a.to("meta"),), "meta"),
                         ((a.transpose(3, 4),), "")):  # rows not contiguous
        assert not codec.configure([LayerGroupPools(5, pools)])
        assert codec.configure_error.startswith("layer group 5") and re.search(match, codec.configure_error)
        assert codec.cold_page_bytes(1) > 0  # the previous plan stays
    with pytest.raises(ValueError, match="share memory"):
        codec.configure([groups[0], LayerGroupPools(3, groups[0].pools[1:])])
    assert codec.batching_layer_group_id(1) == 0
    size = codec.cold_page_bytes(0)
    g1 = groups[1].pools[0]
    saved = g1.clone()
    dst = g1.view(-1).view(torch.uint8)[:2 * size].view(2, size)  # group 1's pool as group 0's blobs
    with pytest.raises(ValueError, match="dst_base shares memory"):
        codec.encode(0, dst, torch.tensor([[0, 3]], dtype=torch.int32))
    assert torch.equal(g1, saved)


def test_decode_can_validate_the_slots():
    codec, groups = LosslessColdPageCodec(), _groups("cpu")
    assert codec.configure(groups)
    blob = torch.zeros(2, codec.cold_page_bytes(0), dtype=torch.uint8)
    codec.encode(0, blob, torch.tensor([[0, 3]], dtype=torch.int32))
    before = [p.clone() for p in groups[0].pools]
    pairs = torch.tensor([[4, 0], [5, 1]], dtype=torch.int32)  # slot 1 was never encoded
    with pytest.raises(ValueError, match=r"slot 1's section of pools\[0\] carries layout tag 0"):
        codec.decode(0, blob, pairs, validate=True)
    assert all(torch.equal(a, b) for a, b in zip(groups[0].pools, before))
    codec.decode(0, blob, pairs)  # unvalidated: slot 1's planes left as they were, and counted
    assert int(codec.refused(0)) == 4 and torch.equal(groups[0].pools[0][4], before[0][3])


def test_stream_and_config_types_are_checked():
    codec, groups = LosslessColdPageCodec(), _groups("cpu")
    assert codec.configure(groups)
    blob = torch.zeros(2, codec.cold_page_bytes(0), dtype=torch.uint8)
    pairs = torch.tensor([[0, 3]], dtype=torch.int32)
    for call in (codec.encode, codec.decode):  # torch.cuda.stream() ignores anything but a stream
        with pytest.raises(TypeError, match="stream must be None or a torch.cuda.Stream, got str"):
            call(0, blob, pairs, stream="side")
    assert not blob.any()
    with pytest.raises(TypeError, match="config must be an NVFP4ColdPageConfig, got dict"):
        NVFP4ColdPageCodec({"row_size": 64})
