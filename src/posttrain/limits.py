"""How long a sequence a model may be asked for, checked before anything is allocated
(``posttrain generate --max-new-tokens``, ``posttrain sft --max-target-length``).

Two limits, each named in the refusal:

- positions: the checkpoint's ``max_position_embeddings`` (an HF directory's
  ``config.json``, or the one a native directory recorded from its source); when the
  checkpoint records none (a preset, a run's export), :data:`DEFAULT_MAX_POSITIONS`, the
  value posttrain's own HF export writes.
- memory: a lower bound of what the request allocates at once (below), against an upper
  bound of the memory there is (:func:`available_memory`). Refusing only when the lower
  bound exceeds the upper one never refuses a request that fits.

Lower bounds (float32 attention scores: :mod:`posttrain.layers.attention`):

- generation: the KV cache (:func:`posttrain.layers.kv_cache.cache_bytes`, B rows of S
  slots) plus one layer's prefill scores ``[B, num_heads, P, S]`` float32;
- a training step: the logits ``[B, T, V]`` float32 plus one layer's scores
  ``[B, num_heads, T, T]`` float32, B the global batch.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax

from posttrain.config import ModelConfig
from posttrain.conversion.hf_config import DEFAULT_MAX_POSITIONS, from_hf_config
from posttrain.conversion.native import NativeMeta, is_native_dir
from posttrain.layers.kv_cache import cache_bytes
from posttrain.models import PRESETS, get_config


def checkpoint_config(spec: str, flag: str = "--model") -> tuple[ModelConfig, int, str]:
    """``(model config, max positions, where that limit comes from)`` of a ``--model``
    value (or another ``flag``'s, named in the error), read from its ``config.json``
    without loading any weight.

    Raises:
      ValueError: ``spec`` is neither a preset nor a checkpoint directory, or its
        ``config.json`` cannot be read (named).
    """
    if spec in PRESETS:
        return get_config(spec), DEFAULT_MAX_POSITIONS, _DEFAULT_SOURCE
    if not os.path.isdir(spec):
        raise ValueError(
            f"{flag} {spec!r} is neither a preset ({', '.join(sorted(PRESETS))})"
            " nor a checkpoint directory (HF or native)"
        )

    path = pathlib.Path(spec) / "config.json"
    if is_native_dir(spec):
        meta = NativeMeta.read(spec)
        cfg, hf = meta.cfg, meta.hf_config or {}
    else:
        try:
            hf = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ValueError(f"{path}: not readable JSON ({error})") from None
        if not isinstance(hf, dict):
            raise ValueError(f"{path}: expected a JSON object")
        cfg = from_hf_config(hf)
    hf = hf.get("text_config", hf) if isinstance(hf.get("text_config"), dict) else hf
    recorded = hf.get("max_position_embeddings")
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded > 0:
        return cfg, recorded, f"max_position_embeddings of {path}"
    return cfg, DEFAULT_MAX_POSITIONS, _DEFAULT_SOURCE


_DEFAULT_SOURCE = f"{DEFAULT_MAX_POSITIONS}: the checkpoint records no max_position_embeddings"


def available_memory() -> tuple[int, str] | None:
    """An upper bound of the memory the current backend has: ``(bytes, what it is)``;
    None when the backend does not say. CPU (fake devices share the host): the host's
    ``MemAvailable`` times the process count; accelerators: the sum over every device of
    its ``bytes_limit`` less ``bytes_in_use`` (``Device.memory_stats``)."""
    devices = jax.devices()
    if devices[0].platform == "cpu":
        host = _host_available()
        if host is None:
            return None
        return host * jax.process_count(), "available host memory"
    local = [d.memory_stats() or {} for d in jax.local_devices()]
    if not local or not all("bytes_limit" in s for s in local):
        return None
    free = max(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in local)
    return free * len(devices), f"free memory of {len(devices)} {devices[0].platform} devices"


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def generation_bytes(cfg: ModelConfig, rows: int, prompt: int, cache_size: int) -> int:
    """A lower bound of what generating allocates at once: the KV cache of ``rows`` x
    ``cache_size`` slots and one layer's prefill scores ``[rows, num_heads, prompt,
    cache_size]`` float32."""
    heads = max(a.num_heads for a in cfg.attention.values())
    return cache_bytes(cfg, rows, cache_size, cfg.dtype) + 4 * rows * heads * prompt * cache_size


def training_bytes(
    cfg: ModelConfig, batch: int, length: int, *, logit_chunk_bytes: int | None = None
) -> int:
    """A lower bound of what one training step allocates at once: the logits ``[batch,
    length, V]`` float32 and one layer's scores ``[batch, num_heads, length, length]``
    float32.

    Args:
      logit_chunk_bytes: the loss takes the logits a chunk of positions at a time
        (:mod:`posttrain.training.chunked_loss`), each chunk's float32 logits within this
        size (at least one position of every row): the step holds one chunk, not all.
    """
    heads = max(a.num_heads for a in cfg.attention.values())
    logits = 4 * batch * length * cfg.vocab_size
    if logit_chunk_bytes is not None:
        logits = min(logits, max(logit_chunk_bytes, 4 * batch * cfg.vocab_size))
    return logits + 4 * batch * heads * length * length


def check_generation(
    spec: str,
    cfg: ModelConfig,
    *,
    rows: int,
    prompt: int,
    new_tokens: int,
    cache_size: int | None,
    memory: tuple[int, str] | None = None,
) -> None:
    """Refuses a generation longer than the model's positions or larger than the memory.

    Args:
      spec: the ``--model`` value (its ``config.json`` gives the position limit).
      cfg: the loaded model's config (its dims give the memory).
      rows: B prompts; prompt: P tokens of the longest; new_tokens: N.
      cache_size: S slots (None: P + N).
      memory: ``(bytes, what)`` (default :func:`available_memory`).

    Raises:
      ValueError: one line naming the request, the limit and where it comes from.
    """
    _, positions, source = checkpoint_config(spec)
    if prompt + new_tokens > positions:
        raise ValueError(
            f"max_new_tokens={new_tokens} (--max-new-tokens): the longest prompt has {prompt} "
            f"tokens, so positions reach {prompt + new_tokens}; the model's limit is "
            f"{positions} ({source}): expected --max-new-tokens <= {max(positions - prompt, 0)}"
        )
    slots = max(cache_size or 0, prompt + new_tokens)
    need = generation_bytes(cfg, rows, prompt, slots)
    memory = memory if memory is not None else available_memory()
    if memory is not None and need > memory[0]:
        raise ValueError(
            f"max_new_tokens={new_tokens} (--max-new-tokens): {rows} prompt(s) of up to "
            f"{prompt} tokens need at least {_size(need)} (KV cache of {slots} slots and the "
            f"prefill's attention scores); {memory[1]} is {_size(memory[0])}"
        )


def check_training_length(
    spec: str,
    length: int,
    batch: int,
    *,
    flag: str,
    memory: tuple[int, str] | None = None,
    logit_chunk_bytes: int | None = None,
) -> None:
    """Refuses rows of ``length`` tokens (``flag``) longer than the model's positions or
    whose step needs more memory than there is (:func:`training_bytes` of the global
    ``batch``, with ``logit_chunk_bytes`` when the loss chunks its logits).

    Raises:
      ValueError: one line naming the length, the limit and where it comes from.
    """
    cfg, positions, source = checkpoint_config(spec)
    name = flag.lstrip("-").replace("-", "_")
    if length > positions:
        raise ValueError(
            f"{name}={length} ({flag}): the model's limit is {positions} positions ({source})"
        )
    need = training_bytes(cfg, batch, length, logit_chunk_bytes=logit_chunk_bytes)
    memory = memory if memory is not None else available_memory()
    if memory is not None and need > memory[0]:
        logits = "one chunk's logits" if logit_chunk_bytes is not None else "logits"
        raise ValueError(
            f"{name}={length} ({flag}): a step of {batch} rows needs at least {_size(need)} "
            f"({logits} and one layer's attention scores); {memory[1]} is {_size(memory[0])}"
        )


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
