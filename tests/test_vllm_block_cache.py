"""kvops.integrations.vllm.block_cache without vLLM: TriAttention rounds on vLLM-layout block pages (the GPU
backends' zero-copy pool, the CPU backend's vec and amx packings, staged) against the same rounds on the reference
``PagedKVCache``, and ``physical_length`` against the manager's rule. tests/with_vllm/test_eviction.py runs it in
vLLM itself."""

import random

import pytest
import torch
import triton

from conftest import DEVICES
from kvops.cache import PagedKVCache
from kvops.config import TriAttentionConfig
from kvops.integrations.vllm.block_cache import BlockCache, physical_length
from kvops.integrations.vllm.layouts import BlockLayout
from kvops.manager import Request, create_compression_manager

L, H, N, D = 2, 2, 32, 32
MODEL = dict(num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=H, head_dim=D, rope_theta=1e4)


@pytest.fixture
def calibration(tmp_path):
    path = tmp_path / "cal.pt"
    torch.save({"E_q": torch.randn(L, 4, D // 2, dtype=torch.complex64), "E_q_norm": torch.rand(L, 4, D // 2) + 1},
               path)
    return str(path)


class Blocks:
    """An engine's side of a BlockCache: vLLM-layout pages of `blocks` blocks, each request's block list (taken
    from a shuffled free list as it grows, released when a round shrinks it), and token writes into them."""

    def __init__(self, layout: BlockLayout, blocks: int, device: str):
        self.layout = layout
        self.pages = [torch.randint(-100, 100, (blocks, layout.page_bytes), dtype=torch.int8, device=device)
                      for _ in range(L)]
        self.free = random.sample(range(blocks), blocks)
        self.table: dict = {}
        self.cache = BlockCache(self.pages, layout, lambda rid: self.table[rid], self.shrunk)

    def shrunk(self, rid, keep: int) -> None:
        self.free += self.table[rid][keep:]
        del self.table[rid][keep:]

    def block_view(self, layer: int, block: int) -> torch.Tensor:
        """[H, 2, N, D] of one block (a copy; ``write_block`` puts it back)."""
        lay = self.layout
        if lay.zero_copy:
            return lay.pool(self.pages[layer])[block].permute(0, 2, 1, 3).clone()
        out = torch.empty(lay.pool_shape(1), dtype=lay.dtype, device=self.pages[layer].device)
        lay.gather(lay.planes(self.pages[layer]), torch.tensor([block]), out)
        return out[0]

    def write_block(self, layer: int, block: int, data: torch.Tensor) -> None:
        lay = self.layout
        if lay.zero_copy:
            lay.pool(self.pages[layer])[block].copy_(data.permute(0, 2, 1, 3))
        else:
            lay.scatter(lay.planes(self.pages[layer]), torch.tensor([block]), data[None])

    def append(self, rid, k: torch.Tensor, v: torch.Tensor) -> None:
        """Tokens k, v [n, H, D] at the request's end, in every layer (as PagedKVCache.append writes them)."""
        table, start = self.table.setdefault(rid, []), self.cache.lengths.get(rid, 0)
        for i in range(k.shape[0]):
            pos = start + i
            if pos // N == len(table):
                table.append(self.free.pop())
            for layer in range(L):
                block = self.block_view(layer, table[pos // N])
                block[:, 0, pos % N], block[:, 1, pos % N] = k[i], v[i]
                self.write_block(layer, table[pos // N], block)
        self.cache.lengths[rid] = start + k.shape[0]

    def read(self, rid) -> torch.Tensor:
        """[L, 2, length, H, D], as PagedKVCache.read gives it."""
        n = self.cache.lengths[rid]
        layers = [torch.cat([self.block_view(layer, b) for b in self.table[rid]], dim=2)[:, :, :n]
                  for layer in range(L)]
        return torch.stack(layers).permute(0, 2, 3, 1, 4)


# vLLM's GPU layout on every device kvops runs on (on the GPU with the manager's CUDA-graph rounds); its CPU
# backend's packings on the CPU
CASES = [("gpu", None, d) for d in DEVICES] + [("cpu", "vec", "cpu"), ("cpu", "amx", "cpu")]


@pytest.mark.parametrize("backend,isa,device", CASES)
@pytest.mark.parametrize("mode", ["per_head", "per_layer_perhead"])
def test_rounds_on_vllm_blocks_equal_the_reference_cache(calibration, backend, isa, device, mode):
    """Three requests (prompts of 7, 40 and 33 tokens, one joining late, one confirming several tokens in some
    steps) run the same manager hooks on a PagedKVCache and on vLLM-layout blocks: after every step each request
    holds the same K and V, and the blocks a round frees go back to the engine. Blocks of requests no round
    covered are untouched."""
    config = TriAttentionConfig(budget=12, beta=5, eviction_mode=mode, calibration_path=calibration)
    ref = PagedKVCache(L, H, D, N, num_pages=64, device=device)
    blocks = Blocks(BlockLayout(backend, H, N, D, torch.bfloat16, isa), 64, device)
    managers = [create_compression_manager(config, c, MODEL) for c in (ref, blocks.cache)]
    prompts = {"a": 7, "b": 40, "c": 33}

    def admit(rid):
        ref.add_request(rid)
        k, v = (torch.randn(prompts[rid], H, D, device=device).bfloat16() for _ in range(2))
        ref.append(rid, k, v)
        blocks.append(rid, k, v)
        for m in managers:
            m.on_request_init(Request(rid, prompts[rid]))
            m.on_context_step_end([Request(rid, prompts[rid])])

    admit("a")
    admit("b")
    rounds = 0
    for step in range(45):
        if step == 11:
            admit("c")
        live = list(ref._requests)
        batch = [(r, 3 if r == "b" and step % 7 == 3 else 1) for r in live]
        for rid, n in batch:
            k, v = (torch.randn(n, H, D, device=device).bfloat16() for _ in range(2))
            ref.append(rid, k, v)
            blocks.append(rid, k, v)
        due = managers[1].due(batch)
        assert due == managers[0].due(batch)
        idle = {r: blocks.read(r) for r in live if r not in due}
        protected = [managers[1].prompt_length[r] + managers[1].policy.sink_tokens for r in due]
        if blocks.cache.stage(due, protected):
            managers[1].rebind()
        for m in managers:
            m.on_generation_step_end(batch)
        rounds += bool(due)
        for rid in live:
            assert blocks.cache.length(rid) == ref.length(rid)
            assert len(blocks.table[rid]) == triton.cdiv(ref.length(rid), N)
            assert torch.equal(blocks.read(rid), ref.read(rid)), (step, rid)
            if rid in idle:
                assert torch.equal(blocks.read(rid), idle[rid])
    assert rounds >= 6
    assert len(blocks.free) + sum(map(len, blocks.table.values())) == 64


def test_physical_length_is_the_managers_rule(calibration):
    """One token a step from every prompt length and (budget, beta) tried, the manager's cache length after each
    step's rounds is physical_length's."""
    for budget, beta in ((12, 5), (4, 9), (9, 9), (1, 1)):
        config = TriAttentionConfig(budget=budget, beta=beta, calibration_path=calibration,
                                    recent_window=0, sink_tokens=0)
        cache = PagedKVCache(L, H, D, 8, num_pages=64)
        manager = create_compression_manager(config, cache, MODEL)
        for prompt in (1, 8, 13):
            rid = (budget, beta, prompt)
            cache.add_request(rid)
            cache.append(rid, torch.randn(prompt, H, D), torch.randn(prompt, H, D))
            manager.on_request_init(Request(rid, prompt))
            manager.on_context_step_end([Request(rid, prompt)])
            for logical in range(prompt + 1, prompt + 3 * (budget + beta) + 5):
                cache.append(rid, torch.randn(1, H, D), torch.randn(1, H, D))
                manager.on_generation_step_end([(rid, 1)])
                assert cache.length(rid) == physical_length(prompt, logical, budget, beta), (rid, logical)
            manager.on_request_finish(Request(rid, prompt))
            cache.finish(rid)


def test_refused_stage_and_shrink_change_nothing():
    """A protected prefix past a request's length, or a round "leaving" more tokens than it holds: ValueError
    naming the request, lengths, block lists and pages as they were."""
    blocks = Blocks(BlockLayout("cpu", H, N, D, torch.bfloat16, "vec"), 16, "cpu")
    blocks.append("a", torch.randn(40, H, D).bfloat16(), torch.randn(40, H, D).bfloat16())
    before = ([p.clone() for p in blocks.pages], dict(blocks.cache.lengths), list(blocks.table["a"]))
    with pytest.raises(ValueError, match="'a' holds 40 tokens, 41 protected"):
        blocks.cache.stage(["a"], [41])
    with pytest.raises(ValueError, match="'a' holds 40 tokens, a round cannot leave it 41"):
        blocks.cache.shrink(["a"], [41])
    assert all(torch.equal(p, q) for p, q in zip(blocks.pages, before[0]))
    assert blocks.cache.lengths == before[1] and blocks.table["a"] == before[2]
