"""Tracing cost of ``apply_lora``'s Qwix pass, ours against the traced-params baseline.

Usage::

    python benchmarks/lora_apply.py                       # qwen3-0.6b (28 layers), llama3-tiny
    python benchmarks/lora_apply.py --preset qwen3-0.6b --repeats 3 --scan
    python benchmarks/lora_apply.py --qtype int8           # QLoRA: the whole apply_lora

``apply_lora`` runs Qwix's ``apply_lora_to_model`` once under ``nnx.eval_shape`` to
learn which adapters it creates. Each preset (unscanned, or scanned with ``--scan``;
zero weights placed on an ``fsdp=8`` mesh of fake CPU devices) is timed twice in the
same process, best of ``--repeats``:

* ``posttrain``: the pass as ``apply_lora`` runs it: the model closed over (its params
  concrete, so Qwix reads their ``NamedSharding``) and keys drawn through
  ``_compat.tracing_rngs``;
* ``traced``: the same pass with the model as an ``eval_shape`` argument and a plain
  ``nnx.Rngs``, as before: every ``getattr(param, "sharding")`` Qwix does per adapted
  weight, and every key flax >= 0.12.1 draws, raises on a tracer an AttributeError whose
  message walks the whole trace so far (quadratic in the layer count).

It prints both, the ratio and the whole ``apply_lora`` (pass + placing the adapters).
Target: the pass grows linearly with the layer count unscanned and does not grow
scanned (one layer per block is traced). Measured on 2 cores, flax 0.12.8, qwix 0.1.8,
rank 8: qwen3-0.6b unscanned 38.4 s -> 3.5 s (11.0x, 392 adapters), scanned 0.11 s;
the whole ``apply_lora`` before these changes (commit d017fcd) took 31.7 s scanned and
34.4 s unscanned.

``--qtype int8`` (QLoRA) times the whole ``apply_lora`` instead, against the one-trace
flow it replaced: Qwix's PTQ and LoRA passes in one ``eval_shape``, so the quantised
kernels the LoRA pass reads are tracers (one trace walk each), then one
materialisation. Now the PTQ pass runs alone, its kernels are quantised for real (one
jit per kernel shape), and the LoRA pass reads concrete ones. Measured (same machine):
qwen3-0.6b unscanned 10.8 s against 33.3 s (196 quantised kernels; ``apply_lora`` at
commit 1a8ab2a, with the single quantisation program too: 35-39 s), scanned 4.9 s
either way (7 stacked kernels); llama3-tiny 0.9 s either way.
"""

from __future__ import annotations

import argparse

from _timing import best_time

from harness.devices.devices import configure_devices

DEFAULT_PRESETS = ("qwen3-0.6b", "llama3-tiny")


def _args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", help="preset name (repeatable)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--scan", action="store_true", help="scanned layers (one block)")
    parser.add_argument("--qtype", help="QLoRA weight type (e.g. int8): time apply_lora instead")
    return parser.parse_args(argv)


def _placed_zeros(cfg, mesh):
    """``cfg``'s model with zero weights, placed on ``mesh`` (no random init to wait for)."""
    import numpy as np
    from flax import nnx

    from posttrain import sharding
    from posttrain.models import CausalLM

    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))))
    zeros = [(p, v.replace(np.zeros(v.shape, v.dtype))) for p, v in nnx.to_flat_state(state)]
    return sharding.shard_model(nnx.merge(graphdef, nnx.from_flat_state(zeros)), mesh)


def _row(name: str, args, mesh, tokens, lora) -> str:
    """One preset's line: adapters, our LoRA pass and the traced one it replaced (fastest
    of ``--repeats``), their ratio, and the whole ``apply_lora``."""
    import jax
    from flax import nnx

    from posttrain import _compat, sharding
    from posttrain.lora import apply as lora_apply
    from posttrain.lora import apply_lora
    from posttrain.models import get_config

    cfg = get_config(name, scan_layers=args.scan)
    model = _placed_zeros(cfg, mesh)

    def ours():
        with sharding.use_mesh(mesh):
            return nnx.eval_shape(lambda: lora_apply._lora_pass(model, tokens, lora))

    def traced():
        rngs = _compat.tracing_rngs
        _compat.tracing_rngs = nnx.Rngs
        try:
            with sharding.use_mesh(mesh):
                return nnx.eval_shape(lambda m: lora_apply._lora_pass(m, tokens, lora), model)
        finally:
            _compat.tracing_rngs = rngs

    adapters = len(jax.tree.leaves(nnx.state(ours(), nnx.LoRAParam)))
    fast = best_time(ours, args.repeats)
    slow = best_time(traced, args.repeats)
    whole = best_time(lambda: apply_lora(model, mesh, lora), args.repeats)
    return (
        f"{name:<14} {cfg.num_layers:>6} {adapters:>8} {fast:>9.2f}s {slow:>8.2f}s "
        f"{slow / fast:>5.1f}x {whole:>9.2f}s"
    )


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    configure_devices(8)

    import jax.numpy as jnp

    from posttrain import sharding
    from posttrain.lora import LoraConfig
    from posttrain.lora import apply as lora_apply

    mesh = sharding.make_mesh({"fsdp": 8})
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank, weight_qtype=args.qtype)
    batch, seq = lora_apply.dummy_batch_shape(mesh)
    tokens = jnp.zeros((batch, seq), jnp.int32)
    if args.qtype:
        return qlora(args, lora, mesh, tokens, lambda cfg: _placed_zeros(cfg, mesh))
    print(f"{'scanned' if args.scan else 'unscanned'} layers, LoRA rank {args.rank}")
    print(
        f"{'preset':<14} {'layers':>6} {'adapters':>8} {'posttrain':>10} {'traced':>9} "
        f"{'ratio':>6} {'apply_lora':>10}"
    )
    for name in args.preset or DEFAULT_PRESETS:
        print(_row(name, args, mesh, tokens, lora))
    return 0


def qlora(args, lora, mesh, tokens, placed_zeros) -> int:
    """QLoRA: the whole ``apply_lora`` against the one-trace flow it replaced."""
    import jax
    from flax import nnx

    from posttrain import sharding
    from posttrain.lora import apply as lora_apply
    from posttrain.lora import apply_lora
    from posttrain.models import get_config

    def one_trace(model):
        """Before: PTQ and LoRA passes in one ``eval_shape`` (the quantised kernels
        Qwix's LoRA pass reads are tracers), then one materialisation."""
        with sharding.use_mesh(mesh):
            abstract = nnx.eval_shape(
                lambda: lora_apply._lora_pass(
                    lora_apply._ptq_pass(model, tokens, lora), tokens, lora
                )
            )
        return lora_apply._materialise(model, abstract, lora, mesh, sharding.DEFAULT_RULES)

    print(f"{'scanned' if args.scan else 'unscanned'} layers, QLoRA {args.qtype} rank {args.rank}")
    header = ("preset", "layers", "kernels", "apply_lora", "one trace", "ratio")
    print("{:<14} {:>6} {:>8} {:>10} {:>9} {:>6}".format(*header))
    for name in args.preset or DEFAULT_PRESETS:
        cfg = get_config(name, scan_layers=args.scan)
        model = placed_zeros(cfg)
        kernels = sum(
            "qvalue" in path
            for path, _ in nnx.to_flat_state(nnx.state(apply_lora(model, mesh, lora)))
        )
        fast = best_time(lambda model=model: apply_lora(model, mesh, lora), args.repeats)
        slow = best_time(lambda model=model: jax.block_until_ready(one_trace(model)), args.repeats)
        print(
            f"{name:<14} {cfg.num_layers:>6} {kernels:>8} {fast:>9.2f}s {slow:>8.2f}s "
            f"{slow / fast:>5.1f}x"
        )
        del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
