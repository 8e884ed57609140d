"""``kvops calibrate``: TriAttention statistics for a local Hugging Face causal LM.

Runs text through the model and records, per layer and query head, what the selector needs: the complex mean
E[q_f] of the pre-RoPE query at frequency f (dims f and f + F paired, as rotate-half RoPE pairs them; after any
q-norm) and E|q_f|. The file is the official format (kvops.triattention.calibration), which ``load_calibration``
reads back::

    python -m kvops calibrate MODEL_DIR --text FILE [--max-tokens N] [--window W] --out FILE.pt

transformers (>= 5.0) is an optional extra of kvops: this module imports it only when it runs. Models load from
local directories only. The query is taken where the model computes it (the output of ``q_norm`` when the
attention has one, else of ``q_proj``), so any attention that projects queries with ``q_proj`` and rotates the
whole head with rotate-half RoPE is measured as the model runs it; other attentions are refused before any
statistic is written.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from ._files import read_json_object, writable_target, write_whole
from .triattention.rope import head_dim_of, rope_parameters

MIN_TRANSFORMERS = (5, 0)
# Families whose attention projects q with q_proj (q_norm in Qwen3) and applies rotate-half RoPE to the whole head.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def check_model_config(config: Mapping[str, Any]) -> None:
    """Refuse, with the reason, a model whose pre-RoPE queries this tool cannot take as the model uses them."""
    kind = config.get("model_type")
    if config.get("kv_lora_rank") or config.get("q_lora_rank"):
        raise ValueError(f"kvops calibrate: {kind!r} uses multi-head latent attention (MLA); its decoupled RoPE "
                         "queries are not the q_proj outputs this tool measures")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        raise TypeError(f"kvops calibrate: rope_parameters / rope_scaling must be a dict, got {type(rope).__name__}")
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"kvops calibrate: {kind!r} rotates only part of each head (partial_rotary_factor="
                         f"{partial}); TriAttention statistics need RoPE over the whole head")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"kvops calibrate: model_type {kind!r} is not one whose attention this tool can hook; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    rope_parameters(config)  # a RoPE kvops can reproduce (raises ValueError naming the problem)


def require_transformers():
    """The transformers module (>= MIN_TRANSFORMERS), or an ImportError that says how to install it."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("kvops calibrate needs transformers: pip install 'kvops[transformers]' "
                          "(or pip install 'transformers>=5.0')") from e
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    if version < MIN_TRANSFORMERS:
        raise ImportError(f"kvops calibrate needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))}, found "
                          f"{transformers.__version__}")
    return transformers


class QueryStatistics:
    """Running float64 sums of the pre-RoPE queries, per layer, head and frequency, fed by forward hooks."""

    # the metadata fields the measurement writes (to_file_format)
    MEASURED = ("head_dim", "num_layers", "num_attention_heads", "rope_style", "tokens", "sampled_heads")

    def __init__(self, model):
        config = model.config.to_dict()
        check_model_config(config)
        self.num_layers, self.num_heads = config["num_hidden_layers"], config["num_attention_heads"]
        self.head_dim = head_dim_of(config)
        self.num_freqs = self.head_dim // 2
        shape = (self.num_layers, self.num_heads, self.num_freqs)
        self.real, self.imag, self.magnitude = (torch.zeros(shape, dtype=torch.float64) for _ in range(3))
        self.tokens = 0
        self._handles = []
        attentions = {}
        for module in model.modules():
            if hasattr(module, "q_proj") and isinstance(getattr(module, "layer_idx", None), int):
                attentions[module.layer_idx] = module
        if sorted(attentions) != list(range(self.num_layers)):
            raise ValueError(f"kvops calibrate: found q_proj attention in layers {sorted(attentions)}, the model has "
                             f"{self.num_layers}; its attention is not one this tool can hook")
        for layer, attention in attentions.items():
            # the query as the model feeds it to RoPE: after q_norm where there is one
            source = attention.q_norm if getattr(attention, "q_norm", None) is not None else attention.q_proj
            self._handles.append(source.register_forward_hook(self._hook(layer)))

    def _hook(self, layer: int):
        def record(module, args, output):
            q = output.detach().reshape(-1, self.num_heads, self.head_dim).double().cpu()  # [tokens, H, D]
            F = self.num_freqs
            re, im = q[..., :F], q[..., F:2 * F]
            self.real[layer] += re.sum(0)
            self.imag[layer] += im.sum(0)
            self.magnitude[layer] += torch.sqrt(re * re + im * im).sum(0)
            if layer == 0:
                self.tokens += q.shape[0]
        return record

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def to_file_format(self, metadata: Mapping[str, Any] | None = None) -> dict:
        """The official format: metadata + stats/layerLL_headHH/{q_mean_real, q_mean_imag, q_abs_mean}."""
        if self.tokens == 0:
            raise ValueError("kvops calibrate: no tokens were run through the model")
        n = float(self.tokens)
        stats = {f"layer{layer:02d}_head{head:02d}": {
            "q_mean_real": (self.real[layer, head] / n).float(),
            "q_mean_imag": (self.imag[layer, head] / n).float(),
            "q_abs_mean": (self.magnitude[layer, head] / n).float()}
            for layer in range(self.num_layers) for head in range(self.num_heads)}
        meta = {"head_dim": self.head_dim, "num_layers": self.num_layers, "num_attention_heads": self.num_heads,
                "rope_style": "half", "tokens": self.tokens,
                "sampled_heads": [[layer, head] for layer in range(self.num_layers) for head in range(self.num_heads)]}
        meta.update(metadata or {})
        return {"metadata": meta, "stats": stats}


@torch.no_grad()
def calibrate(model, token_ids: torch.Tensor, window: int = 2048, progress: bool = False,
              metadata: Mapping[str, Any] | None = None) -> dict:
    """Run `token_ids` (int64 [n], ids of the model's vocabulary) through `model` in windows of `window` tokens
    (each its own sequence, batch 1) and return the calibration in the official format (save it with
    ``torch.save``). `metadata` joins the file's metadata (it may not replace what the measurement writes); the
    model's train/eval mode is restored after."""
    if not hasattr(getattr(model, "config", None), "to_dict") or not hasattr(model, "parameters"):
        raise TypeError(f"calibrate: model must be a transformers model (with a config), got {type(model).__name__}")
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1 or token_ids.dtype != torch.int64:
        raise ValueError("calibrate: token_ids must be a 1-D int64 tensor")
    if token_ids.device.type == "meta" or token_ids.numel() == 0:
        raise ValueError(f"calibrate: token_ids must hold at least one token on a real device, got "
                         f"{token_ids.numel()} on {token_ids.device}")
    vocab = getattr(model.config, "vocab_size", None)
    low, high = int(token_ids.min()), int(token_ids.max())  # a sync, once: calibration runs offline
    if low < 0 or (isinstance(vocab, int) and high >= vocab):  # the embedding would index outside its table
        raise ValueError(f"calibrate: token_ids must be ids in [0, {vocab}) (the model's vocab_size), got values in "
                         f"[{low}, {high}]")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"calibrate: window must be a positive int, got {window!r}")
    if not isinstance(progress, bool):
        raise TypeError(f"calibrate: progress must be a bool, got {type(progress).__name__} {progress!r}")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(f"calibrate: metadata must be a dict or None, got {type(metadata).__name__}")
    measured = set(metadata or ()) & set(QueryStatistics.MEASURED)
    if measured:
        raise ValueError(f"calibrate: metadata may not replace the measured fields {sorted(measured)}")
    stats = QueryStatistics(model)
    device = next(model.parameters()).device
    starts = range(0, token_ids.numel(), window)
    bar = None
    if progress:
        from tqdm.auto import tqdm  # a dependency of transformers

        bar = tqdm(total=token_ids.numel(), unit="tok", desc="kvops calibrate")
    training = model.training
    try:
        model.eval()
        for start in starts:
            chunk = token_ids[start:start + window].to(device)[None]
            model(input_ids=chunk, use_cache=False)
            if bar is not None:
                bar.update(chunk.shape[1])
    finally:
        stats.remove()
        model.train(training)
        if bar is not None:
            bar.close()
    return stats.to_file_format(metadata)


def _device(ap, text: str) -> torch.device:
    """--device: cpu or cuda[:N] with that GPU visible to torch."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        ap.error(f"--device {text}: expected cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            ap.error(f"--device {text}: no CUDA GPU is visible to torch")
        if device.index is not None and device.index >= torch.cuda.device_count():
            ap.error(f"--device {text}: torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="kvops calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", help="a local Hugging Face model directory (config, weights, tokenizer)")
    ap.add_argument("--text", required=True, help="a UTF-8 text file to run through the model")
    ap.add_argument("--out", required=True, help="where to write the calibration (.pt)")
    ap.add_argument("--max-tokens", type=int, default=None, help="use at most this many tokens of the text")
    ap.add_argument("--window", type=int, default=2048, help="tokens per forward pass (default 2048)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="model dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    a = ap.parse_args(argv)
    # Every check that needs no model runs before the weights load: a refusal costs nothing and writes nothing.
    config_file = os.path.join(a.model_dir, "config.json")
    if not os.path.isdir(a.model_dir):
        ap.error(f"{a.model_dir}: no such directory; models load from local directories only")
    if not os.path.isfile(config_file):
        ap.error(f"{a.model_dir}: not a Hugging Face model directory (no config.json)")
    if a.max_tokens is not None and a.max_tokens < 1:
        ap.error(f"--max-tokens must be >= 1, got {a.max_tokens}")
    if a.window < 1:
        ap.error(f"--window must be >= 1, got {a.window}")
    device = _device(ap, a.device)
    if writable_target(a.out):
        ap.error(f"--out {a.out}: {writable_target(a.out)}")
    if os.path.isfile(a.text) and os.path.exists(a.out) and os.path.samefile(a.text, a.out):
        ap.error(f"--out {a.out}: is the --text file; it would be overwritten")
    try:
        with open(a.text, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        ap.error(f"--text {a.text}: not UTF-8 text ({e.reason} at byte {e.start})")
    except OSError as e:
        ap.error(f"--text {a.text}: cannot read it ({e.strerror})")
    if not text:
        ap.error(f"--text {a.text}: the file is empty")
    try:
        read_json_object(config_file)
    except ValueError as e:
        ap.error(str(e))
    try:
        transformers = require_transformers()
    except ImportError as e:
        ap.error(str(e))
    try:
        config = transformers.AutoConfig.from_pretrained(a.model_dir, local_files_only=True)
    except Exception as e:  # transformers' own validation raises its own classes (e.g. a float head_dim)
        ap.error(f"{config_file}: transformers cannot read it ({_first_line(e)})")
    try:
        check_model_config(config.to_dict())
    except (TypeError, ValueError) as e:
        ap.error(_first_line(e).removeprefix("kvops calibrate: "))
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(a.model_dir, local_files_only=True)
    except (TypeError, ValueError, KeyError, OSError) as e:
        ap.error(f"{a.model_dir}: cannot load its tokenizer ({_first_line(e)})")
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64)[:a.max_tokens]
    if ids.numel() == 0:
        ap.error(f"--text {a.text}: the tokenizer of {a.model_dir} makes no tokens of it (an empty text, or no "
                 "tokenizer files there)")
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and int(ids.max()) >= vocab:  # the embedding would index past its table
        ap.error(f"{a.model_dir}: its tokenizer makes token {int(ids.max())}, the model's vocab_size is {vocab}")
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(a.model_dir, local_files_only=True, dtype=dtype)
    except (TypeError, ValueError, KeyError, OSError) as e:
        ap.error(f"{a.model_dir}: cannot load the model's weights ({_first_line(e)})")
    try:  # an attention this tool cannot hook, refused before the model moves or runs
        QueryStatistics(model).remove()
    except ValueError as e:
        ap.error(_first_line(e).removeprefix("kvops calibrate: "))
    model.to(device)
    data = calibrate(model, ids, a.window, progress=True,
                     metadata={"model_name": getattr(config, "_name_or_path", None) or os.path.basename(
                         os.path.abspath(a.model_dir)), "text": os.path.basename(a.text)})
    write_whole(a.out, lambda f: torch.save(data, f))  # --out is the whole calibration or as it was
    print(f"kvops calibrate: {data['metadata']['tokens']} tokens, {len(data['stats'])} heads -> {a.out}")
    return 0
