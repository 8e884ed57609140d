"""Compaction: pack + compact_layers_ against the gather/scatter reference, bit for bit."""

import dataclasses
import functools
import os

import pytest
import torch

from conftest import DEVICES, bytes_of, opcheck, poison_, refused, requires_cuda, run_python
from kvops.compaction import (SlotPositions, build_compaction_params, compact, compact_layers_, decision_row,
                              decision_rows, follow_slot_positions_, pack_move_sources, stream_rows)
from kvops.compaction.reference import pack_move_sources_torch, slot_positions_torch
from kvops.compaction.reference import compact_reference, fill_order, ring_order

LAYOUTS = ("hnd", "nhd", "vllm")


def _pools(layout, L, P, H, T, D, dtype, device):
    """Per-layer 5-D [page, plane, head, token, dim] views over the layout's own storage."""
    def one():
        if layout == "hnd":
            return poison_(torch.empty(P, 2, H, T, D, dtype=dtype, device=device))
        if layout == "nhd":  # FlashInfer [P, 2, T, H, D]
            return poison_(torch.empty(P, 2, T, H, D, dtype=dtype, device=device)).transpose(2, 3)
        return poison_(torch.empty(2, P, T, H, D, dtype=dtype, device=device)).permute(1, 0, 3, 2, 4)  # vLLM
    return [one() for _ in range(L)]


def _batch(R, T, K, rows, device, max_tail=5, canary_pages=3, keep_all=False, max_pages=None, total_pages=None):
    """Random requests on disjoint random pages (plus pages nobody owns), ascending random decisions."""
    base = torch.randint(0, 2 * T, (R,))
    extra = torch.zeros(R, dtype=torch.long) if keep_all else torch.randint(0, 3 * T, (R,))
    scored = base + K + extra
    tail = torch.randint(0, max_tail + 1, (R,))
    pages_per = ((scored + tail + T - 1) // T).tolist()
    max_pages = max_pages or max(pages_per) + 1
    P = total_pages or sum(pages_per) + canary_pages
    perm = torch.randperm(P)
    table = torch.full((R, max_pages), -1, dtype=torch.int32)
    at = 0
    for r, n in enumerate(pages_per):
        table[r, :n] = perm[at:at + n].int()
        at += n
    kept = torch.empty(R, rows, K, dtype=torch.int32)
    for r in range(R):
        for q in range(rows):
            span = int(scored[r] - base[r])
            kept[r, q] = (torch.randperm(span)[:K].sort().values + base[r]).int()
    to = dict(dtype=torch.int32, device=device)
    return (P, table.to(device), kept.to(device), scored.to(**to), tail.to(**to), base.to(**to))


def _defined_mask(table, new_lengths, P, T):
    """[P, T] bools: False where contents are unspecified (a request's slots at or past its new length)."""
    mask = torch.ones(P, T, dtype=torch.bool)
    table = table.cpu()
    for r, n in enumerate(new_lengths.tolist()):
        for c, page in enumerate(table[r].tolist()):
            if page >= 0:
                slots = torch.arange(T) + c * T
                mask[page] &= slots < n
    return mask


def _run_case(device, layout="hnd", dtype=torch.bfloat16, T=16, D=64, H=2, L=3, R=3, K=7, mode="union",
              windows=None, keep_all=False, max_tail=5, order="ordered"):
    rows = decision_rows(mode, L, H)
    P, table, kept, scored, tail, base = _batch(R, T, K, rows, device, max_tail=max_tail, keep_all=keep_all)
    pools = _pools(layout, L, P, H, T, D, dtype, device)
    expect, expect_len = compact_reference(pools, table, kept, scored, tail, base, windows, order)
    params = build_compaction_params(pools, table, kept, scored, tail, base, max_tail=max_tail,
                                     layer_windows=windows, order=order)
    new_lengths = compact(params, R, validate=True)
    assert torch.equal(new_lengths.cpu(), expect_len.cpu())
    mask = _defined_mask(table, new_lengths, P, T).to(device)
    for got, want in zip(pools, expect):
        got, want = got.view(torch.uint8), want
        sel = mask[:, None, None, :, None].expand_as(got)
        assert torch.equal(got[sel], want[sel])
    return pools, params


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["union", "per_head", "per_layer_perhead"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("order", ["ordered", "fill"])
def test_matches_reference_modes_layouts(device, mode, layout, order):
    _run_case(device, layout=layout, mode=mode, R=4, K=int(torch.randint(1, 40, ())), order=order)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("T,D", [(16, 64), (32, 128), (64, 576), (128, 128)])
@pytest.mark.parametrize("order", ["ordered", "fill"])
def test_matches_reference_dtypes_geometries(device, dtype, T, D, order):
    H = 1 if D == 576 else 2  # MLA: one latent head
    _run_case(device, dtype=dtype, T=T, D=D, H=H, L=2, R=3, K=int(torch.randint(T // 2, 3 * T, ())),
              mode="per_head", layout="nhd", order=order)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ["ordered", "fill"])
def test_windows_empty_and_keep_everything(device, order):
    _run_case(device, mode="per_layer_perhead", windows=[0, 6, 0], K=9, order=order)
    _run_case(device, mode="union", windows=[4, 4, 4], K=4, layout="vllm", order=order)
    _run_case(device, K=0, order=order)
    _run_case(device, K=0, max_tail=0, order=order)
    pools, params = _run_case(device, K=20, keep_all=True, mode="per_head", order=order)  # every scored token
    assert torch.equal(params.kept[:, :, 0], params.destination_bases[:, None].expand(-1, 2))


def test_fill_order_written_out():
    """The rule on a small case: 3 and 6 stay, the free slots 4 and 5 take 8 and 9, in order."""
    assert fill_order([3, 6, 8, 9], base=3) == [3, 8, 9, 6]
    assert fill_order([5, 6, 7], base=2) == [5, 6, 7]   # nothing below the new length: all move
    assert fill_order([2, 3], base=2) == [2, 3]         # all stay: nothing moves


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["union", "per_head", "per_layer_perhead"])
@pytest.mark.parametrize("layout", ["hnd", "nhd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_fill_moves_only_tokens_past_the_new_length_and_attention_is_unchanged(device, mode, layout, dtype):
    """Fill and ordered compactions hold the same token set per (layer, plane, head), so the attention output of
    a query over the compacted cache is the attention over the kept set (float32, up to summation order); fill
    moves at most the kept tokens that sat at or past the new length."""
    T, H, L, R, K, D = 16, 2, 2, 3, 24, 64
    rows = decision_rows(mode, L, H)
    P, table, kept, scored, tail, base = _batch(R, T, K, rows, device)
    source = _pools(layout, L, P, H, T, D, dtype, device)
    for p in source:
        p.copy_(torch.randn_like(p, dtype=torch.float32))
    query = torch.randn(D, device=device)
    out = {}
    for order in ("ordered", "fill"):
        pools = [p.clone() for p in source]
        params = build_compaction_params(pools, table, kept, scored, tail, base, max_tail=5, order=order)
        new_lengths = compact(params, validate=True)
        out[order] = (pools, new_lengths, params.sources.clone(), params.moves)
    for r in range(R):
        n, b = int(out["fill"][1][r]), int(base[r])
        pt = table[r].long()
        pos = torch.arange(b, n, device=device)
        for layer in range(L):
            for head in range(H):
                row = kept[r, decision_row(rows, L, H, layer, head)].long()
                kept_pos = torch.cat([row, torch.arange(int(scored[r]), int(scored[r] + tail[r]), device=device)])
                want_k = source[layer][pt[kept_pos // T], 0, head, kept_pos % T].float()
                want_v = source[layer][pt[kept_pos // T], 1, head, kept_pos % T].float()
                want = torch.softmax(want_k @ query, 0) @ want_v
                for order in ("ordered", "fill"):
                    pools = out[order][0]
                    k = pools[layer][pt[pos // T], 0, head, pos % T].float()
                    v = pools[layer][pt[pos // T], 1, head, pos % T].float()
                    torch.testing.assert_close(torch.softmax(k @ query, 0) @ v, want, rtol=1e-5, atol=1e-5)
                lists = out["fill"][2][r, decision_row(rows, L, H, layer, head), :n - b]
                moved = int((lists != pos).sum())
                assert moved == int((kept_pos >= n).sum())  # exactly the tokens that sat past the new length
                moves = out["fill"][3][r, decision_row(rows, L, H, layer, head)]  # what the kernel walks
                assert moves.tolist() == (lists != pos).nonzero()[:, 0].tolist() + [-1] * (moves.numel() - moved)


@pytest.mark.parametrize("device", DEVICES)
def test_the_walk_is_the_moves_list(device):
    """With moves, a stream walks only the listed indices: an empty walk moves nothing whatever the lists say,
    and a walk of one index moves that token alone."""
    pools, table, kept, scored, tail, base = _small(device, mode_rows=1, R=4)
    params = build_compaction_params(pools, table, kept, scored, tail, base, max_tail=5, order="fill")
    pack_move_sources(kept, scored, tail, base, params.sources, params.new_lengths, params.moves)
    for p in pools:
        p.copy_(torch.randn_like(p, dtype=torch.float32))
    before = [p.clone() for p in pools]
    walk = torch.full_like(params.moves, -1)
    compact_layers_(pools, table, params.sources, params.new_lengths, base, params.layer_row_base,
                    params.head_row_stride, walk)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(pools, before))
    r = int((params.moves[:, 0, 0] >= 0).nonzero()[0])  # a request with a token to move (all but surely one)
    m = int(params.moves[r, 0, 0])
    walk[r, 0, 0] = m
    compact_layers_(pools, table, params.sources, params.new_lengths, base, params.layer_row_base,
                    params.head_row_stride, walk)
    src, dst, T = int(params.sources[r, 0, m]), int(base[r]) + m, pools[0].shape[3]
    pt = table[r].long()
    for a, b in zip(pools, before):
        want = b.clone()
        want[pt[dst // T], :, :, dst % T] = b[pt[src // T], :, :, src % T]
        assert torch.equal(a.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_rebinding_rounds_reuse_buffers(device):
    """Two rounds through one params: the caller rewrites the bound rows, compact() rereads them."""
    T, H, L, R, K = 16, 2, 2, 3, 6
    geometry = dict(max_pages=8, total_pages=64)  # room for any batch _batch draws at this T and K
    P, table, kept, scored, tail, base = _batch(R, T, K, H, device, **geometry)
    pools = _pools("hnd", L, P, H, T, 64, torch.float16, device)
    params = build_compaction_params(pools, table, kept, scored, tail, base, max_tail=5)
    for _ in range(2):
        for buf, new in zip((table, kept, scored, tail, base), _batch(R, T, K, H, device, **geometry)[1:]):
            buf.copy_(new)
        for p in pools:
            poison_(p)
        expect, _ = compact_reference(pools, table, kept, scored, tail, base)
        n = compact(params, R)
        mask = _defined_mask(table, n, P, T).to(device)
        for got, want in zip(pools, expect):
            sel = mask[:, None, None, :, None].expand_as(want)
            assert torch.equal(got.view(torch.uint8)[sel], want[sel])


@pytest.mark.parametrize("device", DEVICES)
def test_canaries_below_base_and_unowned_pages(device):
    T, H, L, R, K = 16, 2, 2, 4, 10
    P, table, kept, scored, tail, base = _batch(R, T, K, 1, device, canary_pages=5)
    pools = _pools("hnd", L, P, H, T, 128, torch.bfloat16, device)
    before = [bytes_of(p).clone() for p in pools]
    params = build_compaction_params(pools, table, kept, scored, tail, base, max_tail=5)
    compact(params)
    owned = set(table[table >= 0].tolist())
    for got, old in zip(pools, before):
        got, old = got.view(torch.uint8).cpu(), old.view(P, 2, H, T, -1)
        for page in set(range(P)) - owned:
            assert torch.equal(got[page], old[page])
        for r in range(R):
            for pos in range(int(base[r])):
                page, slot = int(table[r, pos // T]), pos % T
                assert torch.equal(got[page, :, :, slot], old[page, :, :, slot])


@pytest.mark.parametrize("device", DEVICES)
def test_pack_lists(device):
    R, rows, K, max_tail = 3, 2, 5, 4
    kept = torch.randint(0, 100, (R, rows, K), dtype=torch.int32, device=device)
    scored = torch.tensor([40, 50, 60], dtype=torch.int32, device=device)
    tail = torch.tensor([0, 4, 2], dtype=torch.int32, device=device)
    base = torch.tensor([1, 2, 3], dtype=torch.int32, device=device)
    sources = torch.full((R, rows + 1, K + max_tail), 77, dtype=torch.int32, device=device)
    new_lengths = torch.full((R,), 77, dtype=torch.int32, device=device)
    pack_move_sources(kept, scored, tail, base, sources, new_lengths)
    for r in range(R):
        s, t = int(scored[r]), int(tail[r])
        tail_part = list(range(s, s + t)) + [-1] * (max_tail - t)
        for q in range(rows):
            assert sources[r, q].tolist() == kept[r, q].tolist() + tail_part
        assert sources[r, rows].tolist() == list(range(s - K, s)) + tail_part
    assert new_lengths.tolist() == (base + K + tail).tolist()


def test_pack_triton_interpreter_matches_torch():
    """The Triton kernel itself (ordered lists), run on the CPU by the interpreter, and the native fill lists,
    against the torch path."""
    code = (
        "import torch, kvops\n"
        "from kvops.compaction.pack import _pack_kernel, pack_move_sources\n"
        "from kvops.compaction.reference import pack_move_sources_torch\n"
        "kept = torch.randint(0, 999, (3, 4, 37), dtype=torch.int32)\n"
        "i = lambda *v: torch.tensor(v, dtype=torch.int32)\n"
        "args = (kept, i(900, 950, 990), i(0, 9, 3), i(5, 6, 7))\n"
        "a = torch.full((3, 5, 37 + 600), 7, dtype=torch.int32); b = a.clone()\n"
        "na, nb = i(0, 0, 0), i(1, 1, 1)\n"
        "pack_move_sources(*args, a, na)\n"
        "pack_move_sources_torch(*args, b, nb)\n"
        "assert torch.equal(a, b) and torch.equal(na, nb), 'triton and torch packs differ'\n"
        "args = (kept, i(900, 950, 990), i(0, 601, -2), i(5, 6, 7))  # tails the lists cannot hold\n"
        "pack_move_sources(*args, a, na)\n"
        "pack_move_sources_torch(*args, b, nb)\n"
        "assert torch.equal(a, b) and torch.equal(na, nb), 'triton and torch packs differ on refused tails'\n"
        "assert (a[1:] == -1).all() and na.tolist() == [5 + 37, 950 + 601, 990], na\n"
        "# a base above scored - K, and a length before the round past int32 (saturated)\n"
        "args = (kept, i(900, 950, 2**31 - 2), i(0, 9, 3), i(5, 2**31 - 40, 2**31 - 40))\n"
        "pack_move_sources(*args, a, na)\n"
        "pack_move_sources_torch(*args, b, nb)\n"
        "assert torch.equal(a, b) and torch.equal(na, nb), 'triton and torch packs differ on refused bases'\n"
        "assert (a[1:] == -1).all() and na.tolist() == [5 + 37, 950 + 9, 2**31 - 1], na\n"
        "# decisions that keep the contract: kept[m] >= base + m, below the scored length\n"
        "kept = torch.stack([torch.randperm(898)[:37].sort().values for _ in range(12)]).view(3, 4, 37).int() + 7\n"
        "args = (kept, i(905, 950, 990), i(0, 9, 3), i(5, 6, 7))\n"
        "ma, mb = torch.full_like(a, 7), torch.full_like(a, 8)\n"
        "pack_move_sources(*args, a, na, ma)\n"
        "pack_move_sources_torch(*args, b, nb, mb)\n"
        "assert torch.equal(a, b) and torch.equal(na, nb), 'triton and torch fill packs differ'\n"
        "assert torch.equal(ma, mb), 'triton and torch moves differ'\n"
        "assert not torch.equal(a[:, :4, :37], kept), 'fill lists equal the ordered ones'\n"
        "args = (kept, i(905, 950, 990), i(0, 601, 3), i(5, 6, 7))  # request 1 refused: no moves\n"
        "pack_move_sources(*args, a, na, ma)\n"
        "pack_move_sources_torch(*args, b, nb, mb)\n"
        "assert torch.equal(a, b) and torch.equal(ma, mb) and (ma[1] == -1).all(), 'refused fill packs differ'\n")
    run_python(code, TRITON_INTERPRET="1")


def test_stream_rows():
    assert stream_rows(1, 2, 3) == ((0, 0), (0, 0))
    assert stream_rows(3, 2, 3) == ((0, 0), (1, 1))
    assert stream_rows(6, 2, 3) == ((0, 3), (1, 1))
    assert stream_rows(6, 2, 3, [0, 64]) == ((0, 6), (1, 0))
    with pytest.raises(ValueError, match="rows per request"):
        stream_rows(4, 2, 3)


def _small(device, dtype=torch.bfloat16, mode_rows=1, windows=None, R=3, K=6):
    T, H, L = 16, 2, 3
    P, table, kept, scored, tail, base = _batch(R, T, K, mode_rows, device)
    pools = _pools("nhd", L, P, H, T, 64, dtype, device)
    return pools, table, kept, scored, tail, base


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_opcheck(device, dtype):
    pools, table, kept, scored, tail, base = _small(device, dtype, mode_rows=2)
    params = build_compaction_params(pools, table, kept, scored, tail, base, max_tail=5, layer_windows=[0, 3, 0])
    moves = torch.empty_like(params.sources)
    for m in (None, moves):
        opcheck(torch.ops.kvops.compaction_pack_move_sources_.default,
                (kept, scored, tail, base, params.sources, params.new_lengths, m))
        opcheck(torch.ops.kvops.compaction_compact_layers_.default,
                (params.pools, table, params.sources, params.new_lengths, base, list(params.layer_row_base),
                 list(params.head_row_stride), m))


def _fill_decisions(R, rows, K, tail, base, evicted, device):
    """Contract-keeping decisions: per row, K ascending positions of [base, base + K + evicted) (each row its own
    holes), scored lengths base + K + evicted."""
    scored = base + K + evicted
    kept = torch.stack([torch.randperm(K + int(evicted[r]))[:K].sort().values + int(base[r])
                        for r in range(R) for _ in range(rows)]).view(R, rows, K)
    return tuple(t.to(device=device, dtype=torch.int32) for t in (kept, scored, tail, base))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [False, True, "ring"])
@pytest.mark.parametrize("rows,K", [(7, 300), (900, 300), (900, 2100)])
def test_fill_lists_native_matches_torch(device, window, rows, K):
    """kvops::compaction_fill_lists_ against the torch rule: steady-state rows (few holes, each row its own), rows
    with every hole below the new length or none, a refused tail, a request whose kept tokens all sit past the
    new length; outputs poisoned first. On the GPU, 7 rows a request split each row across warps; 900 give each
    row one warp, which stages its kept entries in shared memory (K=300) or reads them where they are (K=2100,
    more than a warp stages)."""
    R, max_tail = 5, 40
    tail = torch.tensor([3, 40, 0, 41, 17])             # request 3 refused (tail > max_tail)
    base = torch.tensor([0, 9, 100, 5, 64])
    evicted = torch.tensor([32, 1, 0, 70, 400])         # request 2 evicts nothing
    kept, scored, tail, base = _fill_decisions(R, rows, K, tail, base, evicted, device)
    kept[4, 0] = torch.arange(K, device=device, dtype=torch.int32) + int(base[4]) + K + 17  # all past the new length
    shape = (R, rows + bool(window), K + max_tail)
    sources, moves = (poison_(torch.empty(shape, dtype=torch.int32, device=device)) for _ in range(2))
    new_lengths = poison_(torch.empty(R, dtype=torch.int32, device=device))
    # rings: one that wraps (request 0: 290 + 32 > 300), one that does not, offset 0, and one evicting its whole
    # ring and more (request 4: 400 > K=300)
    offsets = torch.tensor([K - 10, 7, K // 2, 0, 5], dtype=torch.int32, device=device) if window == "ring" else None
    torch.ops.kvops.compaction_fill_lists_(kept, scored, tail, base, sources, new_lengths, moves, offsets)
    want_sources, want_moves = torch.full(shape, 7, dtype=torch.int32), torch.full(shape, 7, dtype=torch.int32)
    want_lengths = torch.zeros(R, dtype=torch.int32)
    pack_move_sources_torch(*(t.cpu() for t in (kept, scored, tail, base)), want_sources, want_lengths, want_moves,
                            None if offsets is None else offsets.cpu())
    assert torch.equal(new_lengths.cpu(), want_lengths)
    assert torch.equal(sources.cpu(), want_sources)
    assert torch.equal(moves.cpu(), want_moves)
    assert (moves[1] >= 0).any() and (moves[3] == -1).all() and (moves[2, :rows] == -1).all()
    assert int((moves[4, 0] >= 0).sum()) == K + 17
    if window == "ring":  # only the evicted ring slots and the tail move: e + tail, at most K + tail
        for r in (0, 1, 4):
            e = int(scored[r] - base[r]) - K
            assert int((moves[r, rows] >= 0).sum()) == min(e, K) + int(tail[r])
            assert sources[r, rows, :K].tolist() == ring_order(int(scored[r]), int(base[r]), K, int(offsets[r]))
        assert (moves[2, rows] == -1).all()  # nothing evicted: nothing moves
    opcheck(torch.ops.kvops.compaction_fill_lists_.default, (kept, scored, tail, base, sources, new_lengths, moves,
                                                             offsets))


def test_ring_order_written_out():
    """A ring of K=4 above base 2: from offset 0, two evicted (positions 2 and 3), the newest two (6, 7) take their
    slots; from offset 2 the ring reads 4, 5, 2, 3 oldest first, three are evicted and 8 is the newest kept."""
    assert ring_order(scored=8, base=2, K=4, offset=0) == [6, 7, 4, 5]
    assert ring_order(scored=9, base=2, K=4, offset=2) == [8, 3, 6, 7]
    assert ring_order(scored=6, base=2, K=4, offset=3) == [2, 3, 4, 5]  # nothing evicted: nothing moves
    # more than the ring evicted (6): every slot takes one of the newest four, the ring turning to offset 3
    assert ring_order(scored=12, base=2, K=4, offset=1) == [9, 10, 11, 8]


@pytest.mark.parametrize("device", DEVICES)
def test_window_rings_keep_the_newest_tokens_over_rounds(device):
    """Rounds of a window layer kept as a ring, decode tokens appended between them, against the reference each
    round; the window layer then holds the newest K scored tokens, oldest first from its ring offset, then the tail
    in order. On the GPU the compaction is a CUDA graph replayed with each round's offsets and lengths."""
    T, H, L, R, K, D = 8, 2, 2, 3, 6, 8
    P, pages = R * 8, 8
    table = torch.randperm(P, dtype=torch.int32).view(R, pages).to(device)
    pools = _pools("vllm", L, P, H, T, D, torch.float16, device)
    for p in pools:
        p.normal_()
    base, tail = [0, 3, 9], [2, 0, 5]
    length = [b + K + extra for b, extra in zip(base, [4, 1, 7])]
    times = [list(range(n)) for n in length]  # each request's held tokens, oldest first: their logical positions

    def write(r, slot, position):  # element 0 of a row: its logical position (exact in float16)
        for p in pools:
            p[table[r, slot // T], :, :, slot % T, 0] = position

    for r in range(R):
        for slot in range(length[r]):
            write(r, slot, slot)
    to = dict(dtype=torch.int32, device=device)
    kept, scored_b, offsets_b = torch.zeros(R, 1, K, **to), torch.zeros(R, **to), torch.zeros(R, **to)
    tail_b, base_b = torch.tensor(tail, **to), torch.tensor(base, **to)
    params = build_compaction_params(pools, table, kept, scored_b, tail_b, base_b, max_tail=5, order="fill",
                                     layer_windows=[0, K], window_offsets=offsets_b)
    offset, graph, wrapped = [0] * R, None, False
    for round_ in range(8):
        scored = [n - t for n, t in zip(length, tail)]
        wrapped |= any(o + n - b > 2 * K for o, n, b in zip(offset, scored, base))  # the evicted slots wrap
        kept.copy_(torch.stack([torch.randperm(n - b)[:K].sort().values + b
                                for n, b in zip(scored, base)])[:, None].to(**to))
        scored_b.copy_(torch.tensor(scored, **to))
        offsets_b.copy_(torch.tensor(offset, **to))
        expect, expect_len = compact_reference(pools, table, kept, scored_b, tail_b, base_b, [0, K], "fill",
                                               offsets_b)
        if graph is not None:
            graph.replay()
        elif device == "cuda" and round_ == 1:  # round 0 eagerly, then capture once and replay
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                new_lengths = compact(params, R)
            graph.replay()
        else:
            new_lengths = compact(params, R, validate=True)
        assert torch.equal(new_lengths.cpu(), expect_len.cpu())
        mask = _defined_mask(table, new_lengths, P, T).to(device)
        for got, want in zip(pools, expect):
            sel = mask[:, None, None, :, None].expand_as(want)
            assert torch.equal(got.view(torch.uint8)[sel], want[sel])
        for r in range(R):
            b, n, t = base[r], scored[r], tail[r]
            offset[r] = (offset[r] + n - b - K) % K
            held = [int(pools[1][table[r, s // T], 0, 0, s % T, 0]) for s in range(b + K + t)]
            ring = held[b:b + K]
            assert held[:b] == times[r][:b]
            assert ring[offset[r]:] + ring[:offset[r]] == times[r][n - K:n]  # the newest K, oldest first
            assert held[b + K:] == times[r][n:n + t]                        # then the tail, in order
            times[r] = times[r][:b] + times[r][n - K:n + t]
            for _ in range(1 + (round_ + r) % 3):  # decode tokens until the next round: 1 to 3 past the ring
                write(r, len(times[r]), times[r][-1] + 1)
                times[r].append(times[r][-1] + 1)
            length[r] = len(times[r])
    assert wrapped


@pytest.mark.parametrize("device", DEVICES)
def test_fill_lists_bad_arguments(device):
    kept, scored, tail, base = _fill_decisions(2, 3, 8, torch.tensor([1, 2]), torch.tensor([0, 4]),
                                               torch.tensor([2, 3]), device)
    sources, moves = (torch.empty(2, 3, 12, dtype=torch.int32, device=device) for _ in range(2))
    new_lengths = torch.empty(2, dtype=torch.int32, device=device)
    fill = torch.ops.kvops.compaction_fill_lists_
    offsets = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="window_offsets needs the window row"):
        fill(kept, scored, tail, base, sources, new_lengths, moves, offsets)
    ringed = [torch.empty(2, 4, 12, dtype=torch.int32, device=device) for _ in range(2)]
    with pytest.raises(ValueError, match="window_offsets must be int32"):
        fill(kept, scored, tail, base, ringed[0], new_lengths, ringed[1], offsets.long())
    with pytest.raises(ValueError, match="window_offsets must be contiguous with one entry per request"):
        fill(kept, scored, tail, base, ringed[0], new_lengths, ringed[1], offsets[:1])
    with pytest.raises(ValueError, match="new_lengths overlaps window_offsets"):
        fill(kept, scored, tail, base, ringed[0], new_lengths, ringed[1], new_lengths)
    with pytest.raises(ValueError, match="window_offsets needs fill order"):
        pack_move_sources(kept, scored, tail, base, ringed[0], new_lengths, window_offsets=offsets)
    # an offset outside [0, K): that request is left as it is (lists of -1, its length before the round)
    offsets[1] = 8
    fill(kept, scored, tail, base, ringed[0], new_lengths, ringed[1], offsets)
    assert (ringed[0][1] == -1).all() and (ringed[1][1] == -1).all() and (ringed[1][0, 3] >= 0).any()
    assert new_lengths.tolist() == [int(base[0] + 8 + tail[0]), int(scored[1] + tail[1])]
    with pytest.raises(ValueError, match="sources overlaps moves"):
        fill(kept, scored, tail, base, sources, new_lengths, sources)
    with pytest.raises(ValueError, match="new_lengths overlaps scored_lengths"):
        fill(kept, scored, tail, base, sources, scored, moves)
    with pytest.raises(ValueError, match="sources must be contiguous"):
        fill(kept, scored, tail, base, sources[:, :, :10], new_lengths, moves[:, :, :10])
    with pytest.raises(ValueError, match="tail_lengths must be int32"):
        fill(kept, scored, tail.long(), base, sources, new_lengths, moves)
    with pytest.raises(ValueError, match="scored_lengths must be contiguous"):
        fill(kept, scored[:1], tail, base, sources, new_lengths, moves)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ["ordered", "fill", "ring"])
def test_compile_fullgraph(device, order):
    pools, table, kept, scored, tail, base = _small(device, mode_rows=2)
    ring = dict(layer_windows=[0, 6, 0], window_offsets=torch.tensor([0, 5, 2], dtype=torch.int32, device=device)) \
        if order == "ring" else {}
    order = "fill" if ring else order
    expect, expect_len = compact_reference(pools, table, kept, scored, tail, base, order=order, **ring)
    params = build_compaction_params(pools, table, kept, scored, tail, base, max_tail=5, order=order, **ring)

    def round_(params):
        return compact(params, 3) + 1

    compiled = torch.compile(round_, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    assert torch.equal(compiled(params).cpu(), expect_len.cpu() + 1)
    mask = _defined_mask(table, expect_len, pools[0].shape[0], 16).to(device)
    for got, want in zip(pools, expect):
        sel = mask[:, None, None, :, None].expand_as(want)
        assert torch.equal(got.view(torch.uint8)[sel], want[sel])


@requires_cuda
@pytest.mark.parametrize("order", ["ordered", "fill"])
def test_cuda_graph_replay_fresh_decisions(order):
    T, H, L, R, K = 32, 2, 3, 4, 12
    geometry = dict(max_pages=8, total_pages=40)
    P, table, kept, scored, tail, base = _batch(R, T, K, H, "cuda", **geometry)
    pools = _pools("hnd", L, P, H, T, 128, torch.bfloat16, "cuda")
    params = build_compaction_params(pools, table, kept, scored, tail, base, max_tail=5, order=order)
    compact(params, R)  # warm up (Triton compile) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compact(params, R)
    for _ in range(3):
        for buf, new in zip((table, kept, scored, tail, base), _batch(R, T, K, H, "cuda", **geometry)[1:]):
            buf.copy_(new)
        for p in pools:
            poison_(p)
        expect, expect_len = compact_reference(pools, table, kept, scored, tail, base, order=order)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), expect_len.cpu())
        mask = _defined_mask(table, out, P, T).cuda()
        for got, want in zip(pools, expect):
            sel = mask[:, None, None, :, None].expand_as(want)
            assert torch.equal(got.view(torch.uint8)[sel], want[sel])


@requires_cuda
def test_current_stream():
    pools, table, kept, scored, tail, base = _small("cuda")
    expect, _ = compact_reference(pools, table, kept, scored, tail, base)
    params = build_compaction_params(pools, table, kept, scored, tail, base, max_tail=5)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000)  # a late stream: work launched elsewhere would finish first
        n = compact(params)
    side.synchronize()
    mask = _defined_mask(table, n, pools[0].shape[0], 16).cuda()
    for got, want in zip(pools, expect):
        sel = mask[:, None, None, :, None].expand_as(want)
        assert torch.equal(got.view(torch.uint8)[sel], want[sel])


def _unchanged(pools, before):
    return all(torch.equal(bytes_of(p), b) for p, b in zip(pools, before))


@pytest.mark.parametrize("device", DEVICES)
def test_validate_rejects_bad_decisions_before_moving(device):
    pools, table, kept, scored, tail, base = _small(device, mode_rows=2, K=6)
    params = build_compaction_params(pools, table, kept, scored, tail, base, max_tail=5)
    before = [bytes_of(p).clone() for p in pools]
    good = [t.clone() for t in (table, kept, scored, tail, base)]

    def expect_error(match, mutate):
        for buf, g in zip((table, kept, scored, tail, base), good):
            buf.copy_(g)
        mutate()
        with pytest.raises(ValueError, match=match):
            compact(params, validate=True)
        assert _unchanged(pools, before)

    expect_error("not strictly ascending", lambda: kept[1, 1, 2:4].copy_(kept[1, 1, 2:4].flip(0)))
    expect_error("not strictly ascending", lambda: kept[0, 0, 3].copy_(kept[0, 0, 2]))
    expect_error("overtaken", lambda: kept[2, 0, 0].copy_(base[2] - 1))
    expect_error("overtaken", lambda: kept[2, 1].copy_(base[2] + torch.arange(6, device=device) - 1))
    expect_error("not a scored token", lambda: kept[0, 1, -1].copy_(scored[0]))
    expect_error("tail length", lambda: tail[1].fill_(6))
    expect_error("tail length", lambda: tail[1].fill_(-1))
    expect_error("fewer than K", lambda: scored[0].copy_(base[0] + 5))
    expect_error("exceeds the page table", lambda: scored[2].fill_(table.shape[1] * 16 + 1))
    expect_error("outside \\[0, ", lambda: table[0, (base[0] // 16).item()].fill_(10_000))
    expect_error("appears twice", lambda: table[1, (base[1] // 16).item()].copy_(table[0, (base[0] // 16).item()]))
    offsets = torch.zeros(3, dtype=torch.int32, device=device)
    ring = build_compaction_params(pools, table, kept[:, :1], scored, tail, base, max_tail=5, order="fill",
                                   layer_windows=[0, 6, 0], window_offsets=offsets)
    for bad in (6, -1):
        offsets[2] = bad
        with pytest.raises(ValueError, match="window offset outside \\[0, K=6\\)"):
            compact(ring, validate=True)
        assert _unchanged(pools, before)
    os.environ["KVOPS_DEBUG"] = "1"
    try:
        kept[0, 0, 3].copy_(kept[0, 0, 2])
        with pytest.raises(ValueError, match="ascending"):
            compact(params)
    finally:
        del os.environ["KVOPS_DEBUG"]


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_raise_before_anything_moves(device):
    pools, table, kept, scored, tail, base = _small(device, mode_rows=1)
    before = [bytes_of(p).clone() for p in pools]
    build = lambda **kw: build_compaction_params(**{**dict(pools=pools, page_table=table, kept=kept,  # noqa: E731
                                                          scored_lengths=scored, tail_lengths=tail,
                                                          destination_bases=base, max_tail=5), **kw})
    cases = [
        (dict(pools=[]), "pools"),
        (dict(pools=[p[0] for p in pools]), "5-D"),
        (dict(pools=[p.float() for p in pools]), "dtype"),
        (dict(pools=[p[..., :60] for p in pools]), "multiple of 16 bytes"),
        (dict(pools=[p[:, :, :, :, ::2] for p in pools]), "contiguous dim"),
        (dict(pools=[pools[0], pools[1][:-1], pools[2]]), "differs from pools\\[0\\]"),
        (dict(pools=[p[:, :1] for p in pools]), "plane"),
        (dict(page_table=table.long()), "page_table must be int32"),
        (dict(page_table=table[:, None]), "page_table must be 2-D"),
        (dict(page_table=table[:2]), "page_table has 2 rows"),
        (dict(page_table=table.t().contiguous().t()), "page_table columns"),
        (dict(kept=kept[:, :, None]), "kept must be 3-D"),
        (dict(kept=kept.float()), "kept must be int32"),
        (dict(kept=kept.expand(-1, 5, -1)), "rows per request"),
        (dict(scored_lengths=scored[:2]), "scored_lengths has 2"),
        (dict(tail_lengths=tail.long()), "tail_lengths must be int32"),
        (dict(destination_bases=base[None]), "destination_bases must be 1-D"),
        (dict(max_tail=-1), "max_tail"),
        (dict(max_tail=2.0), "max_tail"),
        (dict(layer_windows=[0, 1]), "one non-negative int per layer"),
        (dict(layer_windows=[0, 7, 0]), "exceeds the kept count"),
        (dict(order="shuffled"), "order must be one of"),
        (dict(window_offsets=base, order="fill"), "needs order=\"fill\" and a window layer"),
        (dict(window_offsets=base, layer_windows=[0, 3, 0]), "needs order=\"fill\" and a window layer"),
        (dict(window_offsets=base.long(), order="fill", layer_windows=[0, 3, 0]), "window_offsets must be int32"),
        (dict(window_offsets=base[:2], order="fill", layer_windows=[0, 3, 0]), "window_offsets has 2 rows"),
        (dict(window_offsets=pools[1][0, 0, 0, 0, :6].view(torch.int32), order="fill", layer_windows=[0, 3, 0]),
         "window_offsets"),
    ]
    if device == "cuda":
        cases.append((dict(page_table=table.cpu()), "page_table is on cpu"))
        cases.append((dict(pools=[pools[0], pools[1].cpu(), pools[2]]), "pools\\[1\\] is on cpu"))
    for kwargs, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            build(**kwargs)
    params = build()
    with pytest.raises(ValueError, match="request_count"):
        compact(params, 4)
    with pytest.raises(TypeError, match="request_count"):
        compact(params, 1.5)
    unaligned = [torch.empty(pools[0].numel() + 4, dtype=pools[0].dtype, device=device)[4:].view(pools[0].shape)
                 for _ in range(3)]
    with pytest.raises(ValueError, match="16-byte aligned"):
        build(pools=unaligned)
    with pytest.raises(ValueError, match="reads list rows"):
        torch.ops.kvops.compaction_compact_layers_(pools, table, params.sources, params.new_lengths, base, [0, 0, 1],
                                                   [0, 0, 0])
    with pytest.raises(ValueError, match="sources shape"):
        pack_move_sources(kept, scored, tail, base, params.sources[:, :, :3].contiguous(), params.new_lengths)
    with pytest.raises(ValueError, match="moves must be contiguous with the shape of sources"):
        pack_move_sources(kept, scored, tail, base, params.sources, params.new_lengths,
                          torch.empty_like(params.sources)[:, :, :2])
    with pytest.raises(ValueError, match="outputs"):  # moves aliasing sources
        pack_move_sources(kept, scored, tail, base, params.sources, params.new_lengths, params.sources)
    with pytest.raises(ValueError, match="moves must be contiguous with the shape of sources"):
        torch.ops.kvops.compaction_compact_layers_(pools, table, params.sources, params.new_lengths, base,
                                                   list(params.layer_row_base), list(params.head_row_stride),
                                                   params.sources[:, :, :2])
    with pytest.raises(ValueError, match="kept needs a contiguous last dim"):
        build(kept=torch.zeros(kept.shape[2], kept.shape[1], kept.shape[0], dtype=torch.int32,
                               device=device).transpose(0, 2))
    assert _unchanged(pools, before)


@requires_cuda
def test_more_layers_than_one_launch_holds():
    """513 layers: the CUDA backend splits the layer slots over two launches (and moves the window layer, the
    last, to the front of the first)."""
    T, H, L, R, K = 16, 1, 513, 2, 5
    P, table, kept, scored, tail, base = _batch(R, T, K, 1, "cuda")
    pools = _pools("hnd", L, P, H, T, 64, torch.bfloat16, "cuda")
    windows = [0] * (L - 1) + [3]  # the last layer reads the window row
    expect, _ = compact_reference(pools, table, kept, scored, tail, base, windows)
    n = compact(build_compaction_params(pools, table, kept, scored, tail, base, max_tail=5, layer_windows=windows))
    mask = _defined_mask(table, n, P, T).cuda()
    for got, want in zip(pools, expect):
        sel = mask[:, None, None, :, None].expand_as(want)
        assert torch.equal(got.view(torch.uint8)[sel], want[sel])


# ---- robustness: what a wrong table, tail or argument can and cannot do ------------------------------------

i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731


@pytest.mark.parametrize("device", DEVICES)
def test_validate_catches_a_page_shared_below_another_requests_base(device):
    """Request 1 holds request 0's prompt page (page 0) below its own base: validation refuses the batch."""
    pools = [poison_(torch.empty(16, 2, 2, 4, 16, dtype=torch.bfloat16, device=device)) for _ in range(2)]
    table = i32([[0, 1, 2, 3], [4, 0, 6, 7]]).to(device)
    kept = i32([[[4, 5, 6, 8, 9, 11]], [[7, 8, 9, 10, 11, 12]]]).to(device)
    params = build_compaction_params(pools, table, kept, i32([14, 13]).to(device), i32([2, 1]).to(device),
                                     i32([4, 5]).to(device), max_tail=2)
    before = [bytes_of(p).clone() for p in pools]
    with pytest.raises(ValueError, match="appears twice"):
        compact(params, 2, validate=True)
    assert _unchanged(pools, before)
    table[1, 1] = 5  # a page of its own: the same batch is accepted
    compact(params, 2, validate=True)


@pytest.mark.parametrize("device", DEVICES)
def test_tail_beyond_max_tail_leaves_the_request_as_it_was(device):
    """Without validation, a tail the lists cannot hold moves nothing of that request and returns its length
    before the round; the other requests compact as the reference says."""
    T = 16
    P, table, kept, scored, tail, base = _batch(3, T, 6, 1, device, max_tail=2)
    pools = _pools("hnd", 2, P, 2, T, 64, torch.bfloat16, device)
    params = build_compaction_params(pools, table, kept, scored, tail, base, max_tail=2)
    tail[1] = 3  # > max_tail; the page table holds it (one spare column)
    keep = [0, 2]
    expect, expect_len = compact_reference(pools, table[keep], kept[keep], scored[keep], tail[keep], base[keep])
    before = [bytes_of(p).clone() for p in pools]
    new_lengths = compact(params, 3)
    assert new_lengths.tolist() == [int(expect_len[0]), int(scored[1] + 3), int(expect_len[1])]
    mask = _defined_mask(table[keep], expect_len, P, T).to(device)
    pages1 = table[1][table[1] >= 0].long()
    for got, want, old in zip(pools, expect, before):
        got = got.view(torch.uint8)
        sel = mask[:, None, None, :, None].expand_as(got)
        assert torch.equal(got[sel], want[sel])
        assert torch.equal(got[pages1].cpu().reshape(-1), old.view(got.shape)[pages1.cpu()].reshape(-1))
    tail[1] = -1
    assert compact(params, 3)[1].item() == scored[1].item()


@pytest.mark.parametrize("device", DEVICES)
def test_aliased_or_meta_pools_are_refused(device):
    pools, table, kept, scored, tail, base = _small(device)
    args = (table, kept, scored, tail, base)
    before = [bytes_of(p).clone() for p in pools]
    with pytest.raises(ValueError, match="share memory"):
        build_compaction_params([pools[0], pools[1], pools[0]], *args, max_tail=5)
    with pytest.raises(ValueError, match="share memory"):  # overlapping views of one storage
        build_compaction_params([pools[0], pools[1], pools[1][1:]], *args, max_tail=5)
    meta = torch.empty(pools[0].shape, dtype=pools[0].dtype, device="meta")
    with pytest.raises(ValueError, match="meta"):
        build_compaction_params([pools[0], meta, pools[2]], *args, max_tail=5)
    with pytest.raises(ValueError, match="meta"):
        build_compaction_params(pools, table.to("meta"), *args[1:], max_tail=5)
    params = build_compaction_params(pools, *args, max_tail=5)
    with pytest.raises(ValueError, match="meta"):
        torch.ops.kvops.compaction_compact_layers_(pools, table, params.sources.to("meta"), params.new_lengths, base,
                                        [0] * 3, [0] * 3)
    with pytest.raises(TypeError, match="pools\\[1\\] must be a tensor"):
        build_compaction_params([pools[0], "pool", pools[2]], *args, max_tail=5)
    assert _unchanged(pools, before)

    # an index inside a pool the move writes would be overwritten by an earlier layer's move and steer the later ones
    def first_bytes(pool, like):  # a tensor like `like` over the first bytes of the pool's own memory
        raw = torch.empty(0, dtype=torch.uint8, device=pool.device)
        raw.set_(pool.untyped_storage(), pool.storage_offset() * pool.itemsize, (like.numel() * like.itemsize,))
        return raw.view(like.dtype).view(like.shape).copy_(like)

    inside, lengths = first_bytes(pools[1], table), first_bytes(pools[2], scored)
    before = [bytes_of(p).clone() for p in pools]
    with pytest.raises(ValueError, match=r"page_table shares memory with pools\[1\]"):
        build_compaction_params(pools, inside, *args[1:], max_tail=5)
    with pytest.raises(ValueError, match=r"page_table shares memory with pools\[1\]"):
        compact_layers_(pools, inside, params.sources, params.new_lengths, base, [0] * 3, [0] * 3)
    with pytest.raises(ValueError, match=r"scored_lengths shares memory with pools\[2\]"):
        build_compaction_params(pools, table, kept, lengths, tail, base, max_tail=5)
    assert _unchanged(pools, before)


@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_call_refuses_the_aliasing_an_eager_one_does(device):
    """The aliasing checks run in the op: a compiled compact_layers_ or compact (traced tensors have no
    addresses) refuses the same pool twice, two pools over the same memory, and a params whose pools were replaced
    after build_compaction_params, as the eager call does; nothing moves."""
    pools, table, kept, scored, tail, base = _small(device)
    params = build_compaction_params(pools, table, kept, scored, tail, base, max_tail=5)
    before = [bytes_of(p).clone() for p in pools]
    compiled = functools.partial(torch.compile, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    for bad, match in (([pools[0], pools[1], pools[0]], r"pools\[0\] and pools\[2\] share memory"),
                       ([pools[0], pools[1], pools[1][:]], r"pools\[1\] and pools\[2\] share memory")):
        for fn in (compact_layers_, torch.ops.kvops.compaction_compact_layers_):
            for call in (fn, compiled(fn)):  # a fresh compile per case: each traces its own aliasing
                with refused(ValueError, match):
                    call(bad, table, params.sources, params.new_lengths, base, [0] * 3, [0] * 3)
        swapped = dataclasses.replace(params, pools=bad)
        for call in (compact, compiled(lambda p: compact(p, 3))):
            with refused(ValueError, match):
                call(swapped)
    assert _unchanged(pools, before)
    compiled(lambda p: compact(p, 3))(params)  # the bound pools still move


def test_interleaved_layer_views_of_one_pool_are_not_aliases():
    """Layers as views of one [page, layer, plane, head, token, dim] allocation (TensorRT-LLM's pool) share a
    storage but no element: accepted, and compacted like separate pools."""
    T, L = 16, 3
    P, table, kept, scored, tail, base = _batch(3, T, 6, 1, "cpu")
    pool = poison_(torch.empty(P, L, 2, 2, T, 64, dtype=torch.bfloat16))
    views = [pool[:, layer] for layer in range(L)]
    expect, _ = compact_reference(views, table, kept, scored, tail, base)
    compact(build_compaction_params(views, table, kept, scored, tail, base, max_tail=5), validate=True)
    mask = _defined_mask(table, (base + 6 + tail), P, T)
    for got, want in zip(views, expect):
        sel = mask[:, None, None, :, None].expand_as(want)
        assert torch.equal(got.view(torch.uint8)[sel], want[sel])


# ---- issue 30: bad input, second pass ----------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_pools_with_internal_overlap_are_refused(device):
    """A stride-0 expanded pool (every page one memory) would be moved through its shared memory; torch refuses
    such in-place writes too. Refused at bind time and by compact_layers_, naming the pool, nothing moved."""
    pools, table, kept, scored, tail, base = _small(device)
    args = (table, kept, scored, tail, base)
    shape = pools[0].shape
    pages = [poison_(torch.empty(1, *shape[1:], dtype=pools[0].dtype, device=device)) for _ in pools]
    shared = [p.expand(shape) for p in pages]  # every layer its own memory, every page of a layer the same
    before = [bytes_of(p).clone() for p in pages]
    with pytest.raises(ValueError, match=r"compaction_compact_layers_: pools\[0\] has elements that share memory"):
        build_compaction_params(shared, *args, max_tail=5)
    params = build_compaction_params(pools, *args, max_tail=5)
    pack_move_sources(kept, scored, tail, base, params.sources, params.new_lengths)
    with pytest.raises(ValueError, match=r"compaction_compact_layers_: pools\[0\] has elements that share memory"):
        compact_layers_(shared, table, params.sources, params.new_lengths, base, params.layer_row_base,
                        params.head_row_stride)
    with pytest.raises(ValueError, match=r"compaction_compact_layers_: pools\[0\] has elements that share memory"):
        torch.ops.kvops.compaction_compact_layers_(shared, table, params.sources, params.new_lengths, base,
                                                   list(params.layer_row_base), list(params.head_row_stride))
    heads = [p[:, :, :1].expand(p.shape) for p in pools]  # stride 0 on the head dim
    with pytest.raises(ValueError, match=r"pools\[0\] has elements that share memory"):
        build_compaction_params(heads, *args, max_tail=5)
    assert _unchanged(pages, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ["ordered", "fill"])
def test_a_base_past_the_scored_tokens_leaves_the_request_as_it_was(device, order):
    """Without validation, a destination base outside [0, scored - K] (where base + K + tail could overflow
    int32 into a negative length) or a length scored + tail past int32 leaves its request as it is, like a bad
    tail: nothing of it moves and it gets its length before the round (saturated to int32)."""
    T, K = 16, 6
    P, table, kept, scored, tail, base = _batch(3, T, K, 1, device, max_tail=2)
    pools = _pools("hnd", 2, P, 2, T, 64, torch.bfloat16, device)
    params = build_compaction_params(pools, table, kept, scored, tail, base, max_tail=2, order=order)
    keep = [0, 2]
    expect, expect_len = compact_reference(pools, table[keep], kept[keep], scored[keep], tail[keep], base[keep],
                                           order=order)
    before = [p.clone() for p in pools]
    pages1 = table[1][table[1] >= 0].long()
    mask = _defined_mask(table[keep], expect_len, P, T).to(device)
    for bad_base in (2**31 - 3, -5, int(scored[1]) - K + 1):
        for p, b in zip(pools, before):
            p.copy_(b)
        base[1] = bad_base
        with pytest.raises(ValueError, match="request 1"):
            compact(params, 3, validate=True)
        new_lengths = compact(params, 3)
        assert new_lengths.tolist() == [int(expect_len[0]), int(scored[1] + tail[1]), int(expect_len[1])]
        assert (params.sources[1] == -1).all()
        for got, want, old in zip(pools, expect, before):
            sel = mask[:, None, None, :, None].expand_as(want)
            assert torch.equal(got.view(torch.uint8)[sel], want[sel])
            assert torch.equal(bytes_of(got[pages1]), bytes_of(old[pages1]))
    scored[1], base[1], tail[1] = 2**31 - 2, 2**31 - 2 - K, 2  # scored + tail does not fit int32
    assert compact(params, 3).tolist()[1] == 2**31 - 1


@pytest.mark.parametrize("device", DEVICES)
def test_pack_refuses_outputs_that_alias_its_inputs(device):
    """Ordered lists written over kept (or new lengths over the lengths) would read what they just wrote."""
    R, rows, K, max_tail = 2, 2, 5, 3
    kept = torch.randint(0, 50, (R, rows, K + max_tail), dtype=torch.int32, device=device).sort(-1).values
    scored, tail, base = (torch.tensor(v, dtype=torch.int32, device=device) for v in ([60, 70], [1, 3], [2, 4]))
    sources = torch.full((R, rows, K + max_tail), 7, dtype=torch.int32, device=device)
    new_lengths = torch.zeros(R, dtype=torch.int32, device=device)
    for order_moves in (None, torch.empty_like(sources)):
        saved = kept.clone()
        with pytest.raises(ValueError, match="pack_move_sources: sources shares memory with kept"):
            pack_move_sources(kept[:, :, :K], scored, tail, base, kept, new_lengths, order_moves)
        assert torch.equal(kept, saved)
        with pytest.raises(ValueError, match="pack_move_sources: new_lengths shares memory with tail_lengths"):
            pack_move_sources(kept[:, :, :K], scored, tail, base, sources, tail, order_moves)
        assert tail.tolist() == [1, 3]
    buf = torch.empty(sources.numel(), dtype=torch.int32, device=device)
    moves, buf_scored = buf.view(sources.shape), buf[:R]
    buf_scored.copy_(scored)
    with pytest.raises(ValueError, match="pack_move_sources: moves shares memory with scored_lengths"):
        pack_move_sources(kept[:, :, :K], buf_scored, tail, base, sources, new_lengths, moves)


def test_stream_rows_checks_its_arguments():
    with pytest.raises(ValueError, match=r"stream_rows: layer_windows needs one non-negative int per layer \(2\)"):
        stream_rows(1, 2, 3, [0])
    with pytest.raises(ValueError, match="layer_windows"):
        stream_rows(1, 2, 3, [0, 4, 8])
    with pytest.raises(ValueError, match="layer_windows"):
        stream_rows(1, 2, 3, [0, -1])
    with pytest.raises(TypeError, match="stream_rows: layers must be an int"):
        stream_rows(1, 2.0, 3)
    with pytest.raises(ValueError, match="stream_rows: heads must be >= 1"):
        stream_rows(1, 2, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_check_decisions_refuses_more_requests_than_bound(device):
    pools, table, kept, scored, tail, base = _small(device)
    params = build_compaction_params(pools, table, kept, scored, tail, base, max_tail=5)
    from kvops.compaction import check_decisions
    check_decisions(params, 3)
    with pytest.raises(ValueError, match=r"check_decisions: request_count must be in \[0, 3\], got 4"):
        check_decisions(params, 4)
    with pytest.raises(TypeError, match="check_decisions: request_count must be an int"):
        check_decisions(params, 2.0)
    with pytest.raises(TypeError, match="check_decisions: params must be a CompactionParams"):
        check_decisions(None, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_pools_with_an_empty_dim_are_refused(device):
    """No heads, no tokens per page or no head_dim: nothing could move (a page of no tokens holds no position),
    so a bind would silently do nothing. Refused, naming the dim."""
    pools, table, kept, scored, tail, base = _small(device)
    for k, name in ((2, "head"), (3, "token"), (4, "dim")):
        empty = [p.narrow(k, 0, 0) for p in pools]
        with pytest.raises(ValueError, match=rf"build_compaction_params: pools\[0\] .*: dim {k} \({name}\) is empty"):
            build_compaction_params(empty, table, kept, scored, tail, base, max_tail=5)
    with pytest.raises(ValueError, match="max_tail must be in"):
        build_compaction_params(pools, table, kept, scored, tail, base, max_tail=2**31 - kept.shape[2])
    with pytest.raises(ValueError, match="decision_row: head must be in"):
        decision_row(3, 2, 3, 0, 3)
    with pytest.raises(ValueError, match="compact_layers_: layer_row_base needs one int per layer"):
        compact_layers_(pools, table[:0], kept[:0], scored[:0], base[:0], [0], [0, 0, 0])


@pytest.mark.parametrize("device", DEVICES)
def test_argument_types_are_named(device):
    pools, table, kept, scored, tail, base = _small(device)
    params = build_compaction_params(pools, table, kept, scored, tail, base, max_tail=5)
    before = [bytes_of(p).clone() for p in pools]
    with pytest.raises(TypeError, match="compact: validate must be a bool"):
        compact(params, 3, validate="no")
    with pytest.raises(TypeError, match="compact: params must be a CompactionParams"):
        compact(None)
    assert _unchanged(pools, before)
    with pytest.raises(TypeError, match="decision_rows: layers must be an int"):
        decision_rows("union", "2", 2)
    with pytest.raises(TypeError, match="order must be a str"):
        build_compaction_params(pools, table, kept, scored, tail, base, max_tail=5, order=["fill"])
    with pytest.raises(ValueError, match="layer_windows needs one non-negative int per layer"):
        build_compaction_params(pools, table, kept, scored, tail, base, max_tail=5, layer_windows=[False, True, False])



def _witness(pool, table, r, h, positions):
    """The K element 0 of request r's head h at cache positions `positions` (the tests write logical positions
    there)."""
    T = pool.shape[3]
    pages = table[r].long().cpu()[positions // T]
    return pool[pages.to(pool.device), 0, h, (positions % T).to(pool.device), 0].float().cpu().long()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ["ordered", "fill"])
@pytest.mark.parametrize("mapped", [False, True])
def test_slot_positions_follow_the_tokens(device, order, mapped):
    """Each token's K carries its logical position, which the SlotPositions hold (the table's stored slots, the
    rest in order); after a compaction follow_slot_positions_ leaves in each slot what the compaction moved there.
    Seats out of order, a canary seat, poisoned slots past the new lengths."""
    H, T, K, R = 2, 16, 6, 3
    P, table, kept, scored, tail, base = _batch(R, T, K, H, device)   # per_head of one layer: row h is head h
    pool = poison_(torch.empty(P, 2, H, T, 64, dtype=torch.bfloat16, device=device))
    C, seats = K + 5, torch.tensor([2, 0, 3], dtype=torch.int32, device=device)
    positions = poison_(torch.empty(4, H, C, dtype=torch.int32, device=device))
    stored, bases = [], []
    for r in range(R):
        b, n = int(base[r]), int(scored[r] + tail[r])
        held = int(torch.randint(0, min(C, n - b) + 1, ()))
        first = int(torch.randint(0, 40, ()))
        stored.append(held)
        bases.append(first + b)
        for h in range(H):
            logical = torch.arange(n) + first            # the prompt, and the slots past the stored ones: in order
            logical[b:b + held] = torch.randperm(held) + first + b + 30  # the stored ones: out of order
            positions[int(seats[r]), h, :held] = logical[b:b + held].int().to(device)
            pages = table[r].long().cpu()[torch.arange(n) // T]
            pool[pages.to(device), 0, h, (torch.arange(n) % T).to(device), 0] = logical.bfloat16().to(device)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    rows = [1] if mapped else [0, 1]
    slots = SlotPositions(positions[:, rows].contiguous(), seats, i32(stored), i32(bases))
    canary = slots.table[1].clone()  # nobody's seat
    width = int((scored + tail - base).max())
    dense = slot_positions_torch(*slots, width)
    for r in range(R):  # the test's own layout, as the kernels read it
        n = int(scored[r] + tail[r] - base[r])
        for i, h in enumerate(rows):
            want = _witness(pool, table, r, h, torch.arange(n) + int(base[r]))
            assert torch.equal(dense[r, i, :n].cpu().long(), want)
    params = build_compaction_params([pool], table, kept, scored, tail, base, max_tail=5, order=order)
    new_lengths = compact(params, R)
    args = (params.sources, params.destination_bases, new_lengths, params.moves, i32(rows) if mapped else None)
    follow_slot_positions_(slots, *args)
    for r in range(R):
        n = int(new_lengths[r] - base[r])
        for i, h in enumerate(rows):
            want = _witness(pool, table, r, h, torch.arange(n) + int(base[r]))
            assert torch.equal(slots.table[int(seats[r]), i, :n].cpu().long(), want), (r, h)
    assert torch.equal(slots.table[1], canary)
    opcheck(torch.ops.kvops.compaction_follow_slot_positions_.default,
            (slots.table, seats, i32(stored), i32(bases), params.sources, params.moves, args[-1],
             params.destination_bases, new_lengths))


def test_slot_position_kernel_matches_torch_in_the_interpreter():
    """The Triton kernel (under TRITON_INTERPRET=1, on the CPU) against the torch path: in order, and in fill order
    through a real fill compaction's lists (moves)."""
    code = (
        "import torch\n"
        "from kvops.compaction import SlotPositions, build_compaction_params, follow_slot_positions_\n"
        "from kvops.compaction.reference import follow_slot_positions_torch\n"
        "i = lambda *v: torch.tensor(v, dtype=torch.int32)\n"
        "R, K, T = 3, 300, 16\n"
        "base, scored, tail = i(5, 0, 40), i(5 + K + 280, K + 7, 40 + K + 300), i(0, 9, 3)\n"
        "kept = torch.stack([torch.randperm(int(s - b))[:K].sort().values + b for b, s in zip(base, scored)]).int()\n"
        "pages = int((scored + tail).max()) // T + 1\n"
        "pools = [torch.zeros(R * pages, 2, 1, T, 8, dtype=torch.bfloat16)]\n"
        "table = torch.arange(R * pages, dtype=torch.int32).view(R, pages)\n"
        "for order in ('ordered', 'fill'):\n"
        "    p = build_compaction_params(pools, table, kept[:, None], scored, tail, base, max_tail=10, order=order)\n"
        "    from kvops.compaction.pack import pack_move_sources\n"
        "    pack_move_sources(kept[:, None], scored, tail, base, p.sources, p.new_lengths, p.moves)\n"
        "    for rows in (None, i(0)):\n"
        "        t = torch.randint(0, 10**6, (4, 1, K + 12), dtype=torch.int32)\n"
        "        seats, stored, bases = i(3, 0, 2), i(0, K + 9, 170), i(5, 900, 2**20)\n"
        "        a, b = t.clone(), t.clone()\n"
        "        follow_slot_positions_(SlotPositions(a, seats, stored, bases), p.sources, p.destination_bases,\n"
        "                               p.new_lengths, p.moves, rows)\n"
        "        follow_slot_positions_torch(b, seats, stored, bases, p.sources, rows, p.destination_bases,\n"
        "                                    p.new_lengths)\n"
        "        assert torch.equal(a, b), (order, rows)\n"
        "        # a seat outside the table's 4 (device seats go unchecked to the kernel): that row writes nothing\n"
        "        from kvops.compaction.positions import _follow_launch\n"
        "        a, b, out = t.clone(), t.clone(), i(-1, 0, 4)\n"
        "        _follow_launch(a, out, stored, bases, p.sources, p.moves, rows, p.destination_bases, p.new_lengths)\n"
        "        follow_slot_positions_torch(b, out, stored, bases, p.sources, rows, p.destination_bases,\n"
        "                                    p.new_lengths)\n"
        "        assert torch.equal(a, b) and torch.equal(a[1:], t[1:]), (order, rows)\n")
    run_python(code, TRITON_INTERPRET="1")


@pytest.mark.parametrize("device", DEVICES)
def test_slot_positions_compile_and_refuse_bad_arguments(device):
    """The op traces whole under torch.compile(fullgraph=True) and gives what it gives eagerly; bad arguments are
    refused, naming them, before anything is written."""
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    table = torch.randint(0, 999, (3, 2, 9), dtype=torch.int32, device=device)
    seats, stored, bases = i32(2, 0), i32(4, 0), i32(100, 200)
    sources = (torch.arange(9, device=device) + 3).int().expand(2, 3, 9).contiguous()  # in order: never below m
    dest, new = i32(1, 2), i32(8, 11)

    def follow(table):
        follow_slot_positions_(SlotPositions(table, seats, stored, bases), sources, dest, new, None, i32(2, 0))
        return table + 0

    compiled = torch.compile(follow, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    assert torch.equal(compiled(table.clone()), follow(table.clone()))
    before = table.clone()
    slots = SlotPositions(table, seats, stored, bases)
    for call, error, words in (
            (lambda: follow_slot_positions_(slots._replace(table=table.long()), sources, dest, new), ValueError,
             "table must be int32"),
            (lambda: follow_slot_positions_(slots._replace(seats=seats[:1]), sources, dest, new), ValueError,
             "seats, stored and bases"),
            (lambda: follow_slot_positions_(tuple(slots), sources, dest, new), TypeError, "SlotPositions"),
            (lambda: follow_slot_positions_(slots, sources[:1], dest, new), ValueError, r"seats, stored and bases \[1\]"),
            (lambda: follow_slot_positions_(slots, sources[:, :1], dest, new), ValueError, "sources"),
            (lambda: follow_slot_positions_(slots, sources, dest, new, sources[:, :2]), ValueError, "moves"),
            (lambda: follow_slot_positions_(slots, sources, dest, new, None, i32(0)), ValueError, "list_rows"),
            *(((lambda: follow_slot_positions_(slots, sources, dest, new, None, i32(0, 3)), ValueError,
                r"list_rows must lie in \[0, 3\)"),) if device == "cpu" else ()),  # a device one: read unchecked
            (lambda: follow_slot_positions_(slots, sources, dest, new, None, i32(0, 1).long()), ValueError,
             "list_rows must be int32"),
            (lambda: follow_slot_positions_(slots._replace(stored=table[0, 0, :2]), sources, dest, new),
             ValueError, "share"),
            *(((lambda: follow_slot_positions_(slots._replace(seats=i32(-1, 0)), sources, dest, new), ValueError,
                r"positions.seats\[0\] = -1 is outside the table's 3 seats"),
               (lambda: follow_slot_positions_(slots._replace(seats=i32(0, 3)), sources, dest, new), ValueError,
                r"positions.seats\[1\] = 3 is outside")) if device == "cpu" else ())):  # a device one: skipped
        with pytest.raises(error, match=words):
            call()
        assert torch.equal(table, before)
