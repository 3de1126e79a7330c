"""Generation: KV-cache decoding against recomputing the full forward, and against HF.

Usage::

    python benchmarks/generate.py [--model qwen3-tiny] [--batch 1] [--prompt-len 32] \
        [--new-tokens 256] [--repeats 3] [--hf]

Prints, all measured in this run (medians of ``--repeats``, compile excluded):

- decode tokens/s with the cache (:func:`posttrain.generate.generate`, one jitted
  prefill + a ``lax.while_loop``) against the same greedy loop that recomputes the
  full forward over the whole sequence for each new token (one jitted step per
  length bucket: the sequence is padded to a multiple of 64, so compiles stay few);
  target ratio >= 10x at 256 new tokens;
- prefill tokens/s and time to first token (prefill + the first sample);
- the cache's bytes (:func:`posttrain.layers.kv_cache.cache_bytes`);
- with ``--hf``: tokens/s of HF transformers ``generate(do_sample=False)`` (torch CPU,
  eager attention) on the same tiny model (converted from the same weights through an
  HF directory) and prompts, and ours / HF (target >= 1.0).

One device (``JAX_PLATFORMS=cpu``, no fake devices): decoding one sequence is latency,
not throughput, work.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def _args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-tiny")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf", action="store_true", help="also time transformers.generate")
    parser.add_argument("--devices", default="1", help="N fake CPU devices, or real (a TPU)")
    return parser.parse_args(argv)


def _recompute_seconds(model, prompts, new_tokens: int, bucket: int = 64) -> float:
    """Seconds of the greedy loop that recomputes the full forward for each new token
    (the sequence padded to a multiple of ``bucket``), after a first pass that compiles
    every bucket."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    forward = nnx.jit(lambda m, t, p: m(t, p, None, None)[0])

    def recompute():
        seqs = np.asarray(prompts, np.int32)
        for _ in range(new_tokens):
            length = seqs.shape[1]
            width = -(-length // bucket) * bucket
            tokens = np.zeros((len(seqs), width), np.int32)
            tokens[:, :length] = seqs
            positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
            logits = forward(model, jnp.asarray(tokens), jnp.asarray(positions))
            nxt = np.asarray(jnp.argmax(logits[:, length - 1], axis=-1), np.int32)
            seqs = np.concatenate([seqs, nxt[:, None]], axis=1)
        return seqs

    recompute()  # compile every bucket
    start = time.perf_counter()
    recompute()
    return time.perf_counter() - start


def main(argv=None) -> int:
    args = _args(argv)
    from _timing import fake_devices

    fake_devices(args.devices)

    import jax
    import numpy as np
    from _timing import interleaved_medians

    from posttrain import generate as gen
    from posttrain.layers import kv_cache
    from posttrain.models import build_model, get_config

    cfg = get_config(args.model)
    model = build_model(cfg, seed=0)
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(3, cfg.vocab_size, args.prompt_len)) for _ in range(args.batch)]
    sampling = gen.SamplingConfig(max_new_tokens=args.new_tokens)
    first_only = gen.SamplingConfig(max_new_tokens=1)
    median = interleaved_medians(
        {
            "cached": lambda: gen.generate(model, prompts, sampling),
            "ttft": lambda: gen.generate(model, prompts, first_only),
        },
        args.repeats,
    )
    cached_s, ttft_s = median["cached"], median["ttft"]
    recompute_s = _recompute_seconds(model, prompts, args.new_tokens)

    new = args.batch * args.new_tokens
    print(
        f"generate: {args.model}, batch {args.batch}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, {jax.devices()[0].platform}"
    )
    print(f"  cached decode:    {new / cached_s:10,.0f} tokens/s ({cached_s:.3f} s)")
    print(f"  recompute decode: {new / recompute_s:10,.0f} tokens/s ({recompute_s:.3f} s)")
    print(f"  ratio cached / recompute: {recompute_s / cached_s:.1f}x (target >= 10)")
    print(
        f"  prefill + first token (TTFT): {ttft_s * 1e3:.1f} ms; "
        f"prefill {args.batch * args.prompt_len / ttft_s:,.0f} tokens/s"
    )
    size = args.prompt_len + args.new_tokens
    print(
        f"  cache: {kv_cache.cache_bytes(cfg, args.batch, size, cfg.dtype):,} bytes "
        f"({args.batch} x {size} slots, {cfg.num_layers} layers, {cfg.dtype})"
    )
    if args.hf:
        _hf(args, model, prompts, cached_s, new)
    return 0


def _hf(args, model, prompts, cached_s, new) -> None:
    import pathlib
    import warnings

    import torch
    import transformers
    from _timing import interleaved_medians

    from posttrain.conversion import convert_native_to_hf, save_native
    from posttrain.models import flat_params

    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        native = save_native(flat_params(model), model.config, pathlib.Path(tmp) / "native")
        convert_native_to_hf(native, pathlib.Path(tmp) / "hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            pathlib.Path(tmp) / "hf", attn_implementation="eager"
        ).eval()
    ids = torch.as_tensor(prompts, dtype=torch.long)

    def run():
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=0,
            )

    hf_s = interleaved_medians({"hf": run}, args.repeats)["hf"]
    print(
        f"  HF transformers generate: {new / hf_s:10,.0f} tokens/s ({hf_s:.3f} s, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads)"
    )
    print(f"  ratio ours / HF: {hf_s / cached_s:.2f}x (target >= 1.0)")


if __name__ == "__main__":
    sys.exit(main())
