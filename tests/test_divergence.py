"""harness.tools.divergence: where float32 error enters, CPU against CPU with one side's
matmuls rounded to bfloat16 (a TPU's default pass); unperturbed, no error anywhere."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.gate import chip_precision
from harness.tools import divergence as dv
from tests import divergence_cases
from tests.cli_help import help_text

# CPU against CPU by design: on a chip the command itself is the check (docs/testing.md)
pytestmark = pytest.mark.host

# float32 operands rounded to bfloat16 err by up to 2^-9 each: a matmul's relative error
# lies well within a factor 8 of that
BF16_LOW, BF16_HIGH = 2.0**-12, 2.0**-6

RNG = np.random.default_rng(0)
X = RNG.standard_normal((8, 24), np.float32)
W = RNG.standard_normal((24, 5), np.float32)
OFFSET = RNG.standard_normal((5,), np.float32)  # a constant that call bodies close over
MASK = np.tril(np.ones((8, 5), bool), 1)  # [8, 5]: a causal-looking mask, never a full row


def sides() -> tuple[jax.Device, jax.Device]:
    """(compared, reference): the last and first CPU devices (two of the 8 fake ones)."""
    cpu = jax.devices("cpu")
    return cpu[-1], cpu[0]


def line_of(marker: str) -> int:
    """The line of this file whose text holds ``marker`` (a source that rows must name)."""
    lines = Path(__file__).read_text().splitlines()
    (found,) = [n for n, text in enumerate(lines, 1) if marker in text and "line_of" not in text]
    return found


def scores(x, w):
    """A matmul, then what follows one in the models: a masked softmax at scale 4 (its
    ``exp`` passes on more error than it is given), GELU-tanh, an RMS norm, a key, an
    argmax, a callback (no output)."""
    h = x @ w  # the matmul
    jax.debug.callback(lambda _: None, h)
    s = jnp.where(MASK, 4.0 * h, jnp.finfo(jnp.float32).min)  # [8, 5]
    p = jnp.exp(s - jax.lax.stop_gradient(s.max(-1, keepdims=True)))
    p = p / p.sum(-1, keepdims=True)
    g = jax.nn.gelu(h, approximate=True)
    n = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + 1e-6)
    noise = jax.random.normal(jax.random.key(0), (5,))
    return p, n + noise, jnp.argmax(x, axis=-1)


def test_unperturbed_every_error_is_zero_and_the_sides_are_where_asked():
    """The same program on two CPU devices: every output's error 0, no equation named;
    the result names the devices each side ran on."""
    device, reference = sides()
    found = dv.divergence(scores, X, W, device=device, reference_device=reference)
    assert found.outputs == (0.0, 0.0, 0.0)
    assert found.rows == ()
    assert (found.device, found.reference) == (f"cpu:{device.id}", f"cpu:{reference.id}")
    assert found.equations > 20  # gelu's and argmax's bodies inlined, equation by equation


def test_by_default_the_default_device_against_the_first_cpu(monkeypatch):
    """Unasked, the compared side is the default backend's first device and the reference
    the first CPU device (here the CPU devices listed in reverse: the last one)."""
    listed = jax.devices
    monkeypatch.setattr(jax, "devices", lambda kind=None: listed(kind)[:: -1 if kind else 1])
    found = dv.divergence(lambda x: x * 2.0, X)
    assert (found.device, found.reference) == ("cpu:0", f"cpu:{listed('cpu')[-1].id}")


def test_a_rounded_matmul_is_named_and_nothing_downstream():
    """With the compared side's matmuls at one bfloat16 pass, the matmul is the one
    equation named (its line, its operands' shapes, no error carried in), though the
    softmax's exp carries more error out than the matmul made."""
    device, reference = sides()
    found = dv.divergence(
        scores, X, W, device=device, reference_device=reference, bf16_matmuls=True
    )
    (row,) = found.rows
    assert row.primitive == "dot_general"
    assert re.fullmatch(
        rf".*test_divergence\.py:{line_of('# the matmul')}:\d+ \(scores\)", row.source
    )
    assert row.shapes == ((8, 24), (24, 5))
    assert row.input_error == 0.0
    assert BF16_LOW < row.own_error < BF16_HIGH
    assert row.output_error == pytest.approx(row.own_error, rel=1e-3)  # no error carried in
    assert found.outputs[0] > 2 * row.own_error  # the softmax's exp amplified it
    assert found.outputs[1] > 0 and found.outputs[2] == 0.0  # the argmax of x: untouched


def test_the_rounding_is_the_gate_s_chip_emulation():
    """``bf16_matmuls`` perturbs as ``--emulate-chip-precision`` does at the default
    precision: the same output errors, to a few float32 roundings."""
    device, reference = sides()

    def f(x, w):
        return jnp.tanh(x @ w).sum(-1)

    found = dv.divergence(f, X, W, device=device, reference_device=reference, bf16_matmuls=True)
    plain = np.asarray(jax.jit(f)(X, W))
    restore = chip_precision.emulate()
    try:
        emulated = np.asarray(jax.jit(f)(X, W))
    finally:
        restore()
    np.testing.assert_allclose(found.outputs[0], dv.relative_error(emulated, plain), rtol=1e-3)


def _custom_jvp(f):
    wrapped = jax.custom_jvp(f)
    wrapped.defjvp(lambda primals, tangents: (f(*primals), tangents[0]))
    return wrapped


def _custom_vjp(f):
    wrapped = jax.custom_vjp(f)
    wrapped.defvjp(lambda *a: (f(*a), a), lambda a, g: (g, g))
    return wrapped


CALLS = {
    "jit": jax.jit,
    "remat": jax.checkpoint,
    "custom_jvp": _custom_jvp,
    "custom_vjp": _custom_vjp,
}


@pytest.mark.parametrize("wrap", CALLS.values(), ids=CALLS.keys())
def test_a_call_s_body_is_compared_equation_by_equation(wrap):
    """A matmul inside a jit, remat, custom_jvp or custom_vjp call (whose body closes over
    a constant) is named itself, at its own line, not the call."""

    def inner(x, w):
        return jnp.tanh(x @ w) + OFFSET  # inside the call

    device, reference = sides()
    found = dv.divergence(
        lambda x, w: wrap(inner)(x, w) * 2.0,
        X,
        W,
        device=device,
        reference_device=reference,
        bf16_matmuls=True,
    )
    (row,) = found.rows
    assert (row.primitive, row.source.split(":")[1]) == (
        "dot_general",
        str(line_of("# inside the call")),
    )
    assert row.output_error == pytest.approx(row.own_error, rel=1e-3)  # rounded in the run too


def test_integer_matmuls_are_left_alone():
    """``bf16_matmuls`` rounds float32 operands only: an int32 matmul (values past
    bfloat16's 256) stays exact."""
    device, reference = sides()
    a = np.arange(12, dtype=np.int32).reshape(3, 4) * 301
    b = np.arange(20, dtype=np.int32).reshape(4, 5) + 257
    found = dv.divergence(
        lambda a, b: a @ b, a, b, device=device, reference_device=reference, bf16_matmuls=True
    )
    assert (found.outputs, found.rows) == ((0.0,), ())


def test_an_equation_s_input_error_is_its_operands_largest():
    """Downstream of a rounded matmul an equation's own error is 0 and not named; one that
    adds error of its own (a second matmul) is, with the first one's error carried in."""
    device, reference = sides()
    found = dv.divergence(
        lambda x, w: (x @ w) @ w.T,
        X,
        W,
        device=device,
        reference_device=reference,
        bf16_matmuls=True,
    )
    first, second = found.rows
    assert first.input_error == 0.0
    assert second.input_error == first.output_error > 0
    assert second.shapes == ((8, 5), (5, 24))
    assert found.outputs == (second.output_error,)


def test_one_rounding_apart_is_not_named():
    """An own error of exactly float32's epsilon (1 + 2^-23 against 1) names nothing:
    ``[1 - 2^-23, 2^-23] . [1, 1]`` is 1, rounded to bfloat16 it is 1 + 2^-23."""
    device, reference = sides()
    x = np.array([[1 - 2.0**-23, 2.0**-23]], np.float32)
    found = dv.divergence(
        jnp.matmul,
        x,
        np.ones((2, 1), np.float32),
        device=device,
        reference_device=reference,
        bf16_matmuls=True,
    )
    assert (found.outputs, found.rows) == ((dv.FLOOR,), ())


def test_an_equation_of_constants_carries_no_error_in():
    """A matmul of two constants (no operand computed) is named with 0 carried in."""
    device, reference = sides()
    found = dv.divergence(
        lambda x: x + jnp.asarray(X) @ jnp.asarray(W),
        np.zeros(5, np.float32),
        device=device,
        reference_device=reference,
        bf16_matmuls=True,
    )
    (row,) = found.rows
    assert (row.primitive, row.input_error) == ("dot_general", 0.0)
    assert row.output_error == pytest.approx(row.own_error, rel=1e-3)


F32 = np.float32
BF16 = jnp.bfloat16  # a NumPy dtype (ml_dtypes): no JAX array at collection
ERRORS = {
    "equal": ([1.0, 2.0], [1.0, 2.0], 0.0),
    "of the largest": ([1.5, -4.0], [1.0, -2.0], 1.0),
    # a mask alike on both sides sets no scale
    "mask ignored": ([-3e38, 1.25], [-3e38, 1.0], 0.25),
    "both nan": ([np.nan, 1.0], [np.nan, 1.0], 0.0),
    "same infinity": ([np.inf, 3.0], [np.inf, 2.0], 0.5),
    "nan against a number": ([np.nan, 1.0], [1.0, 1.0], np.inf),
    "infinity against a number": ([np.inf, 1.0], [1.0, 1.0], np.inf),
    "an infinite reference: infinite, not NaN": ([1.0, 3.0], [np.inf, 2.0], np.inf),
    "only an infinite reference differs": ([1.0, 2.0], [np.inf, 2.0], np.inf),
    "zero reference": ([1e-30], [0.0], float(F32(1e-30)) / np.finfo(np.float64).tiny),
    "empty": ([], [], 0.0),
    "bfloat16": (np.array([3.0], BF16), np.array([2.0], BF16), 0.5),
    "ints equal": (np.array([3, 4]), np.array([3, 4]), 0.0),
    "ints differ": (np.array([3, 4]), np.array([3, 5]), 1.0),
    "bools differ": (np.array([True]), np.array([False]), 1.0),
    "keys equal": (1, 1, 0.0),  # PRNG keys of these seeds, made in the test
    "keys differ": (1, 2, 1.0),
}


@pytest.mark.parametrize(("value", "reference", "expected"), ERRORS.values(), ids=ERRORS.keys())
def test_relative_error(value, reference, expected):
    """max |difference| / max |reference| over the positions that differ (a NaN or an
    infinity against a number: infinite); other dtypes 0 or 1."""
    if isinstance(value, int):
        value, reference = jax.random.key(value), jax.random.key(reference)
    elif isinstance(value, list):
        value, reference = np.array(value, F32), np.array(reference, F32)
    assert dv.relative_error(value, reference) == expected


def _found(*rows, device="tpu:0") -> dv.Divergence:
    return dv.Divergence(device, "cpu:0", 31, (2.25e-5, 0.0), rows)


def _row(primitive, own, source="/elsewhere/loss.py:12:3 (f)") -> dv.Row:
    return dv.Row(primitive, source, own, own / 4, own * 2, ((2, 3, 3), ()))


def test_the_report_prints_the_worst_first_up_to_top(monkeypatch, tmp_path):
    """The sides, the outputs' errors, then the ``top`` rows by own error, sources under
    the current directory relative to it."""
    monkeypatch.chdir(tmp_path)
    inside = f"{tmp_path}/src/loss.py:40:1 (g)"
    found = _found(_row("log", 1.7e-5), _row("log1p", 3.4e-5, inside), _row("exp", 1e-6))
    assert dv.report("dpo-loss", found, top=2) == [
        "dpo-loss: tpu:0 against cpu:0, 31 equations",
        "outputs' relative error: 2.25e-05, 0.00e+00",
        "equations that introduce error (their own error > 1.19e-07): 3, the 2 worst "
        "(own, carried in, carried out):",
        "  log1p          3.40e-05 8.50e-06 6.80e-05  [2,3,3] []  src/loss.py:40:1 (g)",
        "  log            1.70e-05 4.25e-06 3.40e-05  [2,3,3] []  /elsewhere/loss.py:12:3 (f)",
    ]


@pytest.mark.parametrize(
    ("device", "bf16", "note"),
    [
        ("cpu:0", False, "both sides run on the CPU: expect 0 (--bf16-matmuls perturbs one)"),
        ("cpu:1", True, "the compared side's float32 matmul operands rounded to bfloat16"),
        ("tpu:0", True, "the compared side's float32 matmul operands rounded to bfloat16"),
        ("tpu:0", False, None),
    ],
    ids=["cpu", "cpu-bf16", "tpu-bf16", "tpu"],
)
def test_the_report_says_what_was_compared(device, bf16, note):
    """On the CPU against itself it says to expect 0; with the rounding, that it rounded;
    a chip's report has neither line; no row, no list."""
    lines = dv.report("x", _found(device=device), top=12, bf16_matmuls=bf16)
    assert lines[1:-2] == ([note] if note else [])
    assert lines[-1] == "equations that introduce error (their own error > 1.19e-07): 0"


def test_the_command_names_a_case_s_matmuls(capsys):
    """``--case gemma4-routing --bf16-matmuls``: says it rounded, names the MoE's
    matmuls, ``--top`` rows."""
    assert dv.main(["--case", "gemma4-routing", "--bf16-matmuls", "--top", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    reference = jax.devices("cpu")[0].id
    assert re.fullmatch(rf"gemma4-routing: cpu:0 against cpu:{reference}, \d+ equations", lines[0])
    assert lines[1] == "the compared side's float32 matmul operands rounded to bfloat16"
    assert re.fullmatch(r".*: \d+, the 2 worst \(own, carried in, carried out\):", lines[3])
    assert len(lines) == 6
    for line in lines[4:]:
        assert line.startswith("  dot_general ") and "posttrain/layers/moe/" in line


@pytest.mark.parametrize(("top", "shown"), [([], 12), (["--top", "1"], 1)], ids=["12", "1"])
def test_the_command_prints_twelve_rows_unless_told(monkeypatch, capsys, top, shown):
    """Of 13 rounded matmuls, the 12 worst without ``--top``, or as many as it says (1)."""
    m = RNG.standard_normal((24, 24), np.float32) / 5

    def case(name):
        return lambda x: functools.reduce(lambda a, _: a @ m, range(13), x), (X,)

    monkeypatch.setattr(divergence_cases, "case", case)
    assert dv.main(["--case", "dpo-loss", "--bf16-matmuls", *top]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[3].endswith(f": 13, the {shown} worst (own, carried in, carried out):")
    assert len(lines) == 4 + shown


def test_the_help_says_each_option(capsys):
    """``--help``: the module's description and each option's help."""
    text = " ".join(help_text(dv.main, capsys).split())
    assert "Where a computation's float32 error enters:" in text
    assert text.endswith(
        "--case CASE dpo-loss, gemma4-routing, forward:PRESET "
        "--top TOP equations printed (default 12) "
        "--matmul-precision {default,high,highest} "
        "jax.default_matmul_precision while tracing and running (default: highest) "
        "--bf16-matmuls round the compared side's float32 matmul operands to bfloat16"
    )


def test_the_command_runs_the_dpo_case_at_zero_on_the_cpu(capsys):
    """``--case dpo-loss`` on the CPU: both sides the CPU, every figure 0."""
    pytest.importorskip("tunix.sft.peft_trainer", reason="google-tunix is not installed")
    assert dv.main(["--case", "dpo-loss"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "both sides run on the CPU: expect 0 (--bf16-matmuls perturbs one)",
        "outputs' relative error: 0.00e+00, 0.00e+00, 0.00e+00",
        "equations that introduce error (their own error > 1.19e-07): 0",
    ]


@pytest.mark.parametrize("precision", [None, "default"], ids=["highest", "default"])
def test_the_case_is_built_and_traced_at_the_asked_precision(monkeypatch, capsys, precision):
    """``--matmul-precision`` (default ``highest``, as the tests pin) holds while the case
    is built and traced."""
    seen = []

    def case(name):
        seen.append((name, jax.config.jax_default_matmul_precision))
        return lambda x: seen.append(jax.config.jax_default_matmul_precision) or x * 2, (X,)

    monkeypatch.setattr(divergence_cases, "case", case)
    argv = ["--case", "forward:llama3-tiny"]
    assert dv.main(argv + (["--matmul-precision", precision] if precision else [])) == 0
    want = precision or "highest"
    assert seen == [("forward:llama3-tiny", want), want]


BAD = {
    "case": (
        ["--case", "nope"],
        "--case 'nope': not one of dpo-loss, gemma4-routing, forward:PRESET",
    ),
    "preset": (
        ["--case", "forward:nope"],
        "--case 'forward:nope': no preset 'nope'; one of llama3-8b, ",
    ),
    "no preset": (["--case", "forward:"], "--case 'forward:': no preset ''; one of llama3-8b, "),
    "top": (["--case", "dpo-loss", "--top", "0"], "--top 0: at least 1"),
    "no case": (["--top", "3"], "the following arguments are required: --case"),
    "precision": (
        ["--case", "dpo-loss", "--matmul-precision", "fast"],
        "argument --matmul-precision: invalid choice: 'fast'",
    ),
}


@pytest.mark.parametrize(("argv", "message"), BAD.values(), ids=BAD.keys())
def test_bad_input_is_one_line_naming_it_and_exit_2(capsys, argv, message):
    """An unknown case, preset (the choices listed) or precision, no case, a --top below 1:
    one line, 2."""
    with pytest.raises(SystemExit) as exited:
        dv.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"python -m harness.tools.divergence: error: {message}")
    if "preset" in message:
        assert all(name in err for name in divergence_cases.presets())
