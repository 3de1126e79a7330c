"""harness.gate.chip_precision: the ``matmul_precision`` marker pins what a test compares at,
and ``--emulate-chip-precision`` multiplies float32 as a TPU does by default."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.gate import chip_precision

pytestmark = pytest.mark.host  # a CPU tool: on a TPU the default already is one bf16 pass

# float32 operands rounded to bfloat16 (8 significant bits) err by up to 2^-9 each
BF16_STEP = 2.0**-8


def _operands() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((16, 32), np.float32), rng.standard_normal((32, 8), np.float32)


def _error(precision: str | None) -> float:
    a, b = _operands()
    exact = a.astype(np.float64) @ b.astype(np.float64)
    f = jax.jit(lambda x, y: jnp.einsum("ij,jk->ik", x, y, precision=precision))
    return float(np.abs(np.asarray(f(a, b)) - exact).max() / np.abs(exact).max())


def test_emulation_rounds_default_float32_matmuls_and_leaves_pinned_ones():
    """While emulating, a default-precision float32 einsum errs as one bf16 pass does,
    an einsum at HIGHEST (or under the marker's context) as float32 does; restored, the
    CPU's float32 again."""
    restore = chip_precision.emulate()
    try:
        assert _error(None) > BF16_STEP / 16
        assert _error("highest") < 1e-6
        with jax.default_matmul_precision("highest"):
            assert _error(None) < 1e-6
    finally:
        restore()
    assert _error(None) < 1e-6


def test_the_marker_pins_the_test_and_its_fixtures(pytester, jax_started):
    """A test marked matmul_precision("highest") sees that precision in its body and in
    its fixtures' setup; an unmarked one the default."""
    pytester.makepyfile(
        """
        import jax
        import pytest

        @pytest.fixture
        def seen():
            return jax.config.jax_default_matmul_precision

        @pytest.mark.matmul_precision("highest")
        def test_marked(seen):
            assert seen == "highest"
            assert jax.config.jax_default_matmul_precision == "highest"

        def test_unmarked(seen):
            assert seen is None and jax.config.jax_default_matmul_precision is None
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=2)


@pytest.mark.parametrize(
    ("precision", "default"),
    [
        (None, True),
        (jax.lax.Precision.DEFAULT, True),
        ((jax.lax.Precision.DEFAULT, jax.lax.Precision.DEFAULT), True),
        ((None, jax.lax.Precision.DEFAULT), True),
        (jax.lax.Precision.HIGHEST, False),
        ((jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST), False),
        ((jax.lax.Precision.HIGH, jax.lax.Precision.HIGH), False),
    ],
    ids=["none", "default", "both-default", "none-default", "highest", "one-highest", "high"],
)
def test_only_a_dot_left_at_the_default_precision_is_emulated(precision, default):
    """An operand pinned above the default keeps the dot out of the emulation."""
    assert chip_precision._is_default(precision) is default


def test_the_emulated_operands_are_the_bf16_roundings_exactly():
    """While emulating, x @ y equals the float64 product of x and y rounded to bfloat16
    (to float32's summation error), not of x and y themselves."""
    a, b = _operands()
    rounded = [np.asarray(jnp.asarray(m, jnp.bfloat16), np.float64) for m in (a, b)]
    restore = chip_precision.emulate()
    try:
        got = np.asarray(jax.jit(lambda x, y: x @ y)(a, b), np.float64)
    finally:
        restore()
    np.testing.assert_allclose(got, rounded[0] @ rounded[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("args", ["()", "(1)", "('highest', 'high')", "(name='highest')"])
def test_a_marker_without_one_precision_name_is_a_usage_error(pytester, jax_started, args):
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.matmul_precision{args}
        def test_marked():
            pass
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    assert result.ret != 0
    out = result.stdout.str() + result.stderr.str()
    assert "matmul_precision takes one precision name" in out
