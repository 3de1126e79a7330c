"""One Orbax checkpoint save on fake CPU devices: replica-parallel (Orbax's default)
against one replica per array (what ``posttrain sft`` uses there by default).

Usage::

    python benchmarks/checkpoint_save.py                     # llama3-tiny, qwen3_moe-tiny
    python benchmarks/checkpoint_save.py --preset qwen3-tiny --mesh data=4,tensor=2 --repeats 5

Per preset: the model built by ``build_model`` on the mesh (default ``data=2,fsdp=2,
tensor=2`` of 8 fake CPU devices, so every parameter is replicated over ``data``) plus
an Adam state of the same shapes and shardings, saved as Tunix saves a step (one
``ocp.args.Composite`` of ``model_params`` and ``optimizer_state`` through an
``ocp.CheckpointManager``), each save timed until ``wait_until_finished`` returns.
The two modes take turns, best of ``--repeats`` each:

* ``replica-parallel``: Orbax's registered ``ArrayHandler`` as it comes
  (``use_replica_parallel=True``): each replicated array that is safe to slice is split
  between its replicas with one eager ``jax.lax.slice_in_dim`` per replica;
* ``one replica``: inside ``posttrain._compat.single_replica_array_saves()``.

Prints both, the ratio and the arrays saved. Target: the single-replica save is
clearly faster on CPU, where nothing is gained by splitting (one process writes
everything). Measured on 2 cores, orbax-checkpoint 0.12.8, jax 0.10.2: llama3-tiny
(64 arrays, 1.3 MiB) 0.70 s -> 0.45 s (1.6x), qwen3_moe-tiny (82 arrays, 3.1 MiB)
0.78 s -> 0.46 s (1.7x).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _timing import best_time

from harness.devices.devices import configure_devices

DEFAULT_PRESETS = ("llama3-tiny", "qwen3_moe-tiny")


def parse_mesh(text: str) -> dict[str, int]:
    mesh = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        mesh[name.strip()] = int(size)
    return mesh


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", help="preset name (repeatable)")
    parser.add_argument("--mesh", default="data=2,fsdp=2,tensor=2")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    configure_devices(8)

    import jax
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx

    from posttrain import _compat, sharding
    from posttrain.models import build_model, get_config

    mesh = sharding.make_mesh(parse_mesh(args.mesh))
    print(f"mesh {dict(mesh.shape)}, orbax-checkpoint {ocp.__version__}, best of {args.repeats}")
    header = ("preset", "arrays", "MiB", "replica-par", "one replica", "ratio")
    print("{:<16} {:>6} {:>7} {:>12} {:>12} {:>6}".format(*header))
    for name in args.preset or DEFAULT_PRESETS:
        model = build_model(get_config(name), mesh, seed=0)
        params = nnx.state(model, nnx.Param)
        state = {"params": params, "adam": optax.adam(1e-3).init(params)}
        leaves = jax.tree.leaves(state)
        mib = sum(x.size * x.dtype.itemsize for x in leaves) / 2**20
        with tempfile.TemporaryDirectory() as tmp:
            manager = ocp.CheckpointManager(
                Path(tmp), options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True)
            )
            step = iter(range(1, 10**6))

            def save(state=state, manager=manager, step=step):
                manager.save(
                    next(step),
                    args=ocp.args.Composite(
                        model_params=ocp.args.PyTreeSave(state["params"]),
                        optimizer_state=ocp.args.PyTreeSave(state["adam"]),
                    ),
                )
                manager.wait_until_finished()

            def single(save=save):
                with _compat.single_replica_array_saves():
                    save()

            save(), single()  # first saves compile Orbax's slices and warm the file system
            parallel_s, single_s = [], []
            for _ in range(args.repeats):  # alternate, so other load slows both alike
                parallel_s.append(best_time(save, 1))
                single_s.append(best_time(single, 1))
            manager.close()
        fast, slow = min(single_s), min(parallel_s)
        print(
            f"{name:<16} {len(leaves):>6} {mib:>7.1f} {slow:>11.3f}s {fast:>11.3f}s "
            f"{slow / fast:>5.1f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
