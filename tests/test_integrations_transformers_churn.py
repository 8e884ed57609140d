"""TriAttentionCache under random churn (hypothesis): steps written as a model's forward writes them (the mask
calls, then every layer's K/V), due rounds, offload and onboard of rows, and calls that must be refused, checked
after every operation against a shadow model of what the cache must hold."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import BARE, bytes_of

transformers = pytest.importorskip("transformers")

from kvops.compaction import MODES, ORDERS  # noqa: E402
from kvops.compaction.compact import decision_row  # noqa: E402
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
                step=cache._step,
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


class Shadow:
    """What the cache must hold: counters, the offloaded rows, and per (batch row, layer, KV head) the logical
    positions it holds, with every token's K/V by logical position (`kv`)."""

    def __init__(self, B, budget, beta, mode, capacity_extra):
        self.B, self.budget, self.beta, self.mode, self.extra = B, budget, beta, mode, capacity_extra
        self.kv = torch.zeros(L, B, 2, HKV, 512, D, dtype=torch.bfloat16)
        self.fresh()

    def fresh(self):
        self.held = self.evicted = self.prompt = self.round_held = self.rounds = 0
        self.offloaded: set[int] = set()
        self.positions = None  # [B][L][HKV] -> set of logical positions

    @property
    def capacity(self):
        return self.prompt + self.extra

    def due(self):
        return self.held - self.prompt > self.budget and self.held - self.round_held >= self.beta

    def after_round(self):
        return self.prompt + self.budget if self.due() else self.held

    def round(self, cache):
        """A due round ran: its kept positions (from the cache's record) must be `budget` distinct generated
        tokens the row held; the row then holds the prompt and them."""
        self.rounds += 1
        assert cache.num_rounds == self.rounds and len(cache.rounds) == 1
        t, kept = cache.rounds[-1]
        assert t == self.held + self.evicted
        rows = kept.shape[1]
        for b in range(self.B):
            for layer in range(L):
                for h in range(HKV):
                    k = kept[b, decision_row(rows, L, HKV, layer, h)].tolist()
                    held = self.positions[b][layer][h]
                    assert len(set(k)) == self.budget and set(k) <= held - set(range(self.prompt)), (k, held)
                    self.positions[b][layer][h] = set(range(self.prompt)) | set(k)
        self.evicted += self.held - (self.prompt + self.budget)
        self.held = self.round_held = self.prompt + self.budget

    def write(self, ks, vs):
        """A step's tokens, at the next logical positions, in every row."""
        q, logical = ks.shape[3], self.held + self.evicted
        if self.positions is None:
            self.prompt = self.round_held = q
            self.positions = [[[set() for _ in range(HKV)] for _ in range(L)] for _ in range(self.B)]
        self.kv[:, :, 0, :, logical:logical + q] = ks
        self.kv[:, :, 1, :, logical:logical + q] = vs
        for rows in self.positions:
            for heads in rows:
                for s in heads:
                    s.update(range(logical, logical + q))
        self.held += q

    def onboarded(self, cache, b):
        """Row b came back through NVFP4: close to what it held, and from now on what it holds."""
        for layer, pool in enumerate(cache.pools):
            for h in range(HKV):
                pos = cache.slot_positions[b, decision_row(cache.selector.rows, L, HKV, layer, h), :self.held]
                got, want = pool[b, :, h, :self.held].float(), self.kv[layer, b, :, h, pos].float()
                assert (got - want).norm() <= 0.2 * want.norm()
                self.kv[layer, b, :, h, pos] = pool[b, :, h, :self.held]

    def check(self, cache):
        assert (cache.held, cache.evicted, cache.prompt, cache._round_held) == \
            (self.held, self.evicted, self.prompt, self.round_held)
        assert int(cache.get_seq_length()) == self.held + self.evicted and cache.num_rounds == self.rounds
        assert cache._offloaded == self.offloaded and cache._step is None
        assert (cache.pools is None) == (self.positions is None or len(self.offloaded) == self.B)
        if cache.pools is None:
            return
        assert cache.pools[0].shape == (self.B, 2, HKV, self.capacity, D)
        rows = cache.selector.rows
        for b in range(self.B):
            if b in self.offloaded:
                continue
            for layer, pool in enumerate(cache.pools):
                for h in range(HKV):
                    pos = cache.slot_positions[b, decision_row(rows, L, HKV, layer, h), :self.held]
                    assert sorted(pos.tolist()) == sorted(self.positions[b][layer][h])
                    assert torch.equal(pool[b, :, h, :self.held], self.kv[layer, b, :, h, pos])


# mostly steps (rounds come every few), each other operation about once in 20
OPS = st.lists(st.tuples(st.sampled_from(["step"] * 12 + ["offload", "onboard", "bad_row", "wrong_batch", "too_long",
                                                          "bad_layer", "stop", "extra_layer", "float32"]),
                         st.integers(0, 3), st.integers(1, 3)), min_size=15, max_size=45)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, B=st.integers(1, 3), budget=st.integers(2, 5), beta=st.integers(1, 3), mode=st.sampled_from(MODES),
       order=st.sampled_from(ORDERS), static=st.booleans(), prompt=st.integers(1, 5))
def test_random_churn_matches_the_shadow_and_refusals_change_nothing(ops, B, budget, beta, mode, order, static,
                                                                    prompt):
    cache = TriAttentionCache(CONFIG, _calibration(), budget=budget, beta=beta, mode=mode, compaction_order=order,
                              static=static, **BARE)  # the shadow scores every generated token
    shadow = Shadow(B, budget, beta, mode, budget + beta + 1)
    kv = lambda b, q, dtype=torch.bfloat16: torch.randn(L, b, HKV, q, D).to(dtype)  # noqa: E731

    def masks(q):
        """What a forward asks before its first layer; a static cache runs a due round there."""
        cache.get_query_offset()
        cache.get_mask_sizes(q)
        if static and shadow.positions is not None and shadow.due():
            shadow.round(cache)

    def refused(error, match, fn):
        before = _snapshot(cache)
        with pytest.raises(error, match=match):
            fn()
        assert _same(before, _snapshot(cache))

    def forward(ks, vs, layers=L):
        masks(ks.shape[3])
        for layer in range(layers):
            cache.update(ks[layer], vs[layer], layer)

    def full_step(started):
        """A whole step (a due eager round runs at its first layer), written into the shadow; returns its K/V."""
        ks, vs = kv(B, q), kv(B, q)
        due = started and not static and shadow.due()
        forward(ks, vs)
        if due:
            shadow.round(cache)
        shadow.write(ks, vs)
        return ks, vs

    def first_layer(started):
        """A step's masks and its layer 0 (a due eager round runs at that write); returns the step's K and V."""
        ks, vs = kv(B, q), kv(B, q)
        masks(q)
        due = started and not static and shadow.due()
        cache.update(ks[0], vs[0], 0)
        if due:
            shadow.round(cache)
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
            masks(q)  # accepted: sizes the masks (a static cache's due round)
            refused(ValueError, "batch size", lambda: cache.update(kv(B + 1, q)[0], kv(B + 1, q)[0], 0))
        elif op == "too_long" and started:
            long = shadow.capacity - shadow.after_round() + n
            error, match = (RuntimeError, "offloaded") if shadow.offloaded else (ValueError, "do not fit")
            refused(error, match, lambda: forward(kv(B, long), kv(B, long)))
        elif op == "float32":
            if shadow.offloaded:
                refused(RuntimeError, "offloaded", lambda: forward(kv(B, q, torch.float32), kv(B, q, torch.float32)))
            else:
                masks(q)
                refused(TypeError, "bfloat16 or float16",
                        lambda: cache.update(kv(B, q, torch.float32)[0], kv(B, q, torch.float32)[0], 0))
        elif op == "bad_layer" and not shadow.offloaded:
            # layer 1 of a step gets K/V of another shape: the step is void, a due round its layer 0 ran stays
            ks, vs = first_layer(started)
            with pytest.raises(ValueError, match="key_states"):
                cache.update(ks[1, :, :1], vs[1], 1)
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
