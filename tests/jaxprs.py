"""Test helpers: what a traced program (a jaxpr) holds, sub-jaxprs (scan, cond, jit,
custom_vjp bodies) included: primitives with their operand dtypes, matmuls, named scopes."""

from __future__ import annotations

import jax.numpy as jnp


def equations(jaxpr):
    """Every equation, each followed by those of its sub-jaxprs (scan, cond, jit bodies)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn.params):
            yield from equations(sub)


def primitive_dtypes(jaxpr) -> list[tuple[str, str]]:
    """``(primitive, operand dtype)`` of every equation, sub-jaxprs (scan, jit, cond) included."""
    return [
        (eqn.primitive.name, str(var.aval.dtype))
        for eqn in equations(jaxpr)
        for var in eqn.invars
        if hasattr(getattr(var, "aval", None), "dtype")
    ]


def sub_jaxprs(params: dict):
    """The jaxprs an equation's params hold (scan/cond/pjit/custom_vjp bodies)."""
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            inner = getattr(item, "jaxpr", item)  # a ClosedJaxpr holds a Jaxpr
            if hasattr(inner, "eqns"):
                yield inner


def matmuls(jaxpr) -> list[tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]]:
    """``(operand shapes, float operand dtypes)`` of every dot_general / ragged_dot_general,
    sub-jaxprs (scan, cond, jit) included."""
    out = []
    for eqn in equations(jaxpr):
        if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
            avals = [v.aval for v in eqn.invars if hasattr(getattr(v, "aval", None), "shape")]
            floats = tuple(str(a.dtype) for a in avals if jnp.issubdtype(a.dtype, jnp.floating))
            out.append((tuple(a.shape for a in avals), floats))
    return out


def reading(jaxpr, *dims: int) -> list[tuple[str, ...]]:
    """The float operand dtypes of every matmul with one of ``dims`` in an operand's shape."""
    return [dtypes for shapes, dtypes in matmuls(jaxpr) if any(set(dims) & set(s) for s in shapes)]


def scoped_primitives(jaxpr) -> dict[str, set[str]]:
    """Scope name -> the primitives of the equations under it, sub-jaxprs included."""
    out: dict[str, set[str]] = {}
    for eqn in equations(jaxpr):
        for scope in str(eqn.source_info.name_stack).split("/"):
            out.setdefault(scope, set()).add(eqn.primitive.name)
    return out
