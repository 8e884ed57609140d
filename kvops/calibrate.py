"""``kvops calibrate``: TriAttention statistics for a local Hugging Face causal LM.

Runs text through the model and records, per layer and query head, what the selector needs: the complex mean
E[q_f] of the pre-RoPE query at frequency f (dims f and f + F paired, as rotate-half RoPE pairs them; after any
q-norm) and E|q_f|. The file is the official format (kvops.triattention.calibration), which ``load_calibration``
reads back::

    python -m kvops calibrate MODEL_DIR --text FILE --out FILE.pt [--max-tokens N] [--window W]
        [--sensitivity-windows N] [--budgets B,...] [--device DEVICE] [--dtype DTYPE]

transformers (>= 5.0) is an optional extra of kvops: this module imports it only when it runs. Models load from
local directories only. The query is taken where the model computes it (the output of ``q_norm`` when the
attention has one, else of ``q_proj``), so any attention that projects queries with ``q_proj`` and rotates the
whole head with rotate-half RoPE is measured as the model runs it; other attentions are refused before any
statistic is written.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Mapping

import torch

from ._checks import check_int
from ._files import read_json_object, writable_target, write_whole
from .config import LayerSplit, TriAttentionConfig, layer_split
from .triattention.calibration import LayerSensitivity
from .triattention.rope import head_dim_of, rope_parameters

MIN_TRANSFORMERS = (5, 0)
# Layer sensitivity (layer_sensitivity): the recent windows a layer is limited to, the first tokens it keeps
# (a prompt's stand-in), and how many calibration windows it is measured on.
SENSITIVITY_RECENT = (64, 256, 1024)
SENSITIVITY_SINKS = 16
SENSITIVITY_WINDOWS = 4
MIN_SENSITIVITY_TOKENS = 3  # a window's second half predicts at least one token
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


def attention_modules(model) -> dict[int, Any]:
    """The model's attention modules by layer: those with a q_proj and an int layer_idx, one per layer (else a
    ValueError: an attention this tool cannot hook)."""
    layers = model.config.num_hidden_layers
    attentions = {}
    for module in model.modules():
        if hasattr(module, "q_proj") and isinstance(getattr(module, "layer_idx", None), int):
            attentions[module.layer_idx] = module
    if sorted(attentions) != list(range(layers)):
        raise ValueError(f"kvops calibrate: found q_proj attention in layers {sorted(attentions)}, the model has "
                         f"{layers}; its attention is not one this tool can hook")
    return attentions


@contextlib.contextmanager
def layer_masks(model, masks: Mapping[int, torch.Tensor]):
    """Within it, each layer in `masks` attends under its own mask instead of the model's: bool ``[1, 1 or heads,
    q, kv]``, True where a query may read a key, handed to the layer's attention as an additive mask in the
    model's dtype by a forward pre-hook. The attention must take a 4-D mask (eager or sdpa)."""
    attentions = attention_modules(model)
    handles = []

    def hook(additive):
        def replace_mask(module, args, kwargs):
            return args, {**kwargs, "attention_mask": additive}
        return replace_mask
    try:
        for layer, allowed in masks.items():
            additive = torch.zeros(allowed.shape, dtype=model.dtype, device=allowed.device)
            additive.masked_fill_(~allowed, torch.finfo(model.dtype).min)
            handles.append(attentions[layer].register_forward_pre_hook(hook(additive), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _recorded(attentions: Mapping[int, Any]):
    """Within it, each attention module's output lands in the dict it yields, by layer, without the attention
    weights of a tuple's other fields (None in their place: decoder layers drop them)."""
    outputs = {}

    def hook(layer):
        def record(module, args, output):
            outputs[layer] = (output[0], *[None] * (len(output) - 1)) if isinstance(output, tuple) else output
        return record
    handles = [module.register_forward_hook(hook(layer)) for layer, module in attentions.items()]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def forwards_replaced(forwards: Mapping[Any, Any]):
    """Within it, each module (a key) runs the function it maps to as its forward; on exit each has the forward it
    had again, an instance forward of its own (accelerate's hooks set one) included. Hooks still run around it."""
    for module, forward in forwards.items():
        if not isinstance(module, torch.nn.Module) or not callable(forward):
            raise TypeError(f"forwards_replaced: forwards must map modules to callables, got "
                            f"{type(module).__name__} -> {type(forward).__name__}")
    own = {module: module.__dict__.get("forward") for module in forwards}
    try:
        for module, forward in forwards.items():
            module.forward = forward
        yield
    finally:
        for module, forward in own.items():
            if forward is None:
                module.__dict__.pop("forward", None)  # the class's forward again
            else:
                module.forward = forward


def _replayed(attentions: Mapping[int, Any], outputs: Mapping[int, Any], below: int):
    """Within it, the attention modules of the layers below `below` return their recorded outputs (_recorded)
    instead of computing them: exact where their inputs are the recorded forward's, and layer_sensitivity's
    forwards cost about half (only the limited layer and those above it attend)."""
    return forwards_replaced({attentions[layer]: lambda *args, _out=outputs[layer], **kwargs: _out
                              for layer in range(below)})


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
        for layer, attention in attention_modules(model).items():
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


def _check_tokens(what: str, model, token_ids) -> None:
    """token_ids: a 1-D int64 tensor of at least one id of the model's vocabulary, on a real device."""
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1 or token_ids.dtype != torch.int64:
        raise ValueError(f"{what}: token_ids must be a 1-D int64 tensor")
    if token_ids.device.type == "meta" or token_ids.numel() == 0:
        raise ValueError(f"{what}: token_ids must hold at least one token on a real device, got "
                         f"{token_ids.numel()} on {token_ids.device}")
    vocab = getattr(model.config, "vocab_size", None)
    low, high = int(token_ids.min()), int(token_ids.max())  # a sync, once: calibration runs offline
    if low < 0 or (isinstance(vocab, int) and high >= vocab):  # the embedding would index outside its table
        raise ValueError(f"{what}: token_ids must be ids in [0, {vocab}) (the model's vocab_size), got values in "
                         f"[{low}, {high}]")


def _check_model(what: str, model) -> None:
    if not hasattr(getattr(model, "config", None), "to_dict") or not hasattr(model, "parameters"):
        raise TypeError(f"{what}: model must be a transformers model (with a config), got {type(model).__name__}")


def _check_sensitivity(what: str, model, window, windows, recent, sinks) -> None:
    check_int(what, "window", window, 2)
    check_int(what, "windows", windows, 1)
    check_int(what, "sinks", sinks)
    if not isinstance(recent, (tuple, list)) or not recent:
        raise TypeError(f"{what}: recent must be a non-empty tuple of window sizes, got {recent!r}"[:300])
    for i, r in enumerate(recent):
        check_int(what, f"recent[{i}]", r, 1)
    if list(recent) != sorted(set(recent)):
        raise ValueError(f"{what}: recent must be increasing, got {recent!r}"[:300])
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in ("eager", "sdpa"):
        raise ValueError(f"{what}: the model's attention ({implementation!r}) must take a 4-D mask for the layer "
                         f"sensitivity: load it with attn_implementation='sdpa' or 'eager'")
    attention_modules(model)  # an attention the masks can reach


@torch.no_grad()
def layer_sensitivity(model, token_ids: torch.Tensor, *, window: int = 2048, windows: int = SENSITIVITY_WINDOWS,
                      recent: tuple[int, ...] = SENSITIVITY_RECENT, sinks: int = SENSITIVITY_SINKS) -> dict:
    """What each layer's attention needs beyond its recent tokens, as loss: for each layer l and r in `recent`,
    the mean next-token loss (nats per token) the model adds when layer l alone attends only to the first
    `sinks` tokens and its newest r, every other layer to everything. Measured over the second half of each of the
    first `windows` windows of `window` tokens of `token_ids` (each its own sequence, batch 1). The per-layer
    budget rule reads it (``kvops.config.layer_split``).

    Returns ``{"recent": int64 [R], "nats": float32 [R, L], "sinks": int, "tokens": int}`` (tokens: the positions
    each value averages), the ``layer_sensitivity`` entry of a calibration file. The model's attention must take
    a 4-D mask: eager or sdpa."""
    what = "layer_sensitivity"
    _check_model(what, model)
    _check_tokens(what, model, token_ids)
    _check_sensitivity(what, model, window, windows, recent, sinks)
    if min(window, token_ids.numel()) < MIN_SENSITIVITY_TOKENS:
        raise ValueError(f"{what}: the first window must hold at least {MIN_SENSITIVITY_TOKENS} tokens (its second "
                         f"half is measured), got {min(window, token_ids.numel())}")
    return _sensitivity(model, token_ids, window, windows, recent, sinks)


def _sensitivity(model, token_ids: torch.Tensor, window: int, windows: int, recent: tuple[int, ...],
                 sinks: int, progress: bool = False) -> dict:
    """layer_sensitivity on checked arguments; `progress`: a bar over its forwards (windows x (1 + R x L))."""
    device = next(model.parameters()).device
    L = model.config.num_hidden_layers
    attentions = attention_modules(model)
    loss = torch.nn.functional.cross_entropy
    nats, tokens = torch.zeros(len(recent), L, dtype=torch.float64), 0
    training = model.training
    starts = [s for s in range(0, min(windows * window, token_ids.numel()), window)
              if min(window, token_ids.numel() - s) >= MIN_SENSITIVITY_TOKENS]  # a last window may be too short
    bar = None
    if progress:
        from tqdm.auto import tqdm  # a dependency of transformers

        bar = tqdm(total=len(starts) * (1 + len(recent) * L), unit="fwd", desc="kvops calibrate: layer sensitivity")
    try:
        model.eval()
        for start in starts:
            ids = token_ids[start:start + window].to(device)
            n, half = ids.numel(), ids.numel() // 2
            with _recorded(attentions) as outputs:
                full = loss(model(input_ids=ids[None], use_cache=False).logits[0, half:-1].float(), ids[half + 1:],
                            reduction="sum")
            if bar is not None:
                bar.update()
            t = torch.arange(n, device=device)
            age = t[:, None] - t[None, :]
            for i, r in enumerate(recent):
                allowed = ((age >= 0) & ((age < r) | (t[None, :] < sinks)))[None, None]
                for layer in range(L):
                    # the layers below see what they saw unmasked: their attention is the full forward's
                    with layer_masks(model, {layer: allowed}), _replayed(attentions, outputs, layer):
                        logits = model(input_ids=ids[None], use_cache=False).logits[0, half:-1].float()
                    nats[i, layer] += float(loss(logits, ids[half + 1:], reduction="sum") - full)
                    if bar is not None:
                        bar.update()
            tokens += n - 1 - half
    finally:
        model.train(training)
        if bar is not None:
            bar.close()
    return {"recent": torch.tensor(recent, dtype=torch.int64), "nats": (nats / tokens).float(),
            "sinks": sinks, "tokens": tokens}


@torch.no_grad()
def calibrate(model, token_ids: torch.Tensor, window: int = 2048, progress: bool = False,
              metadata: Mapping[str, Any] | None = None, sensitivity_windows: int = SENSITIVITY_WINDOWS) -> dict:
    """Run `token_ids` (int64 [n], ids of the model's vocabulary) through `model` in windows of `window` tokens
    (each its own sequence, batch 1) and return the calibration in the official format (save it with
    ``torch.save``), with the ``layer_sensitivity`` of the first `sensitivity_windows` windows (none for 0 or a
    first window under 3 tokens; it needs an eager or sdpa attention). `metadata` joins the file's metadata (it may
    not replace what the measurement writes); the model's train/eval mode is restored after."""
    _check_model("calibrate", model)
    _check_tokens("calibrate", model, token_ids)
    check_int("calibrate", "window", window, 1)
    if check_int("calibrate", "sensitivity_windows", sensitivity_windows):
        _check_sensitivity("calibrate", model, window, sensitivity_windows, SENSITIVITY_RECENT, SENSITIVITY_SINKS)
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
    data = stats.to_file_format(metadata)
    if sensitivity_windows and min(window, token_ids.numel()) >= MIN_SENSITIVITY_TOKENS:
        data["layer_sensitivity"] = _sensitivity(model, token_ids, window, sensitivity_windows, SENSITIVITY_RECENT,
                                                 SENSITIVITY_SINKS, progress)
    return data


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
    ap.add_argument("--sensitivity-windows", type=int, default=SENSITIVITY_WINDOWS,
                    help=f"windows the layer sensitivity is measured on (default {SENSITIVITY_WINDOWS}; 0: none)")
    ap.add_argument("--budgets", default=str(TriAttentionConfig.budget),
                    help="budgets to print the per-layer split for (layer_split=True), comma-separated (default "
                         f"{TriAttentionConfig.budget})")
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
    if a.sensitivity_windows < 0 or a.sensitivity_windows and a.window < 2:
        ap.error(f"--sensitivity-windows must be >= 0 (and needs --window >= 2), got {a.sensitivity_windows}")
    try:
        budgets = [int(b) for b in a.budgets.split(",")]
    except ValueError:
        budgets = []
    if not budgets or min(budgets) < 1:
        ap.error(f"--budgets must be positive integers separated by commas, got {a.budgets!r}")
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
    except Exception as e:  # tokenizers and transformers raise their own classes too
        ap.error(f"{a.model_dir}: cannot load its tokenizer ({type(e).__name__}: {_first_line(e)})")
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64)[:a.max_tokens]
    if ids.numel() == 0:
        ap.error(f"--text {a.text}: the tokenizer of {a.model_dir} makes no tokens of it (an empty text, or no "
                 "tokenizer files there)")
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and int(ids.max()) >= vocab:  # the embedding would index past its table
        ap.error(f"{a.model_dir}: its tokenizer makes token {int(ids.max())}, the model's vocab_size is {vocab}")
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(a.model_dir, local_files_only=True, dtype=dtype,
                                                                  attn_implementation="sdpa")
    except Exception as e:  # a truncated file raises safetensors' own SafetensorError, torch.load its own
        weights = sorted(f for f in os.listdir(a.model_dir) if f.endswith((".safetensors", ".bin", ".pt", ".pth")))
        ap.error(f"{os.path.join(a.model_dir, weights[0]) if len(weights) == 1 else a.model_dir}: cannot load the "
                 f"model's weights ({type(e).__name__}: {_first_line(e)})")
    try:  # an attention this tool cannot hook, refused before the model moves or runs
        QueryStatistics(model).remove()
    except ValueError as e:
        ap.error(_first_line(e).removeprefix("kvops calibrate: "))
    model.to(device)
    data = calibrate(model, ids, a.window, progress=True,
                     metadata={"model_name": getattr(config, "_name_or_path", None) or os.path.basename(
                         os.path.abspath(a.model_dir)), "text": os.path.basename(a.text)},
                     sensitivity_windows=a.sensitivity_windows)
    write_whole(a.out, lambda f: torch.save(data, f))  # --out is the whole calibration or as it was
    print(f"kvops calibrate: {data['metadata']['tokens']} tokens, {len(data['stats'])} heads -> {a.out}")
    entry = data.get("layer_sensitivity")
    if entry is not None:
        sensitivity = LayerSensitivity(tuple(entry["recent"].tolist()), entry["nats"], entry["sinks"])
        for budget in budgets:
            print(_split_line(budget, layer_split(sensitivity, budget)))
    return 0


def _split_line(budget: int, split: LayerSplit) -> str:
    """What ``TriAttentionConfig(layer_split=True)`` keeps per layer at `budget`, in one line."""
    if not split.local_layers:
        return f"layer_split at budget {budget}: no layer is local (every layer scored at {budget})"
    local = ", ".join(map(str, split.local_layers))
    return (f"layer_split at budget {budget}: layers {local} keep their newest {split.local_budget} "
            f"tokens, every other layer {split.budget}")
