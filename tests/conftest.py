import contextlib
import os
import re
import subprocess
import sys

import pytest
import torch
import triton

import kvops  # noqa: F401  (loads the ops)
from kvops.triattention import load_calibration

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh data every run (the seed is printed on failure), reproducible with KVOPS_TEST_SEED.
    seed = int(os.environ.get("KVOPS_TEST_SEED", torch.seed() % 2**31))
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with random bytes (never zeros only), in place."""
    b = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=b.device))
    return t


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8).cpu()


def opcheck(op, args):
    """torch.library.opcheck, all of it. torch's schema-check mode cannot compare float8 tensors
    (bitwise_equal multiplies them), so for float8 inputs its mutation check is done here instead."""
    flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else [x]) if isinstance(a, torch.Tensor)]
    if not any(t.dtype == torch.float8_e4m3fn for t in flat):
        torch.library.opcheck(op, args)
        return
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op, args, test_utils=utils)
    mutable = {i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
    before = [[bytes_of(t).clone() for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
              for a in args]
    op(*args)
    for i, a in enumerate(args):
        if i in mutable:
            continue
        after = [bytes_of(t) for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
        assert all(torch.equal(x, y) for x, y in zip(before[i], after)), f"argument {i} mutated but not declared"


@contextlib.contextmanager
def refused(error: type, match: str):
    """The call raises `error` matching `match`: itself (eager), or under torch.compile in the cause chain of
    dynamo's wrapper (docs/DESIGN.md, "What a compiled caller sees")."""
    with pytest.raises(Exception) as info:
        yield
    e = info.value
    while e is not None and not (isinstance(e, error) and re.search(match, str(e))):
        e = e.__cause__ or e.__context__
    assert e is not None, f"no {error.__name__} matching {match!r} in the chain of {info.value!r}"


def run_python(code: str, **env: str) -> None:
    """Run code in a fresh interpreter (for settings read at import time, e.g. TRITON_INTERPRET) and fail with
    its stderr."""
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture(scope="session")
def cute_cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kvops-cute-cache")


@pytest.fixture(params=["library", "cache"])
def cute_call(request, monkeypatch, cute_cache_dir):
    """Where the GPU ops find their CuTe kernels (kvops/_cute.py): the library built at install (a class it lacks
    from the cache), or, with the library set aside, the persistent cache only (compiled there once per session)."""
    from kvops import _cute

    monkeypatch.setenv("KVOPS_CACHE_DIR", str(cute_cache_dir))
    monkeypatch.setattr(_cute, "_functions", {})  # looked up afresh, and forgotten after the test
    if request.param == "cache":
        monkeypatch.setattr(_cute, "_prebuilt", lambda name: None)
    return request.param


# ---- TriAttention inputs shared by the selection and scoring tests ----------------------------------------

# TriAttention with bare scores (no sinks, no protected window, no recent layer): for tests of the mechanics
# against references that score every generated token (the defaults are each mode's keep policy)
BARE = dict(sink_tokens=0, recent_window=0, recent_layers=(), recency_prior=0.0)

SYNTHETIC = dict(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=32, rope_theta=1e4)


def synthetic_calibration():
    """Random statistics for SYNTHETIC (3 layers, 8 query / 2 KV heads, F = 16)."""
    L, Hq, F = 3, 8, 16
    return load_calibration({"E_q": torch.randn(L, Hq, F, dtype=torch.complex64),
                             "E_q_norm": torch.rand(L, Hq, F) * 2 + 1}, SYNTHETIC)


def paged_pools(cal, prompt, cache, T, device, dtype=torch.bfloat16):
    """(per-layer HND pools of random keys, page table on shuffled pages, cache lengths, prompt lengths)."""
    R = len(prompt)
    pages_per = [triton.cdiv(n, T) for n in cache]
    P = sum(pages_per) + 3
    perm = torch.randperm(P)
    table = torch.full((R, max(pages_per)), -1, dtype=torch.int32)
    at = 0
    for r, n in enumerate(pages_per):
        table[r, :n] = perm[at:at + n].int()
        at += n
    D = 2 * cal.num_freqs
    pools = [torch.randn(P, 2, cal.num_kv_heads, T, D, device=device).to(dtype) for _ in range(cal.num_layers)]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return pools, table.to(device), i32(cache), i32(prompt)


# ---- tiny transformers models (kvops calibrate and the quality harness; transformers imported on use) -------

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256)
TINY_MODELS = {  # (config class, modeling module, fields): the families and RoPE variants calibrate must measure
    "qwen3": ("Qwen3Config", "qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    "llama3": ("LlamaConfig", "llama", dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "qwen2_gqa7": ("Qwen2Config", "qwen2", dict(hidden_size=112, num_attention_heads=7, num_key_value_heads=1)),
}


def tiny_model(name):
    """A tiny randomly initialised transformers model of one of TINY_MODELS' families, float32, eval mode."""
    import transformers

    cls, _, fields = TINY_MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**{**TINY, **fields})
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()
