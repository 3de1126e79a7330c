"""Matmul precision in the suites: the ``matmul_precision`` marker, and a TPU's default
precision on the CPU (``--emulate-chip-precision``).

A TPU multiplies float32 matrices at JAX's default precision in one bfloat16 pass: the
operands rounded to bfloat16, the products summed in float32. The CPU multiplies them in
float32. So a float32 comparison written on the CPU at 1e-5 fails on the chip unless it
pins the precision it compares at, which ``@pytest.mark.matmul_precision("highest")``
does: the test and its fixtures run under ``jax.default_matmul_precision``.

``--emulate-chip-precision`` makes the CPU multiply as the chip does: each
``dot_general`` left at the default precision rounds its float32 operands to bfloat16
first (a pinned one, ``precision=HIGHEST`` in the code or the marker's context, is left
alone). On 2026-12-05 a v5e and this emulation failed the same tests with the same
figures (tests/test_attention_blocks.py's ``softmax_attend`` with sinks: 1.019e-3 on
both), so a CPU run with it finds the comparisons that would fail on a chip.

Nothing here runs on import; :func:`emulate` patches ``dot_general``'s binding until
the function it returns is called.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest

MARKER = "matmul_precision"


def pinned(item: pytest.Item) -> contextlib.AbstractContextManager:
    """``jax.default_matmul_precision`` of ``item``'s ``matmul_precision(name)`` marker, or
    a context that does nothing."""
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return contextlib.nullcontext()
    if len(marker.args) != 1 or marker.kwargs or not isinstance(marker.args[0], str):
        raise pytest.UsageError(f"{item.nodeid}: {MARKER} takes one precision name")
    import jax

    return jax.default_matmul_precision(marker.args[0])


class Pinning:
    """The pytest plugin object that runs each marked test's setup and call under its
    pinned precision (registered by :mod:`harness.gate.pytest_plugin`)."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        with pinned(item):  # module fixtures compute references here
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        with pinned(item):
            return (yield)


def _is_default(precision) -> bool:
    from jax import lax

    values = precision if isinstance(precision, tuple) else (precision,)
    return all(p is None or p == lax.Precision.DEFAULT for p in values)


def emulate() -> Callable[[], None]:
    """From now on, ``dot_general`` at the default precision rounds float32 operands to
    bfloat16 before multiplying, as a TPU does; returns the function that undoes it.

    Reference: jax 0.10.2 ``jax._src.lax.lax.dot_general_p``, whose ``precision``
    parameter is ``None`` unless the call or ``jax.default_matmul_precision`` set one.
    """
    import jax
    import jax.numpy as jnp
    from jax._src.lax import lax as lax_internal

    primitive = lax_internal.dot_general_p
    kind = type(primitive)
    original = kind.bind

    def bind(self, *args, **params):
        if (
            self is primitive
            and len(args) == 2
            and _is_default(params.get("precision"))
            and all(getattr(a, "dtype", None) == jnp.float32 for a in args)
        ):
            args = tuple(
                lax_internal.convert_element_type(
                    lax_internal.convert_element_type(a, jnp.bfloat16), jnp.float32
                )
                for a in args
            )
        return original(self, *args, **params)

    # jitted functions traced before (jnp.einsum is one) would keep their programs: drop
    # them on the way in and out
    jax.clear_caches()
    kind.bind = bind

    def restore() -> None:
        kind.bind = original
        jax.clear_caches()

    return restore
