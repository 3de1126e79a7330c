"""Where a computation's float32 error enters: each of its equations run on one device and on
a reference device, and those that add error of their own named.

``python -m harness.tools.divergence --case CASE [--top N] [--matmul-precision P]
[--bf16-matmuls]`` (docs/testing.md, "On a real chip") runs a case of
``tests/divergence_cases.py`` (``dpo-loss``, ``gemma4-routing``, ``forward:PRESET``) on the
default backend's first device against the CPU and prints each output's relative error,
then the equations that introduce error, worst first: primitive, its own error, the error
it carried in and out, operand shapes, source line. On a machine without an accelerator
both sides are the CPU and every figure is 0 unless ``--bf16-matmuls`` rounds the compared
side's float32 matmul operands to bfloat16 (one bfloat16 pass, a TPU's default
precision): then the matmuls are named. Bad input: one line naming it, exit 2.

How (:func:`divergence`): the function is traced to a jaxpr whose calls (``jit``,
``custom_jvp`` / ``custom_vjp``, ``remat``) are inlined, so their bodies' equations are
the ones compared; a loop (``scan``, ``while``) or ``cond`` stays one equation. Each
device runs two jitted programs: the whole run, returning every intermediate value (the
error each carries), and every equation alone on the reference's values of its operands
(the error it adds itself, its own error, free of what it was handed and of how XLA fused
it with its neighbours). An equation introduces error when its own error exceeds
:data:`FLOOR`; errors are :func:`relative_error`'s.

An equation's error in the whole run says less: an ill-conditioned one passes on more
error than it is given without adding any. On this CPU with ``--bf16-matmuls``,
``forward:gemma4-tiny``'s attention ``exp`` carried 1.6e-2 in and 1.7e-1 out (the scores'
absolute error becomes the probabilities' relative error), its own error 0.

Its first form, a script that named the equations whose error in the whole run grew 8x past
their operands', put the v5e's error in the DPO loss at ``log1p`` and ``log`` and in the
Gemma 4 forward at ``exp`` and ``tanh`` (docs/testing.md, "The fourth session's runs").
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core, source_info_util

from posttrain import flags

FLOOR = float(np.finfo(np.float32).eps)  # 1.19e-7
"""An equation's own error above which it introduces error: two float32 results one
rounding apart differ by at most epsilon of the larger, so they never pass it."""
PRECISIONS = ("default", "high", "highest")
"""``--matmul-precision``'s choices (``jax.default_matmul_precision``'s names); the tests
pin ``highest``, the default."""

# call primitives whose body is inlined -> the parameter that holds it, a ClosedJaxpr (remat2:
# a Jaxpr); jax 0.10.2's names
_CALLS = {
    "jit": "jaxpr",
    "remat2": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
}


class Row(NamedTuple):
    """An equation that introduces error.

    Attributes:
      primitive: its primitive's name (``log1p``, ``dot_general``).
      source: the line that made it, ``file:line:column (function)``.
      own_error: its outputs' largest relative error when both sides run it on the
        reference's inputs: the error it adds itself.
      input_error: its operands' largest relative error in the whole run.
      output_error: its outputs' largest relative error in the whole run.
      shapes: its operands' shapes.
    """

    primitive: str
    source: str
    own_error: float
    input_error: float
    output_error: float
    shapes: tuple[tuple[int, ...], ...]


class Divergence(NamedTuple):
    """What :func:`divergence` found.

    Attributes:
      device: where the compared side ran, ``platform:id`` (``tpu:0``).
      reference: where the reference side ran (``cpu:0``).
      equations: how many equations ran (calls inlined).
      outputs: each output leaf's relative error, in ``jax.tree_util`` order.
      rows: the equations that introduce error, in program order.
    """

    device: str
    reference: str
    equations: int
    outputs: tuple[float, ...]
    rows: tuple[Row, ...]


class _Record(NamedTuple):
    eqn: Any  # the equation (a jax.extend.core.JaxprEqn)
    inputs: tuple[int | None, ...]  # each operand's value slot; None: a literal or constant
    constants: tuple  # each operand's value where its slot is None
    outputs: tuple[int, ...]  # its outputs' value slots


def relative_error(value, reference) -> float:
    """``max |value - reference| / max |reference|`` of floating arrays over the positions
    where they differ; of other dtypes (PRNG keys: their data) 0 when equal, else 1.

    A position equal on both sides (the same infinity, both NaN included) carries no error
    and sets no scale: a mask's ``finfo.min`` or a padding's zeros, alike on both sides,
    would otherwise hide the error of the values beside them. A NaN against a number is
    infinite error."""
    if jnp.issubdtype(reference.dtype, jax.dtypes.prng_key):
        value, reference = jax.random.key_data(value), jax.random.key_data(reference)
    a, b = np.asarray(value), np.asarray(reference)
    if not jnp.issubdtype(b.dtype, jnp.floating):
        return 0.0 if np.array_equal(a, b) else 1.0
    a, b = a.astype(np.float64), b.astype(np.float64)
    differ = (a != b) & ~(np.isnan(a) & np.isnan(b))
    if not differ.any():
        return 0.0
    difference = np.abs(a[differ] - b[differ])
    difference = np.where(np.isnan(difference), np.inf, difference)
    scale = np.max(np.abs(b[differ & np.isfinite(b)]), initial=0.0)
    return float(np.max(difference) / max(scale, np.finfo(np.float64).tiny))


def _bind(eqn, operands: list, bf16_matmuls: bool) -> list:
    """``eqn``'s outputs on ``operands`` (a float32 matmul's rounded to bfloat16 first when
    ``bf16_matmuls``)."""
    if bf16_matmuls and eqn.primitive.name == "dot_general":
        operands = [
            x.astype(jnp.bfloat16).astype(jnp.float32) if x.dtype == jnp.float32 else x
            for x in operands
        ]
    result = eqn.primitive.bind(*operands, **eqn.params)
    return list(result) if eqn.primitive.multiple_results else [result]


def _evaluate(jaxpr, consts, args, values: list, records: list, bf16_matmuls: bool) -> list:
    """Binds each equation of ``jaxpr`` to ``args`` (``(value, slot or None)`` each), calls
    inlined; appends every output to ``values`` and a :class:`_Record` per equation to
    ``records``; returns the outputs as ``(value, slot or None)``."""
    env = {}

    def read(var):
        return (var.val, None) if isinstance(var, core.Literal) else env[var]

    env.update((var, (c, None)) for var, c in zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        operands = [read(var) for var in eqn.invars]
        if eqn.primitive.name in _CALLS:  # its body's inputs are the call's last operands
            body = eqn.params[_CALLS[eqn.primitive.name]]
            inner, consts = (
                (body.jaxpr, body.consts) if isinstance(body, core.ClosedJaxpr) else (body, ())
            )
            given = operands[len(operands) - len(inner.invars) :]
            outs = _evaluate(inner, consts, given, values, records, bf16_matmuls)
        else:
            result = _bind(eqn, [value for value, _ in operands], bf16_matmuls)
            slots = tuple(range(len(values), len(values) + len(result)))
            values.extend(result)
            inputs = tuple(slot for _, slot in operands)
            constants = tuple(value if slot is None else None for value, slot in operands)
            records.append(_Record(eqn, inputs, constants, slots))
            outs = list(zip(result, slots, strict=True))
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(var) for var in jaxpr.outvars]


def _where(device) -> str:
    return f"{device.platform}:{device.id}"


def _side(closed, leaves: list, device, records: list, given=None, bf16_matmuls=False):
    """One side's two jitted programs on ``device``: the whole run, then each equation
    alone from ``given`` (the reference side's values; without, this side's own).

    Returns ``(outputs, values, alone, where it ran)``: ``values[i]`` is ``leaves[i]``,
    then each equation's outputs in ``records``' order (filled in); ``alone`` each
    equation's outputs again, flat. Alone, no equation reads another's output, so XLA
    fuses none with its producer (fused, ``x / 72 + eps`` rounds otherwise than alone).
    """

    def whole(leaves):
        values = list(leaves)
        records.clear()  # a retrace records anew
        pairs = [(leaf, slot) for slot, leaf in enumerate(leaves)]
        outs = _evaluate(closed.jaxpr, closed.consts, pairs, values, records, bf16_matmuls)
        return [value for value, _ in outs], values

    def each(given):
        outs = []
        for record in records:
            operands = zip(record.inputs, record.constants, strict=True)
            outs += _bind(
                record.eqn, [given[s] if c is None else c for s, c in operands], bf16_matmuls
            )
        return outs

    outs, values = jax.jit(whole)(jax.device_put(leaves, device))
    alone = jax.jit(each)(jax.device_put(values if given is None else given, device))
    (ran,) = {d for out in [*outs, *alone] for d in out.devices()}
    return *jax.device_get((outs, values, alone)), _where(ran)


def divergence(
    fn: Callable, *args, device=None, reference_device=None, bf16_matmuls: bool = False
) -> Divergence:
    """Runs ``fn(*args)`` equation by equation on ``device`` and on ``reference_device``
    from the same inputs, and each equation on ``device`` again from the reference's
    inputs (module docstring).

    Args:
      fn: a function of arrays (pytrees of them) to arrays; traced once, under the caller's
        ``jax.default_matmul_precision``.
      args: its arguments, placed on each device in turn.
      device: the side compared (default: the default backend's first device).
      reference_device: the reference side (default: the first CPU device).
      bf16_matmuls: round ``device``'s float32 ``dot_general`` operands to bfloat16 first.

    Returns:
      The :class:`Divergence`: each output's error and the equations that introduce error.
    """
    device = device or jax.devices()[0]
    reference_device = reference_device or jax.devices("cpu")[0]
    leaves, tree = jax.tree_util.tree_flatten(args)
    closed = jax.make_jaxpr(lambda *xs: fn(*jax.tree_util.tree_unflatten(tree, xs)))(*leaves)
    records: list[_Record] = []
    want, expected, alone, reference = _side(closed, leaves, reference_device, records)
    outs, values, own, ran = _side(closed, leaves, device, records, expected, bf16_matmuls)
    errors = [relative_error(v, e) for v, e in zip(values, expected, strict=True)]
    rows = []
    pairs = zip(own, alone, strict=True)  # each equation's outputs, in order
    for record in records:
        mine = max((relative_error(*next(pairs)) for _ in record.outputs), default=0.0)
        if mine > FLOOR:
            eqn = record.eqn
            rows.append(
                Row(
                    eqn.primitive.name,
                    source_info_util.summarize(eqn.source_info),
                    mine,
                    max((errors[s] for s in record.inputs if s is not None), default=0.0),
                    max(errors[slot] for slot in record.outputs),  # a row has outputs
                    tuple(tuple(var.aval.shape) for var in eqn.invars),
                )
            )
    outputs = tuple(relative_error(o, w) for o, w in zip(outs, want, strict=True))
    return Divergence(ran, reference, len(records), outputs, tuple(rows))


def report(case: str, found: Divergence, top: int, bf16_matmuls: bool = False) -> list[str]:
    """The lines the command prints: the two sides, the outputs' errors, then the ``top``
    equations that introduce error, worst first (source paths relative to the current
    directory where they lie under it)."""
    lines = [f"{case}: {found.device} against {found.reference}, {found.equations} equations"]
    if bf16_matmuls:
        lines.append("the compared side's float32 matmul operands rounded to bfloat16")
    elif found.device.startswith("cpu:") and found.reference.startswith("cpu:"):
        lines.append("both sides run on the CPU: expect 0 (--bf16-matmuls perturbs one)")
    lines.append("outputs' relative error: " + ", ".join(f"{e:.2e}" for e in found.outputs))
    worst = sorted(found.rows, key=lambda row: -row.own_error)[:top]
    lines.append(
        f"equations that introduce error (their own error > {FLOOR:.2e}): {len(found.rows)}"
        + (f", the {len(worst)} worst (own, carried in, carried out):" if worst else "")
    )
    here = os.getcwd() + os.sep
    for row in worst:
        shapes = " ".join("[" + ",".join(map(str, shape)) + "]" for shape in row.shapes)
        lines.append(
            f"  {row.primitive:<14} {row.own_error:.2e} {row.input_error:.2e} "
            f"{row.output_error:.2e}  {shapes}  {row.source.removeprefix(here)}"
        )
    return lines


def _cases():
    """The checkout's ``tests.divergence_cases`` (the tests' own cases): imported when the
    command runs, so that the harness imports in an environment without the checkout's
    tests (``.ci/fresh_envs.py``)."""
    from tests import divergence_cases

    return divergence_cases


def _checked(name: str, parser) -> str:
    """``name`` if it is a case, else the parser's one-line error (exit 2)."""
    cases = _cases()
    preset = name.removeprefix(cases.FORWARD)
    if name in cases.CASES or (name.startswith(cases.FORWARD) and preset in cases.presets()):
        return name
    if name.startswith(cases.FORWARD):
        parser.error(f"--case {name!r}: no preset {preset!r}; one of {', '.join(cases.presets())}")
    parser.error(f"--case {name!r}: not one of {', '.join(cases.CASES)}, {cases.FORWARD}PRESET")


def main(argv: Sequence[str] | None = None) -> int:
    parser = flags.Parser(prog="python -m harness.tools.divergence", description=__doc__)
    parser.add_argument("--case", required=True, help="dpo-loss, gemma4-routing, forward:PRESET")
    parser.add_argument("--top", type=int, default=12, help="equations printed (default 12)")
    parser.add_argument(
        "--matmul-precision",
        choices=PRECISIONS,
        default="highest",
        help="jax.default_matmul_precision while tracing and running (default: highest)",
    )
    parser.add_argument(
        "--bf16-matmuls",
        action="store_true",
        help="round the compared side's float32 matmul operands to bfloat16",
    )
    args = parser.parse_args(argv)
    case = _checked(args.case, parser)
    if args.top < 1:
        parser.error(f"--top {args.top}: at least 1")
    with jax.default_matmul_precision(args.matmul_precision):
        fn, inputs = _cases().case(case)
        found = divergence(fn, *inputs, bf16_matmuls=args.bf16_matmuls)
    print("\n".join(report(case, found, args.top, args.bf16_matmuls)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
