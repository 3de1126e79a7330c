"""Logit parity between HF ``transformers`` (the oracle) and a converted native model.

Both run the same token batch in float32 on CPU: a full-length row, a
right-padded row and a left-padded row (``attention_mask``), positions counted
over the real tokens only, and are compared on real tokens: max |delta logit|,
mean KL(HF || native) and top-1 agreement.

torch and transformers are imported inside :func:`hf_logits` only (the
``reference`` extra; install torch separately, e.g. ``pip install torch``, a CPU
wheel is enough).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib

import numpy as np

from posttrain.conversion.errors import ConversionError


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


def hf_logits(hf_dir: str | os.PathLike, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Float32 logits ``[batch, seq, vocab]`` of the HF model in ``hf_dir`` (eager attention,
    one CPU thread: steady timings, and GPT-OSS sinks need eager)."""
    try:
        import torch
        import transformers
    except ImportError as error:
        raise ConversionError(
            f"check-logits needs torch and transformers ({error}); "
            "pip install 'posttrain-harness[reference]' torch"
        ) from None
    import json

    torch.set_num_threads(1)
    config = json.loads((pathlib.Path(hf_dir) / "config.json").read_text())
    arch = (config.get("architectures") or ["AutoModelForCausalLM"])[0]
    cls = getattr(transformers, arch, None) or transformers.AutoModelForCausalLM
    model = cls.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(
            input_ids=torch.as_tensor(tokens, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            position_ids=torch.as_tensor(positions_for(mask), dtype=torch.long),
            use_cache=False,
        )
    return out.logits.float().numpy()


def _forward(model, tokens, positions, padding):
    return model.forward(tokens, positions, padding)[0]


@functools.cache
def _jitted_forward():
    from flax import nnx

    return nnx.jit(_forward)  # one wrapper, so same-config models share its compile cache


def native_logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Float32 logits of a native :class:`~posttrain.models.CausalLM`, with the same padding
    (keys that are padding are masked, like HF's 4-D mask) and positions.

    Jitted: one compile (2-6 s for a tiny MoE model on 2 CPU cores) beats eager dispatch,
    which compiles every primitive on first use (11-19 s).
    """
    import jax.numpy as jnp

    keys = mask.astype(bool)[:, None, :]  # [B, 1, S]
    padding = np.broadcast_to(keys, (mask.shape[0], mask.shape[1], mask.shape[1]))  # [B, T, S]
    logits = _jitted_forward()(
        model, jnp.asarray(tokens), jnp.asarray(positions_for(mask)), jnp.asarray(padding)
    )
    return np.asarray(logits)


def check_logits(
    hf_dir: str | os.PathLike, native_dir: str | os.PathLike, *, seq: int = 16, seed: int = 7
) -> Parity:
    """Runs both checkpoints on :func:`make_batch` in float32 and compares them.

    Raises:
      ConversionError: the HF config does not describe the native model, or ``seq``
        exceeds its ``max_position_embeddings``.
    """
    from posttrain.conversion.errors import check_source_dir, read_json_object
    from posttrain.conversion.hf_config import text_config
    from posttrain.conversion.native import NativeMeta

    meta = NativeMeta.read(native_dir)
    check_source_dir(pathlib.Path(hf_dir))
    hf_config = text_config(read_json_object(pathlib.Path(hf_dir) / "config.json"))
    max_positions = hf_config.get("max_position_embeddings")
    if isinstance(max_positions, int) and seq > max_positions:
        raise ConversionError(
            f"--seq {seq} exceeds the model's max_position_embeddings={max_positions}"
        )
    tokens, mask = make_batch(meta.cfg.vocab_size, seq, seed)
    model = load_checked(hf_dir, native_dir)  # before torch: a mismatch fails fast
    return compare(hf_logits(hf_dir, tokens, mask), native_logits(model, tokens, mask), mask)


def load_checked(hf_dir: str | os.PathLike, native_dir: str | os.PathLike):
    """The float32 native model of ``native_dir``, after checking that ``hf_dir``'s
    config.json describes the same model.

    Raises:
      ConversionError: the configs differ (the message lists the fields).
    """
    import json

    from posttrain.conversion.hf_config import from_hf_config, hf_view
    from posttrain.conversion.native import NativeMeta, load_native

    meta = NativeMeta.read(native_dir)
    path = pathlib.Path(hf_dir) / "config.json"
    try:
        hf_cfg = from_hf_config(json.loads(path.read_text()))
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
    return load_native(native_dir, dtype="float32", param_dtype="float32")
