"""TriAttentionCache under random churn (hypothesis): steps written as a model's forward writes them (the mask
calls, then every layer's mask and K/V), due rounds, offload and onboard of rows, and calls that must be refused,
with or without a layer split, checked after every operation against a shadow model of what the cache must
hold."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import BARE, bytes_of

transformers = pytest.importorskip("transformers")

from kvops.compaction import MODES, ORDERS  # noqa: E402
from kvops.compaction.compact import decision_row  # noqa: E402
from kvops.config import LayerSplit  # noqa: E402
from kvops.integrations.transformers import TriAttentionCache  # noqa: E402
from kvops.triattention import load_calibration  # noqa: E402

L, HQ, HKV, D = 2, 4, 2, 16
CONFIG = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=L,
                                  num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D)


def _calibration():
    F = D // 2
    q_mean = torch.complex(torch.randn(L, HQ, F), torch.randn(L, HQ, F))
    return load_calibration({"E_q": q_mean, "E_q_norm": q_mean.abs() + torch.rand(L, HQ, F)}, CONFIG.to_dict())


def _snapshot(cache) -> dict:
    """Every piece of state a call may change, the tensors as bytes."""
    clone = lambda t: None if t is None else bytes_of(t).clone()  # noqa: E731
    return dict(held=cache.held, evicted=cache.evicted, prompt=cache.prompt, logical=int(cache.get_seq_length()),
                rounds=cache.num_rounds, round_held=cache._round_held, offloaded=sorted(cache._offloaded),
                step=cache._step, local=(cache.local_held, cache.local_evicted, cache._local_round_held,
                                         cache.num_local_rounds),
                pools=None if cache.pools is None else [clone(p) for p in cache.pools],
                slots=clone(cache.slot_positions), host=clone(cache._host))


def _same(a: dict, b: dict) -> bool:
    def eq(x, y):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
            return isinstance(y, list) and len(x) == len(y) and all(map(eq, x, y))
        return x == y
    return all(eq(a[k], b[k]) for k in a)


class Group:
    """A group of layers that keep one count: the scored layers (every layer without a split), or a split's local
    layers, which keep their newest `budget` generated tokens."""

    def __init__(self, layers, budget, beta):
        self.layers, self.budget, self.beta = layers, budget, beta
        self.held = self.evicted = self.round_held = self.rounds = 0

    def due(self, prompt):
        return self.held - prompt > self.budget and self.held - self.round_held >= self.beta

    def after_round(self, prompt):
        return prompt + self.budget if self.due(prompt) else self.held


class Shadow:
    """What the cache must hold: each group's counters, the offloaded rows, and per (batch row, layer, KV head)
    the logical positions it holds, with every token's K/V by logical position (`kv`). A local layer's slots hold
    its positions in any order (a ring): `local_slots` records which slot holds which, as last seen."""

    def __init__(self, B, budget, beta, local=(), local_budget=0):
        self.B, self.beta = B, beta
        self.scored = Group([layer for layer in range(L) if layer not in local], budget, beta)
        self.local = Group(list(local), local_budget, beta)
        self.kv = torch.zeros(L, B, 2, HKV, 512, D, dtype=torch.bfloat16)
        self.fresh()

    def fresh(self):
        self.prompt = 0
        for g in self.groups:
            g.held = g.evicted = g.round_held = g.rounds = 0
        self.offloaded: set[int] = set()
        self.positions = None  # [B][L][HKV] -> set of logical positions
        self.local_slots = {}  # (b, layer, h) -> positions by slot

    @property
    def groups(self):
        return (self.scored, self.local) if self.local.layers else (self.scored,)

    def capacity(self, g):
        return self.prompt + g.budget + self.beta + 1

    def due(self):
        return any(g.due(self.prompt) for g in self.groups)

    def room(self):
        """The fewest free slots of any group once its due round has run."""
        return min(self.capacity(g) - g.after_round(self.prompt) for g in self.groups)

    def rounds_ran(self, cache):
        """The due rounds ran (before a step's first write, or when a static cache sized its masks)."""
        if self.local.due(self.prompt):
            self.keep_newest(cache)
        if self.scored.due(self.prompt):
            self.round(cache)

    def keep_newest(self, cache):
        """The local layers' round: each keeps the prompt and its newest local budget generated tokens."""
        g = self.local
        g.rounds += 1
        assert cache.num_local_rounds == g.rounds
        newest = set(range(g.held + g.evicted - g.budget, g.held + g.evicted))
        for b in range(self.B):
            for layer in g.layers:
                for h in range(HKV):
                    self.positions[b][layer][h] = set(range(self.prompt)) | newest
        g.evicted += g.held - (self.prompt + g.budget)
        g.held = g.round_held = self.prompt + g.budget

    def round(self, cache):
        """A due round ran: its kept positions (from the cache's record) must be `budget` distinct generated
        tokens the row held; the row then holds the prompt and them."""
        g = self.scored
        g.rounds += 1
        assert cache.num_rounds == g.rounds and len(cache.rounds) == 1
        t, kept = cache.rounds[-1]
        assert t == g.held + g.evicted
        rows = kept.shape[1]
        for b in range(self.B):
            for i, layer in enumerate(g.layers):
                for h in range(HKV):
                    k = kept[b, decision_row(rows, len(g.layers), HKV, i, h)].tolist()
                    held = self.positions[b][layer][h]
                    assert len(set(k)) == g.budget and set(k) <= held - set(range(self.prompt)), (k, held)
                    self.positions[b][layer][h] = set(range(self.prompt)) | set(k)
        g.evicted += g.held - (self.prompt + g.budget)
        g.held = g.round_held = self.prompt + g.budget

    def write(self, ks, vs):
        """A step's tokens, at the next logical positions, in every row."""
        q, logical = ks.shape[3], self.scored.held + self.scored.evicted
        if self.positions is None:
            self.prompt = q
            for g in self.groups:
                g.round_held = q
            self.positions = [[[set() for _ in range(HKV)] for _ in range(L)] for _ in range(self.B)]
        self.kv[:, :, 0, :, logical:logical + q] = ks
        self.kv[:, :, 1, :, logical:logical + q] = vs
        for rows in self.positions:
            for heads in rows:
                for s in heads:
                    s.update(range(logical, logical + q))
        for g in self.groups:
            g.held += q

    def slots(self, cache, b, layer, h):
        """The logical position each held slot of a layer holds."""
        if layer in self.local.layers:
            return self.local_slots[b, layer, h]
        g = self.scored
        row = decision_row(cache.selector.rows, len(g.layers), HKV, g.layers.index(layer), h)
        return cache.slot_positions[b, row, :g.held]

    def onboarded(self, cache, b):
        """Row b came back through NVFP4: close to what it held, and from now on what it holds."""
        for g in self.groups:
            for layer in g.layers:
                pool = cache.pools[layer]
                for h in range(HKV):
                    pos = self.slots(cache, b, layer, h)
                    got, want = pool[b, :, h, :g.held].float(), self.kv[layer, b, :, h, pos].float()
                    assert (got - want).norm() <= 0.2 * want.norm()
                    self.kv[layer, b, :, h, pos] = pool[b, :, h, :g.held]

    def check(self, cache):
        s, loc = self.scored, self.local
        assert (cache.held, cache.evicted, cache.prompt, cache._round_held) == (s.held, s.evicted, self.prompt,
                                                                                s.round_held)
        assert int(cache.get_seq_length()) == s.held + s.evicted and cache.num_rounds == s.rounds
        if loc.layers:
            assert (cache.local_held, cache.local_evicted, cache._local_round_held, cache.num_local_rounds) == \
                (loc.held, loc.evicted, loc.round_held, loc.rounds)
            assert loc.held + loc.evicted == s.held + s.evicted
        assert cache._offloaded == self.offloaded and cache._step is None
        assert (cache.pools is None) == (self.positions is None or len(self.offloaded) == self.B)
        if cache.pools is None:
            return
        for g in self.groups:
            for layer in g.layers:
                assert cache.pools[layer].shape == (self.B, 2, HKV, self.capacity(g), D)
        for b in range(self.B):
            if b in self.offloaded:
                continue
            for layer in loc.layers:  # a ring: find which position each slot holds (the K/V are random)
                for h in range(HKV):
                    want = sorted(self.positions[b][layer][h])
                    held = cache.pools[layer][b, :, h, :loc.held].transpose(0, 1).reshape(loc.held, 2 * D)
                    kv = self.kv[layer, b, :, h, want].transpose(0, 1).reshape(len(want), 2 * D)
                    match = (held[:, None] == kv[None]).all(-1)
                    assert len(want) == loc.held and (match.sum(1) == 1).all() and (match.sum(0) == 1).all()
                    self.local_slots[b, layer, h] = torch.tensor(want)[match.int().argmax(1)]
            for layer in s.layers:
                for h in range(HKV):
                    pos = self.slots(cache, b, layer, h)
                    assert sorted(pos.tolist()) == sorted(self.positions[b][layer][h])
                    assert torch.equal(cache.pools[layer][b, :, h, :s.held], self.kv[layer, b, :, h, pos])


# mostly steps (rounds come every few), each other operation about once in 20
OPS = st.lists(st.tuples(st.sampled_from(["step"] * 12 + ["offload", "onboard", "bad_row", "wrong_batch", "too_long",
                                                          "bad_layer", "stop", "extra_layer", "float32", "no_mask"]),
                         st.integers(0, 3), st.integers(1, 3)), min_size=15, max_size=45)
# no split, or one local layer (0 or 1) at its own count
SPLITS = st.one_of(st.none(), st.tuples(st.integers(0, L - 1), st.integers(1, 4)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, B=st.integers(1, 3), budget=st.integers(2, 5), beta=st.integers(1, 3), mode=st.sampled_from(MODES),
       order=st.sampled_from(ORDERS), static=st.booleans(), prompt=st.integers(1, 5), split=SPLITS)
def test_random_churn_matches_the_shadow_and_refusals_change_nothing(ops, B, budget, beta, mode, order, static,
                                                                    prompt, split):
    local = () if split is None else (split[0],)
    cache = TriAttentionCache(CONFIG, _calibration(), budget=budget, beta=beta, mode=mode, compaction_order=order,
                              static=static, layer_split=LayerSplit(local, split[1], budget) if split else False,
                              **BARE)  # the shadow scores every generated token
    shadow = Shadow(B, budget, beta, local, split[1] if split else 0)
    kv = lambda b, q, dtype=torch.bfloat16: torch.randn(L, b, HKV, q, D).to(dtype)  # noqa: E731
    width = 0  # the last mask's width

    def masks(q):
        """What a forward asks before its first layer; a static cache runs its due rounds there."""
        nonlocal width
        cache.get_query_offset()
        width = cache.get_mask_sizes(q)[0]
        if static and shadow.positions is not None:
            shadow.rounds_ran(cache)

    def write(layer, k, v):
        """One layer's write, after its mask (install_layer_masks' hook; a local layer's mask maps)."""
        q, loc = k.shape[2], shadow.local
        got = cache.layer_mask(layer, torch.rand(k.shape[0], 1, q, width) > 0.5)
        expect = width  # a local layer's mask covers its own slots
        if layer in local:
            expect = (shadow.prompt or q) + loc.budget + beta + 1 if static else loc.after_round(shadow.prompt) + q
        assert got.shape[-1] == expect
        return cache.update(k, v, layer)

    def refused(error, match, fn):
        before = _snapshot(cache)
        with pytest.raises(error, match=match):
            fn()
        assert _same(before, _snapshot(cache))

    def forward(ks, vs, layers=L):
        masks(ks.shape[3])
        for layer in range(layers):
            write(layer, ks[layer], vs[layer])

    def first_layer(started):
        """A step's masks and its layer 0 (due eager rounds run at that write); returns the step's K and V."""
        ks, vs = kv(B, q), kv(B, q)
        masks(q)
        due = started and not static
        write(0, ks[0], vs[0])
        if due:
            shadow.rounds_ran(cache)
        return ks, vs

    def full_step(started):
        """A whole step, written into the shadow; returns its K/V."""
        ks, vs = first_layer(started)
        for layer in range(1, L):
            write(layer, ks[layer], vs[layer])
        shadow.write(ks, vs)
        return ks, vs

    for op, a, n in ops:
        started = shadow.positions is not None
        q = (prompt if not started else n if n < 3 else 1)  # mostly one token past the prompt
        if op == "step":
            if shadow.offloaded:
                refused(RuntimeError, "offloaded", lambda: forward(kv(B, q), kv(B, q)))
            else:
                full_step(started)
        elif op in ("offload", "onboard"):
            row = a % (B + 1)  # B: out of range
            if not started:
                refused(ValueError, "no tokens", lambda: getattr(cache, op)(row))
            elif row == B:
                refused(ValueError, "row must be in", lambda: getattr(cache, op)(row))
            elif (row in shadow.offloaded) == (op == "offload"):
                refused(ValueError, "not", lambda: getattr(cache, op)(row))
            elif op == "offload":
                cache.offload(row)
                shadow.offloaded.add(row)
            else:
                cache.onboard(row)
                shadow.offloaded.discard(row)
                shadow.onboarded(cache, row)
        elif op == "bad_row":
            bad = [0.5, True, [0], {0: 1}, "0", None, 1.0][(a + n) % 7]
            refused(TypeError, "row must be an int", lambda: getattr(cache, ("offload", "onboard")[n % 2])(bad))
        elif op == "wrong_batch" and started and not shadow.offloaded:
            masks(q)  # accepted: sizes the masks (a static cache's due rounds)
            refused(ValueError, "batch size", lambda: write(0, kv(B + 1, q)[0], kv(B + 1, q)[0]))
        elif op == "too_long" and started:
            long = shadow.room() + n
            error, match = (RuntimeError, "offloaded") if shadow.offloaded else (ValueError, "do not fit")
            refused(error, match, lambda: forward(kv(B, long), kv(B, long)))
        elif op == "float32":
            if shadow.offloaded:
                refused(RuntimeError, "offloaded", lambda: forward(kv(B, q, torch.float32), kv(B, q, torch.float32)))
            else:
                masks(q)
                refused(TypeError, "bfloat16 or float16",
                        lambda: write(0, kv(B, q, torch.float32)[0], kv(B, q, torch.float32)[0]))
        elif op == "bad_layer" and not shadow.offloaded:
            # layer 1 of a step gets K/V of another shape: the step is void, a due round its layer 0 ran stays
            ks, vs = first_layer(started)
            with pytest.raises(ValueError, match="key_states"):
                write(1, ks[1, :, :1], vs[1])
        elif op == "no_mask" and local and not shadow.offloaded:
            # a local layer written without its own mask (no install_layer_masks): refused, the step void
            if local[0] == 0:
                masks(q)
                refused(RuntimeError, "install_layer_masks", lambda: cache.update(*kv(B, q)[:2], 0))
            else:
                ks, vs = first_layer(started)
                with pytest.raises(RuntimeError, match="install_layer_masks"):
                    cache.update(ks[1], vs[1], 1)
                if not started:  # the refused first step took its pools with it
                    shadow.fresh()
        elif op == "stop" and not shadow.offloaded:
            # a forward that stops after its first layer (it raised): the next call drops the step
            first_layer(started)
            if started:
                cache.get_query_offset()
            else:  # a first step stopped half-way may be a model with fewer layers: refused, the cache empty
                with pytest.raises(RuntimeError, match="1 of the cache's 2 layers"):
                    cache.get_query_offset()
                shadow.fresh()
        elif op == "extra_layer" and not shadow.offloaded:
            # a model with one layer more than the cache: refused there; after the first step the cache is empty
            ks, vs = full_step(started)
            if started:
                refused(ValueError, f"layer_idx {L} is out of range", lambda: cache.update(ks[0], vs[0], L))
            else:
                with pytest.raises(ValueError, match=f"layer_idx {L} is out of range"):
                    cache.update(ks[0], vs[0], L)
                shadow.fresh()
        shadow.check(cache)
