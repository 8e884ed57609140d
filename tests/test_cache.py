"""PagedKVCache: accounting under random churn (hypothesis), round trips through the host tier, compaction,
and errors that leave the state unchanged."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEVICES
from kvops.cache import PagedKVCache
from kvops.compaction.reference import fill_order
from kvops.nvfp4 import PageBlobCodec, RowSpec

L, H, D, T = 2, 2, 32, 8


def _kv(n, device):
    return (torch.randn(n, H, D, device=device).bfloat16(), torch.randn(n, H, D, device=device).bfloat16())


def _expect_unchanged(cache, fn, match, error=(ValueError, TypeError)):
    state = (list(cache._free_pages), list(cache._free_slots),
             {r: (q.length, list(q.pages), q.slots and list(q.slots)) for r, q in cache._requests.items()})
    with pytest.raises(error, match=match):
        fn()
    after = (list(cache._free_pages), list(cache._free_slots),
             {r: (q.length, list(q.pages), q.slots and list(q.slots)) for r, q in cache._requests.items()})
    assert after == state


OPS = st.lists(st.tuples(st.sampled_from(["add", "append", "compress", "offload", "onboard", "finish",
                                          "shrink_twice", "shrink_bad", "compress_bad"]),
                         st.integers(0, 3), st.integers(1, 20)), min_size=1, max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, layout=st.sampled_from(["HND", "NHD"]))
def test_random_churn_keeps_accounting_and_contents(ops, layout):
    cache = PagedKVCache(L, H, D, T, num_pages=12, host_slots=10, layout=layout)
    shadow: dict[int, torch.Tensor] = {}  # rid -> [L, 2, length, H, D] expected contents
    for op, rid, n in ops:
        live = rid in shadow
        offloaded = live and cache._requests[rid].slots is not None
        try:
            if op == "add":
                cache.add_request(rid)
                shadow[rid] = torch.zeros(L, 2, 0, H, D, dtype=torch.bfloat16)
            elif op == "append":
                k, v = _kv(n, "cpu")
                cache.append(rid, k, v)
                new = torch.stack([k, v])[None].expand(L, -1, -1, -1, -1)
                shadow[rid] = torch.cat([shadow[rid], new], 2)
            elif op == "compress" and live and not offloaded and cache.length(rid) > n // 4 + 2:
                length = cache.length(rid)
                keep = max(1, min(n // 4 + 1, length - 2))
                tail = 1
                scored = length - tail
                kept = torch.randperm(scored)[:keep].sort().values.int().view(1, 1, keep)
                order_name = ("fill", "ordered")[n % 2]  # fill: the cache's default
                cache.compact([rid], kept, torch.tensor([scored], dtype=torch.int32),
                              torch.tensor([tail], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                              max_tail=tail, order=order_name)
                order = torch.cat([kept.view(-1).long(), torch.arange(scored, length)])
                if order_name == "fill":
                    order = torch.tensor(fill_order(order.tolist(), base=0))
                shadow[rid] = shadow[rid][:, :, order]
            elif op == "offload":
                cache.offload(rid)
            elif op == "onboard":
                cache.onboard(rid)
            elif op == "finish":
                cache.finish(rid)
                del shadow[rid]
            # inputs that must be refused with the state untouched
            elif op == "shrink_twice":
                cache.shrink([rid, rid], [n, n])
            elif op == "shrink_bad":
                cache.shrink([rid, (rid + 1) % 4], [n // 2, [float(n), -n, n + 10_000][n % 3]])
            elif op == "compress_bad" and live and not offloaded and cache.length(rid) > 3:
                length = cache.length(rid)  # scored + tail past the length: slots never written
                cache.compact([rid], torch.arange(2, dtype=torch.int32).view(1, 1, 2),
                              torch.tensor([length - 1 + n], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                              torch.tensor([0], dtype=torch.int32), max_tail=1)
        except (ValueError, TypeError):
            pass  # refused: unknown request, full pool or tier, wrong state; the state must be unchanged
        cache.check_invariants()
        for r, want in shadow.items():
            if cache._requests[r].slots is None:
                assert torch.equal(cache.read(r), want)


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_host_tier_round_trip_equals_codec_decode(device):
    specs = [RowSpec.full(D, plane_dim=1)] * L
    cache = PagedKVCache(L, H, D, T, num_pages=8, host_slots=8, device=device, codec_specs=specs)
    cache.add_request("r")
    cache.append("r", *_kv(29, device))
    pages = list(cache._requests["r"].pages)
    codec = PageBlobCodec(cache.pools, specs)
    blob = codec.allocate(len(pages), device=device)
    codec.encode(cache.pools, blob, torch.tensor([[i, p] for i, p in enumerate(pages)], dtype=torch.int32,
                                                  device=device))
    decoded = [torch.zeros_like(p) for p in cache.pools]
    codec.decode(blob, decoded, torch.tensor([[p, i] for i, p in enumerate(pages)], dtype=torch.int32,
                                             device=device))
    cache.offload("r")
    assert cache.num_free_pages == 8 and cache.num_free_slots == 8 - len(pages)
    cache.onboard("r")
    new_pages = cache._requests["r"].pages
    for got, want in zip(cache.pools, decoded):
        assert torch.equal(got[new_pages], want[pages])
    assert cache.codec.cold_page_bytes * 3 < cache.codec.hot_page_bytes  # NVFP4 (3.46x here: small pages)


def test_errors_leave_state_unchanged():
    cache = PagedKVCache(L, H, D, T, num_pages=4, host_slots=2)
    cache.add_request("a")
    cache.append("a", *_kv(20, "cpu"))  # 3 pages
    _expect_unchanged(cache, lambda: cache.append("zzz", *_kv(1, "cpu")), "unknown request")
    _expect_unchanged(cache, lambda: cache.append("a", *_kv(20, "cpu")), "more pages")
    _expect_unchanged(cache, lambda: cache.append("a", torch.zeros(1, H, D + 1), torch.zeros(1, H, D + 1)), "must both")
    _expect_unchanged(cache, lambda: cache.add_request("a"), "already exists")
    _expect_unchanged(cache, lambda: cache.offload("a"), "host slots needed")
    _expect_unchanged(cache, lambda: cache.onboard("a"), "not offloaded")
    cache.add_request("b")
    cache.append("b", *_kv(8, "cpu"))  # the last page
    cache.finish("a")
    cache.add_request("c")
    cache.append("c", *_kv(9, "cpu"))  # 2 pages
    cache.offload("b")
    _expect_unchanged(cache, lambda: cache.offload("b"), "already offloaded")
    _expect_unchanged(cache, lambda: cache.append("b", *_kv(1, "cpu")), "offloaded")
    cache.add_request("d")
    cache.append("d", *_kv(16, "cpu"))  # the 2 remaining pages: the pool is full
    _expect_unchanged(cache, lambda: cache.onboard("b"), "pages needed")
    cache.finish("c")
    _expect_unchanged(cache, lambda: cache.finish("c"), "unknown request")  # double free
    _expect_unchanged(cache, lambda: cache.shrink(["d"], [17]), "in \\[0, 16\\]")  # shrink cannot grow
    _expect_unchanged(cache, lambda: cache.shrink(["d"], [4, 4]), "2 new lengths for 1")
    with pytest.raises(ValueError, match="layout"):
        PagedKVCache(L, H, D, T, 4, layout="XYZ")
    with pytest.raises(ValueError, match="num_pages"):
        PagedKVCache(L, H, D, T, 0)
    cache.check_invariants()


def test_refused_calls_change_nothing():
    """The probes of the robustness pass: each is refused with the argument named, before any state changes."""
    cache = PagedKVCache(L, H, D, T, num_pages=8, host_slots=2)
    for rid, n in (("a", 20), ("b", 12)):
        cache.add_request(rid)
        cache.append(rid, *_kv(n, "cpu"))
    contents = {r: cache.read(r).clone() for r in "ab"}
    _expect_unchanged(cache, lambda: cache.shrink(["a", "a"], [12, 18]), "distinct")
    _expect_unchanged(cache, lambda: cache.shrink(["a", "b"], [10, 5.5]), "new_lengths\\[1\\] must be an int")
    _expect_unchanged(cache, lambda: cache.shrink(["a", "b"], [10, True]), "new_lengths\\[1\\]")
    meta = torch.empty(1, H, D, dtype=torch.bfloat16, device="meta")
    _expect_unchanged(cache, lambda: cache.append("a", meta, meta), "meta")
    _expect_unchanged(cache, lambda: cache.page_table(["a", "b"], width=1), "width must be >= 3")
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    kept = torch.arange(4, dtype=torch.int32).view(1, 1, 4) + 8
    _expect_unchanged(cache, lambda: cache.compact(["a"], kept, i32(22), i32(2), i32(8), max_tail=2),
                      "must equal the requests' lengths")  # 22 + 2 > 20: slots never written would be kept
    _expect_unchanged(cache, lambda: cache.compact(["a"], kept, i32(16), i32(2), i32(8), max_tail=2),
                      "must equal the requests' lengths")  # 18 < 20: tokens 18, 19 would be dropped
    _expect_unchanged(cache, lambda: cache.compact(["a", "a"], kept.expand(2, 1, 4), i32(18, 18), i32(2, 2),
                                                   i32(8, 8), max_tail=2), "distinct")
    # without validation too: b's lengths do not add up (12 + 5), and a's tokens must not move before that is seen
    _expect_unchanged(cache, lambda: cache.compact(["a", "b"], torch.cat([kept, kept - 4]), i32(18, 12), i32(2, 5),
                                                   i32(8, 4), max_tail=2, validate=False),
                      "must equal the requests' lengths")
    bf = lambda *shape, **kw: torch.randn(*shape, **kw).bfloat16()  # noqa: E731
    for k, v, error, match in ((bf(1, H, D).to_sparse(), bf(1, H, D).to_sparse(), ValueError, "dense"),
                               (torch.ones(1, H, D, dtype=torch.int64), torch.ones(1, H, D), TypeError, "floating"),
                               (torch.ones(1, H, D, dtype=torch.complex64), torch.ones(1, H, D, dtype=torch.complex64),
                                TypeError, "floating"),
                               (torch.ones(1, H, D), bf(1, H, D), TypeError, "of one dtype"),
                               (cache.pools[1][0, 0, :, :1].transpose(0, 1), bf(1, H, D), ValueError,
                                r"k shares memory with pools\[1\]")):  # read while the layers are written
        _expect_unchanged(cache, lambda: cache.append("b", k, v), match, error)
    with pytest.raises(ValueError, match="host_slots"):
        PagedKVCache(L, H, D, T, 4, host_slots=-1)
    with pytest.raises(TypeError, match="num_layers"):
        PagedKVCache(True, H, D, T, 4)
    cache.check_invariants()
    assert all(torch.equal(cache.read(r), contents[r]) for r in "ab")
    cache.compact(["a"], kept, i32(18), i32(2), i32(8), max_tail=2)  # the right call goes through
    assert cache.length("a") == 14 and torch.equal(cache.read("b"), contents["b"])


def test_check_invariants_catches_a_length_its_pages_cannot_hold():
    cache = PagedKVCache(L, H, D, T, num_pages=4)
    cache.add_request("a")
    cache.append("a", *_kv(12, "cpu"))
    cache.check_invariants()
    cache._requests["a"].length = 18  # 2 pages hold 16
    with pytest.raises(AssertionError, match="needs 3 pages, it holds 2"):
        cache.check_invariants()


# issue 30: bad input, second pass

def _state(cache):
    return (list(cache._free_pages), list(cache._free_slots),
            {r: (q.length, list(q.pages), q.slots and list(q.slots)) for r, q in cache._requests.items()},
            [p.view(torch.uint8).clone() for p in cache.pools], cache.host.clone())


def _same_state(a, b):
    return a[:3] == b[:3] and all(torch.equal(x, y) for x, y in zip(a[3], b[3])) and torch.equal(a[4], b[4])


@pytest.mark.parametrize("nvfp4", [False, True])
def test_onboard_refuses_a_corrupt_slot_with_nothing_changed(nvfp4):
    """A host slot never encoded (or overwritten) would leave its pages holding what they held before (another
    request's KV), counted only by the codec: onboard validates the slots' global scales first and raises, with
    pages, slots and pools as they were."""
    specs = [RowSpec.full(D, plane_dim=1)] * L if nvfp4 else None
    cache = PagedKVCache(L, H, D, T, num_pages=6, host_slots=6, codec_specs=specs)
    for rid, n in (("a", 20), ("b", 15)):
        cache.add_request(rid)
        cache.append(rid, *_kv(n, "cpu"))
    cache.offload("a")
    cache.finish("b")  # b's KV stays in the freed pages a would get
    slot = cache._requests["a"].slots[1]
    cache.host[slot, 4:16] = torch.randint(0, 256, (12,), dtype=torch.uint8)  # past the layout tag
    cache.host[slot, 4:8] = torch.tensor([-1.5]).view(torch.uint8)  # pools[0] plane 0's global scale: negative
    before = _state(cache)
    with pytest.raises(ValueError, match=f"onboard: request 'a': .*slot {slot} holds global scale"):
        cache.onboard("a")
    assert _same_state(before, _state(cache))
    cache.check_invariants()
    with pytest.raises(TypeError, match="validate must be a bool"):
        cache.onboard("a", validate=1)
    cache.onboard("a", validate=False)  # the engine's choice: no sync, the codec counts the refused planes
    assert int(cache.codec.refused("cpu")) >= 1
    cache.check_invariants()


def test_compact_over_no_requests_does_nothing():
    cache = PagedKVCache(L, H, D, T, num_pages=4)
    cache.add_request("a")
    cache.append("a", *_kv(9, "cpu"))
    before = _state(cache)
    empty = torch.zeros(0, dtype=torch.int32)
    out = cache.compact([], torch.zeros(0, 1, 4, dtype=torch.int32), empty, empty, empty, max_tail=0)
    assert out.dtype == torch.int32 and out.shape == (0,) and _same_state(before, _state(cache))


def test_constructor_and_call_arguments_name_the_rule():
    specs = [RowSpec.lossless(plane_dim=1)]
    cases = [
        (lambda: PagedKVCache(L, H, D, T, 4, dtype="bf16"), TypeError, "dtype must be a torch.dtype"),
        (lambda: PagedKVCache(L, H, D, T, 4, dtype=torch.int64), ValueError, "floating-point"),
        (lambda: PagedKVCache(L, H, D, T, 4, dtype=torch.float32), ValueError, "compaction moves"),
        (lambda: PagedKVCache(L, H, D, T, 4, device="gpu0"), ValueError, "device must be"),
        (lambda: PagedKVCache(L, H, D, T, 4, codec_specs=specs), ValueError, f"codec_specs must be a list of {L}"),
        (lambda: PagedKVCache(L, H, D, T, 4, codec_specs=[specs[0], 1]), TypeError, "codec_specs\\[1\\] must be"),
        (lambda: PagedKVCache(L, H, D, T, 4, codec_specs=[RowSpec.full(64)] * L), ValueError,
         "codec_specs do not fit the pools"),
    ]
    for make, exc, match in cases:
        with pytest.raises(exc, match=match):
            make()
    cache = PagedKVCache(L, H, D, T, num_pages=4)
    cache.add_request("a")
    cache.append("a", *_kv(9, "cpu"))
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    kept = torch.arange(2, dtype=torch.int32).view(1, 1, 2) + 4
    _expect_unchanged(cache, lambda: cache.page_table(["a"], device="gpu0"), "device must be")
    _expect_unchanged(cache, lambda: cache.shrink(["a"], 5), "new_lengths must be a list or tuple")
    _expect_unchanged(cache, lambda: cache.compact(["a"], kept, i32(9), i32(0), i32(4), max_tail=0, validate="no"),
                      "validate must be a bool")
    assert cache.page_table(["a"], device="cpu").tolist() == [cache._requests["a"].pages]
