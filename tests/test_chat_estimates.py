"""``posttrain.chat.bounds``' checks called directly, each at its edge: the size a value
would have, computed by hand, is refused with exactly that length, and one item less (or
an operation the estimate does not size) passes. The sandbox hands the filters their
arguments as Jinja calls them, without what ``jinja_pass_arg`` adds:
``replace(s, old, new)``, ``join(value, d)``, ``indent(s, width)``, our
``tojson(x, ensure_ascii, indent)``, ``wordwrap(s, width, break_long_words, wrapstring)``.
The size bound is 1000 here (the module reads its bounds at each call).
tests/test_chat_sandbox.py renders the same estimates through templates."""

from __future__ import annotations

import re

import pytest

from posttrain.chat import bounds

pytestmark = pytest.mark.host

BOUND = 1000


@pytest.fixture(autouse=True)
def small(monkeypatch):
    monkeypatch.setattr(bounds, "MAX_OUTPUT_CHARS", BOUND)
    monkeypatch.setattr(bounds, "MAX_INT_BITS", 16)


def _refused(what: str, length: int):
    line = f"{what} would build a value of length {length}, over the bound of {BOUND} "
    return pytest.raises(bounds.BoundExceeded, match=f"^{re.escape(line)}\\(MAX_OUTPUT_CHARS\\)$")


def test_a_built_value_at_its_bound_is_kept_and_one_past_it_named():
    assert bounds.checked_size(1 << 15) == 1 << 15  # 16 bits
    assert bounds.checked_size("x" * BOUND) == "x" * BOUND
    with pytest.raises(bounds.BoundExceeded) as caught:
        bounds.checked_size(1 << 16)
    assert str(caught.value) == "an integer of 17 bits is over the bound of 16 (MAX_INT_BITS)"
    with pytest.raises(bounds.BoundExceeded) as caught:
        bounds.checked_size(["x"] * (BOUND + 1))
    assert str(caught.value) == (
        f"a value of length {BOUND + 1} is over the bound of {BOUND} (MAX_OUTPUT_CHARS)"
    )


def test_a_size_is_shown_whole_below_2_to_the_64_and_as_a_power_from_it():
    bounds.refuse_larger(BOUND, "x")  # at the bound: kept
    with _refused("x", 2**64 - 1):
        bounds.refuse_larger(2**64 - 1, "x")
    with _refused("x", "over 2**64"):
        bounds.refuse_larger(2**64, "x")
    with _refused("x", "over 2**70"):
        bounds.refuse_larger(2**71 - 1, "x")


def test_replace_is_sized_by_its_occurrences_of_old():
    """'ab' x 5 with 'b' -> 'y' x 200: 10 + 5 x 199 = 1005; an empty old matches between
    every two characters and at both ends: 9 + 10 x 100 = 1009."""
    with _refused("replace()", 1005):
        bounds.estimate("replace", "ab" * 5, ("b", "y" * 200), {}, "replace()")
    with _refused("replace()", 1009):
        bounds.estimate("replace", "a" * 9, ("", "x" * 100), {}, "replace()")
    with _refused("filter replace", 1009):
        bounds.estimate_filter("replace", ("a" * 9, "", "x" * 100), {})


def test_replace_that_cannot_grow_or_with_other_than_strings_is_left_to_python():
    """A replacement no longer than what it replaces (the receiver itself may be over the
    bound: it exists already), a non-string old or new, a method other than replace with
    two strings (format's arguments), none of these is estimated."""
    long = "a" * (BOUND + 1)
    bounds.estimate("replace", long, ("a", "b"), {}, "replace()")
    bounds.estimate("replace", "a" * 10, (["a"], "y" * 2000), {}, "replace()")
    bounds.estimate("replace", "a" * 10, ("a", ["y"] * 2000), {}, "replace()")
    bounds.estimate("format", "{}{}", ("", "y" * 600), {}, "format()")


def test_expandtabs_is_sized_by_its_tabs_only_when_given_a_tab_size():
    """Ten tabs of 100 and 5 other characters: 1005; without a size, another method, or
    bytes: not estimated."""
    text = "\t" * 10 + "x" * 5
    with _refused("expandtabs()", 1015):
        bounds.estimate("expandtabs", text, (100,), {}, "expandtabs()")
    bounds.estimate("expandtabs", text, (), {}, "expandtabs()")
    bounds.estimate("zfill", "\t", (2000,), {}, "zfill()")
    bounds.estimate("expandtabs", b"\t" * 10, (2000,), {}, "expandtabs()")


def test_join_counts_its_separator_given_by_name_and_none_by_default():
    items = ["a" * 500, "b" * 499]
    with _refused("filter join", 1001):
        bounds.estimate_filter("join", (items,), {"d": "xy"})
    bounds.estimate_filter("join", (items,), {})  # 999: no separator by default
    bounds.estimate_filter("join", (), {})  # nothing to join


def test_one_item_of_a_range_is_joined_without_a_separator():
    bounds.estimate_filter("join", (range(1), "x" * (BOUND + 1)), {})
    with _refused("filter join", 1001):
        bounds.estimate_filter("join", (range(2), "x" * 1001), {})


def test_indent_adds_its_width_to_every_line():
    """'ab\\ncd' at width 500: 5 + 2 x 500 = 1005, positional or by name; by default 4:
    999 newlines give 999 + 1000 x 4; a string width counts its characters; any other
    width is left to Jinja (which refuses it)."""
    with _refused("filter indent", 1005):
        bounds.estimate_filter("indent", ("ab\ncd", 500), {})
    with _refused("filter indent", 1005):
        bounds.estimate_filter("indent", ("ab\ncd",), {"width": 500})
    with _refused("filter indent", 999 + 1000 * 4):
        bounds.estimate_filter("indent", ("\n" * 999,), {})
    with _refused("filter indent", 5 + 2 * 600):
        bounds.estimate_filter("indent", ("ab\ncd", "-" * 600), {})
    bounds.estimate_filter("indent", ("\n" * 999, 5000.0), {})


def test_format_filter_checks_the_widths_of_its_format():
    with _refused("filter format width", 2000):
        bounds.estimate_filter("format", ("%2000d",), {})


def test_tojson_takes_its_indent_by_position_or_name():
    """Two items at an indent of 600: 1200; our tojson's indent is its third argument."""
    with _refused("filter tojson", 1200):
        bounds.estimate_filter("tojson", ([1, 2], False, 600), {})
    with _refused("filter tojson", 1200):
        bounds.estimate_filter("tojson", ([1, 2], False), {"indent": 600})


def test_wordwrap_adds_a_wrapstring_after_each_line():
    """790 characters at the default width of 79 with a 20-character wrapstring: 790 + 11
    x 20 = 1010 (at 80: 990); width 1 (and 0: taken as 1) gives a line a character; no
    wrapstring (Jinja's newline) is not estimated; truncate's fourth argument is no
    wrapstring."""
    text = "x" * 790
    with _refused("filter wordwrap", 1010):
        bounds.estimate_filter("wordwrap", (text,), {"wrapstring": "y" * 20})
    with _refused("filter wordwrap", 790 + 80 * 3):
        bounds.estimate_filter("wordwrap", (text, 10), {"wrapstring": "yyy"})
    with _refused("filter wordwrap", 790 + 80 * 3):
        bounds.estimate_filter("wordwrap", (text,), {"width": 10, "wrapstring": "yyy"})
    with _refused("filter wordwrap", 790 + 80 * 3):
        bounds.estimate_filter("wordwrap", (text, 10, True, "yyy"), {})
    with _refused("filter wordwrap", 790 + 80 * 3):
        bounds.estimate_filter("wordwrap", (text, 10, True), {"wrapstring": "yyy"})
    for width in (1, 0):
        with _refused("filter wordwrap", 500 + 501):
            bounds.estimate_filter("wordwrap", ("x" * 500, width, True, "y"), {})
    bounds.estimate_filter("wordwrap", (text, 1), {})
    bounds.estimate_filter("truncate", ("x" * 900, 10, True, "yy"), {})
