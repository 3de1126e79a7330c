"""Logit parity between HF ``transformers`` (the oracle) and a converted native model.

Both run the same token batch in float32 on CPU: a full-length row, a
right-padded row and a left-padded row (``attention_mask``), positions counted
over the real tokens only, and are compared on real tokens: max |delta logit|,
mean KL(HF || native) and top-1 agreement. A native checkpoint with a vision tower gets
an image in each row (:mod:`posttrain.conversion.vision_parity`).

torch and transformers are imported inside :func:`hf_logits` only (the
``reference`` extra; install torch separately, e.g. ``pip install torch``, a CPU
wheel is enough).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib

import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.conversion import vision_parity
from posttrain.conversion.errors import ConversionError, check_source_dir, read_json_object
from posttrain.conversion.hf_config import from_hf_config, hf_view, text_config
from posttrain.conversion.native import NativeMeta, load_native


@dataclasses.dataclass(frozen=True)
class Parity:
    """Agreement of two ``[batch, seq, vocab]`` logit arrays on the real tokens."""

    max_abs: float
    mean_kl: float
    top1: float
    tokens: int

    def line(self) -> str:
        return (
            f"max |delta logit| {self.max_abs:.3e}, mean KL(HF||native) {self.mean_kl:.3e}, "
            f"top-1 agreement {self.top1:.4f} over {self.tokens} tokens"
        )

    def ok(self, max_kl: float, atol: float | None) -> bool:
        return self.mean_kl <= max_kl and (atol is None or self.max_abs <= atol)


def make_batch(vocab_size: int, seq: int = 16, seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [3, seq] int32, attention_mask [3, seq] int32)``: one full row, one
    right-padded (to ``seq - 5``), one left-padded (to ``seq - 7``); padding is token 0."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(1, vocab_size, size=(3, seq)).astype(np.int32)
    mask = np.ones((3, seq), np.int32)
    mask[1, seq - 5 :] = 0
    mask[2, :7] = 0
    return np.where(mask == 1, tokens, 0).astype(np.int32), mask


def positions_for(mask: np.ndarray) -> np.ndarray:
    """Positions counted over real tokens (``cumsum - 1``, 0 on leading padding)."""
    return np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)


def compare(hf: np.ndarray, native: np.ndarray, mask: np.ndarray) -> Parity:
    """:class:`Parity` of ``hf`` vs ``native`` logits on the tokens where ``mask`` is 1."""
    keep = mask.astype(bool)
    a = hf[keep].astype(np.float64)  # [tokens, V]
    b = native[keep].astype(np.float64)  # [tokens, V]
    log_p = a - np.logaddexp.reduce(a, axis=-1, keepdims=True)
    log_q = b - np.logaddexp.reduce(b, axis=-1, keepdims=True)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)  # [tokens]
    return Parity(
        float(np.max(np.abs(a - b))),
        float(np.mean(kl)),
        float(np.mean(np.argmax(a, -1) == np.argmax(b, -1))),
        int(keep.sum()),
    )


def hf_logits(
    hf_dir: str | os.PathLike,
    tokens: np.ndarray,
    mask: np.ndarray,
    images: dict[str, np.ndarray] | None = None,
    dtype: str = "float32",
) -> np.ndarray:
    """Float32 logits ``[batch, seq, vocab]`` of the HF model in ``hf_dir`` (eager attention,
    one CPU thread: steady timings, and GPT-OSS sinks need eager), loaded in ``dtype``
    (float32: the reference); ``images``: more keyword inputs, as arrays
    (``ParityImages.hf_inputs``; floating ones cast to ``dtype``)."""
    try:
        import torch
        import transformers
    except ImportError as error:
        raise ConversionError(
            f"check-logits needs torch and transformers ({error}); "
            "pip install 'posttrain-harness[reference]' torch"
        ) from None

    torch.set_num_threads(1)
    config = json.loads((pathlib.Path(hf_dir) / "config.json").read_text())
    arch = (config.get("architectures") or ["AutoModelForCausalLM"])[0]
    cls = getattr(transformers, arch, None) or transformers.AutoModelForCausalLM
    torch_dtype = getattr(torch, dtype)
    model = cls.from_pretrained(hf_dir, dtype=torch_dtype, attn_implementation="eager").eval()
    extra = {k: torch.as_tensor(v) for k, v in (images or {}).items()}
    extra = {k: v.to(torch_dtype) if v.is_floating_point() else v for k, v in extra.items()}
    with torch.no_grad():
        out = model(
            input_ids=torch.as_tensor(tokens, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            position_ids=torch.as_tensor(positions_for(mask), dtype=torch.long),
            use_cache=False,
            **extra,
        )
    return out.logits.float().numpy()


def _forward(model, tokens, positions, padding, images):
    return model.forward(tokens, positions, padding, images=images)[0]


@functools.cache
def _jitted_forward():
    return nnx.jit(_forward)  # one wrapper, so same-config models share its compile cache


def native_logits(model, tokens: np.ndarray, mask: np.ndarray, images=None) -> np.ndarray:
    """Float32 logits of a native :class:`~posttrain.models.CausalLM`, with the same padding
    (keys that are padding are masked, like HF's 4-D mask) and positions; ``images`` an
    :class:`~posttrain.layers.vision.ImageBatch` or None.

    Jitted: one compile (2-6 s for a tiny MoE model on 2 CPU cores) beats eager dispatch,
    which compiles every primitive on first use (11-19 s).
    """
    keys = mask.astype(bool)[:, None, :]  # [B, 1, S]
    padding = np.broadcast_to(keys, (mask.shape[0], mask.shape[1], mask.shape[1]))  # [B, T, S]
    logits = _jitted_forward()(
        model, jnp.asarray(tokens), jnp.asarray(positions_for(mask)), jnp.asarray(padding), images
    )
    return np.asarray(logits)


def check_logits(
    hf_dir: str | os.PathLike, native_dir: str | os.PathLike, *, seq: int = 16, seed: int = 7
) -> Parity:
    """Runs both checkpoints on :func:`make_batch` in float32 and compares them (with
    images when the native model has a vision tower: :func:`logits_pair`).

    Raises:
      ConversionError: the HF config does not describe the native model, ``seq``
        exceeds its ``max_position_embeddings``, or no row has room for an image.
    """
    hf, native, mask = logits_pair(hf_dir, native_dir, seq=seq, seed=seed)
    return compare(hf, native, mask)


def logits_pair(
    hf_dir: str | os.PathLike,
    native_dir: str | os.PathLike,
    *,
    seq: int = 16,
    seed: int = 7,
    dtype: str = "float32",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(HF logits, native logits, mask)``, ``[batch, seq, vocab]`` float32 twice and
    ``[batch, seq]``: both checkpoints on :func:`make_batch`, HF in float32, the native
    model loaded in ``dtype`` (its logits float32). A native model with a vision tower
    gets one image per row (:func:`posttrain.conversion.vision_parity.with_images`).

    Raises:
      ConversionError: as :func:`check_logits`.
    """
    meta = NativeMeta.read(native_dir)
    check_source_dir(pathlib.Path(hf_dir))
    hf_config = text_config(read_json_object(pathlib.Path(hf_dir) / "config.json"))
    max_positions = hf_config.get("max_position_embeddings")
    if isinstance(max_positions, int) and seq > max_positions:
        raise ConversionError(
            f"--seq {seq} exceeds the model's max_position_embeddings={max_positions}"
        )
    tokens, mask = make_batch(meta.cfg.vocab_size, seq, seed)
    images = None
    if meta.cfg.vision is not None:
        try:
            tokens, images = vision_parity.with_images(tokens, mask, meta.cfg.vision, seed)
        except ValueError as error:
            raise ConversionError(str(error)) from None
    model = load_checked(hf_dir, native_dir, dtype)  # before torch: a mismatch fails fast
    hf = hf_logits(hf_dir, tokens, mask, images and images.hf_inputs())
    return hf, native_logits(model, tokens, mask, images and images.native()), mask


def load_checked(hf_dir: str | os.PathLike, native_dir: str | os.PathLike, dtype: str = "float32"):
    """The native model of ``native_dir`` in ``dtype`` (float32 by default), after checking
    that ``hf_dir``'s config.json describes the same model (its vision tower read when the
    native model has one).

    Raises:
      ConversionError: the configs differ (the message lists the fields).
    """
    meta = NativeMeta.read(native_dir)
    path = pathlib.Path(hf_dir) / "config.json"
    try:
        hf_cfg = from_hf_config(json.loads(path.read_text()), vision=meta.cfg.vision is not None)
    except (OSError, ValueError) as error:
        raise ConversionError(f"{path}: {error}") from None
    if hf_view(hf_cfg) != hf_view(meta.cfg):
        diff = [
            f.name
            for f in dataclasses.fields(hf_cfg)
            if getattr(hf_view(hf_cfg), f.name) != getattr(hf_view(meta.cfg), f.name)
        ]
        raise ConversionError(
            f"{path} does not describe the model in {native_dir}: fields {diff} differ"
        )
    return load_native(native_dir, dtype=dtype, param_dtype=dtype)
