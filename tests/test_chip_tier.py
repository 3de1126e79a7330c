"""What a real accelerator's tier leaves out (:mod:`harness.gate.chip_tier`): the tests
marked wiring beside host, the variants a chip_sample marker does not name, each counted
with its reason; a marker naming no variant of its test fails collection everywhere."""

from __future__ import annotations

import types

import pytest

from harness.gate import chip_tier

pytestmark = pytest.mark.host

TESTS = """
import pytest

@pytest.mark.host
def test_parses_a_flag():
    pass

@pytest.mark.wiring
def test_a_field_reaches_the_model():
    pass

@pytest.mark.chip_sample("b", "c")
@pytest.mark.parametrize("variant", ["a", "b", "c", "d"])
def test_variants(variant):
    pass

def test_computes():
    pass
"""


def _backend() -> str:
    import jax

    return jax.default_backend()


@pytest.mark.parametrize(
    ("options", "host", "wiring", "variants"),
    [
        (["--host-tests", "skip"], 1, 1, None),
        (["--chip-variants", "sampled"], None, None, 2),
        (["--host-tests", "skip", "--chip-variants", "sampled"], 1, 1, 2),
        (["--host-tests", "run", "--chip-variants", "all"], None, None, None),
        ([], None, None, None),  # auto, on this CPU: everything runs
    ],
    ids=["host-skip", "sampled", "both", "run-all", "auto-cpu"],
)
def test_each_marker_leaves_its_tests_out_and_counts_them(
    jax_started, pytester: pytest.Pytester, options, host, wiring, variants
) -> None:
    pytester.makepyfile(TESTS)
    result = pytester.runpytest(*options, "-p", "no:cacheprovider", "-v")
    left = (host or 0) + (wiring or 0) + (variants or 0)
    result.assert_outcomes(passed=7 - left, deselected=left)
    backend = _backend()
    for name, count, what, why in (
        ("host", host, "tests", "host code only"),
        ("wiring", wiring, "tests", "a value reaching where it acts"),
        ("chip_sample", variants, "variants of tests", "variants the CPU tier runs"),
    ):
        line = f"*left out {count} {what} marked {name} on {backend}: {why}*"
        if count is None:
            result.stdout.no_fnmatch_line(f"*marked {name} on*")
        else:
            result.stdout.fnmatch_lines([line])
    if variants:  # the named variants are the ones that ran
        result.stdout.fnmatch_lines_random(
            ["*test_variants?b? PASSED*", "*test_variants?c? PASSED*"]
        )
        result.stdout.no_fnmatch_line("*test_variants?a? PASSED*")
        result.stdout.no_fnmatch_line("*test_variants?d? PASSED*")


@pytest.mark.parametrize(
    ("marked", "message"),
    [
        (
            '@pytest.mark.chip_sample("b", "f", "e")\n@pytest.mark.parametrize("v", ["a", "b"])\n'
            "def test_v(v):\n    pass\n",
            "*::test_v: chip_sample names e, f; its variants are a, b",
        ),
        (
            '@pytest.mark.chip_sample("a")\ndef test_v():\n    pass\n',
            "*::test_v: chip_sample on a test without variants",
        ),
        (
            '@pytest.mark.chip_sample()\n@pytest.mark.parametrize("v", ["a"])\n'
            "def test_v(v):\n    pass\n",
            "*::test_v: chip_sample takes the ids of the variants the chip runs, got ()*",
        ),
        (
            '@pytest.mark.chip_sample("a", only=True)\n@pytest.mark.parametrize("v", ["a"])\n'
            "def test_v(v):\n    pass\n",
            "*::test_v: chip_sample takes the ids of the variants the chip runs, got ('a',) "
            "{'only': True}",
        ),
        (
            '@pytest.mark.chip_sample("a", 3)\n@pytest.mark.parametrize("v", ["a"])\n'
            "def test_v(v):\n    pass\n",
            "*::test_v: chip_sample takes the ids of the variants the chip runs, got ('a', 3) {}",
        ),
    ],
    ids=["unknown-id", "no-variants", "no-ids", "keywords", "not-text"],
)
def test_a_marker_naming_no_variant_fails_collection_on_every_backend(
    jax_started, pytester: pytest.Pytester, marked, message
) -> None:
    """On this CPU too (where every variant runs), so the gate catches a renamed variant
    before a chip runs none of its test."""
    # after a class and an unmarked test: the check reads the whole module
    first = (
        "class TestFirst:\n    def test_in_a_class(self):\n        pass\n\n\n"
        "def test_first():\n    pass\n\n\n"
    )
    pytester.makepyfile("import pytest\n\n" + first + marked + "\n\ndef test_other():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(
        ["*ERROR collecting*", message.replace("*::", "*posttrain-harness: *::")]
    )
    result.assert_outcomes(errors=1)


def test_a_node_id_of_one_variant_still_knows_every_variant(
    jax_started, pytester: pytest.Pytester
) -> None:
    """Naming one variant on the command line narrows the run, not the check: the marker
    names another variant, which the module has."""
    path = pytester.makepyfile(TESTS)
    result = pytester.runpytest(f"{path.name}::test_variants[a]", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize("backend", ["tpu", "gpu", "cpu"])
@pytest.mark.parametrize(
    ("option", "value", "decides"),
    [
        ("host_tests", "auto", chip_tier.leaves_out_host_tests),
        ("chip_variants", "auto", chip_tier.samples_variants),
    ],
    ids=["host", "variants"],
)
def test_auto_leaves_out_on_accelerators_only(backend, option, value, decides) -> None:
    config = types.SimpleNamespace(getoption=lambda name: {option: value}[name])
    assert decides(config, backend) is (backend != "cpu")


def test_a_tier_that_leaves_out_none_says_so_for_host_only(jax_started, pytester) -> None:
    """Leaving out on, nothing marked: one line, ``left out 0 tests marked host``, and
    none for wiring or chip_sample."""
    pytester.makepyfile("def test_a():\n    pass\n")
    result = pytester.runpytest(
        "--host-tests", "skip", "--chip-variants", "sampled", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*left out 0 tests marked host on *"])
    result.stdout.no_fnmatch_line("*marked wiring*")
    result.stdout.no_fnmatch_line("*marked chip_sample*")


@pytest.mark.parametrize("backend", ["tpu", "cpu"])
def test_select_on_a_chip_leaves_out_each_kind_and_on_the_cpu_none(
    jax_started, pytester, backend
) -> None:
    """:func:`chip_tier.select` with the options' defaults (auto), given the backend: on a
    TPU the host and wiring tests and the unnamed variants go, counted per marker."""
    items = pytester.getitems(TESTS)
    config = items[0].config
    kept = list(items)
    counts = chip_tier.select(config, kept, backend)
    if backend == "tpu":
        assert counts == {"host": 1, "wiring": 1, "chip_sample": 2}
        assert [i.name for i in kept] == ["test_variants[b]", "test_variants[c]", "test_computes"]
    else:
        assert counts == {} and kept == items
