"""``posttrain.chat.bounds``'s estimates at their edges: the length a value would have
is computed by hand and the refusal names it exactly; the value at the bound renders.
The size bound is 1000 characters here (the module reads it at each call), so each case
renders in milliseconds. (tests/test_chat_bounds.py holds the runaway templates.)"""

from __future__ import annotations

import inspect
import locale
import os
import sys
import threading
from unittest import mock

import jinja2.utils
import pytest
from hypothesis import given
from hypothesis import strategies as st

from posttrain import chat
from posttrain.chat import bounds, sandbox

pytestmark = pytest.mark.host

BOUND = 1000


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(bounds, "MAX_OUTPUT_CHARS", BOUND)


def _render(source: str, **variables) -> str:
    return chat.ChatTemplate(source, origin="t").render([], **variables)


def _refusal(source: str, **variables) -> str:
    with pytest.raises(chat.TemplateError) as caught:
        _render(source, **variables)
    return str(caught.value).removeprefix("chat template t: ")


def _over(what: str, length: int) -> str:
    return (
        f"{what} would build a value of length {length}, over the bound of {BOUND} "
        "(MAX_OUTPUT_CHARS)"
    )


def test_lipsum_is_refused_from_its_longest_possible_words(small):
    """lipsum(n, html, min, max): at most n x max words of at most 15 characters and a
    space: 2 x 31 x 16 = 992 renders, 2 x 32 x 16 = 1024 is refused before any word."""
    assert _render("{{ lipsum(2, false, 20, 31) }}")
    assert _refusal("{{ lipsum(2, false, 20, 32) }}") == _over("lipsum()", 1024)


def test_lipsum_passes_its_arguments_to_jinjas():
    """n paragraphs of min to max - 1 words, in <p> unless html is false."""
    text = _render("{{ lipsum(3, false, 5, 6) }}")
    paragraphs = text.split("\n\n")
    assert len(paragraphs) == 3 and "<p>" not in text
    assert [len(p.split()) for p in paragraphs] == [5, 5, 5]
    html = _render("{{ lipsum(2, min=5, max=6) }}")
    assert html.count("<p>") == 2


def test_strftime_now_takes_a_format_up_to_its_bound():
    """1024 characters of format render ('%%' is one '%'); 1025 are refused."""
    assert _render("{{ strftime_now('%%' * 512) }}") == "%" * 512
    assert _refusal("{{ strftime_now('%%' * 512 ~ 'x') }}") == (
        "strftime_now's format of length 1025 is over the bound of 1024 (MAX_FORMAT_CHARS)"
    )


def test_a_width_of_more_than_nine_digits_is_named_by_its_first_twelve():
    """A width too long to parse cheaply is refused, its value shown cut to 12 digits."""
    assert _refusal("{{ '%" + "9" * 14 + "d' % 1 }}") == (
        "'%' width would build a value of length 999999999999, over the bound of 16777216 "
        "(MAX_OUTPUT_CHARS)"
    )


def test_tojson_counts_every_nested_item_once_per_indent(small):
    """[[1, 2], {"a": [3, 4]}]: 2 + 2 + 1 + 2 = 7 items, each on its own line at least
    one indent in: 7 x 143 = 1001 is refused."""
    source = "{{ [[1, 2], {'a': [3, 4]}]|tojson(indent=143) }}"
    assert _refusal(source) == _over("filter tojson", 1001)


def test_join_counts_the_strings_and_a_separator_between_each_two(small):
    """['a' x 500, 'b' x 499, 7] joined by 'xy': 999 characters of strings (the integer
    is not counted) and 2 separators of 2: 1003."""
    source = "{{ ['a' * 500, 'b' * 499, 7]|join('xy') }}"
    assert _refusal(source) == _over("filter join", 1003)
    method = "{{ 'xy'.join(['a' * 500, 'b' * 499, 7]) }}"
    assert _refusal(method) == _over("join()", 1003)


def test_one_item_is_joined_without_a_separator(small):
    """A single item of 999 characters joined by 'xy' stays 999: it renders."""
    assert _render("{{ ['a' * 999]|join('xy') }}") == "a" * 999


def test_a_range_joined_counts_only_its_separators(small):
    """range(102) joined by 10 characters: 101 separators, 1010 (its numbers unknown to
    the estimate)."""
    assert _refusal("{{ range(102)|join('x' * 10) }}") == _over("filter join", 1010)


def test_lipsum_keeps_jinjas_defaults():
    """5 paragraphs of 20 to 99 words, in <p>: Jinja's defaults, argument for argument."""
    ours = inspect.signature(sandbox.bounded_lipsum).parameters
    jinjas = inspect.signature(jinja2.utils.generate_lorem_ipsum).parameters
    assert [(p.name, p.default) for p in ours.values()] == [
        (p.name, p.default) for p in jinjas.values()
    ]
    assert _render("{{ lipsum(html=false, min=3, max=4) }}").count("\n\n") == 4  # n = 5
    # max = 21 and the default min 20: exactly 20 words a paragraph
    assert [len(p.split()) for p in _render("{{ lipsum(2, false, max=21) }}").split("\n\n")] == [
        20,
        20,
    ]


def test_lipsum_with_jinjas_defaults_is_estimated_at_five_times_a_hundred_words(monkeypatch):
    """lipsum(): 5 x 100 x 16 = 8000 renders at a bound of 8000 (not one word more a
    paragraph: the defaults as called, not only as declared)."""
    monkeypatch.setattr(bounds, "MAX_OUTPUT_CHARS", 8000)
    assert _render("{{ lipsum() }}").count("<p>") == 5
    assert _refusal("{{ lipsum(5, true, 20, 101) }}") == (
        "lipsum() would build a value of length 8080, over the bound of 8000 (MAX_OUTPUT_CHARS)"
    )


def test_lipsum_of_empty_paragraphs_is_bounded_by_their_count(small):
    """min=-1, max=0: paragraphs of no words, each still '.' and a break, counted as one
    word each: 62 x 16 = 992 renders (62 dots, 61 breaks), 63 x 16 = 1008 is refused."""
    assert _render("{{ lipsum(62, false, -1, 0) }}") == "\n\n".join(["."] * 62)
    assert _refusal("{{ lipsum(63, false, -1, 0) }}") == _over("lipsum()", 1008)


@pytest.mark.parametrize("argument", ["n=2.0", "min=20.0", "max=32.0"])
def test_lipsum_counts_must_be_integers(argument):
    """A float count is refused (randrange takes max=32.0 in Python 3.11, which would
    pass the estimate unchecked: lipsum(20000000, max=100.0) was a runaway)."""
    assert _refusal(f"{{{{ lipsum({argument}) }}}}") == (
        f"lipsum()'s {argument}; expected an integer"
    )


@given(st.integers(-30, 30), st.integers(-30, 30), st.integers(-7, 7).filter(bool))
def test_range_counts_its_items_as_python_does(start, stop, step):
    """Each range at a bound of its own length renders; one below, it is refused naming
    that length (Python's len(range) is the oracle)."""
    items = len(range(start, stop, step))
    with mock.patch.object(bounds, "MAX_RANGE", items):
        assert sandbox.bounded_range(start, stop, step) == range(start, stop, step)
    if items:
        lower = mock.patch.object(bounds, "MAX_RANGE", items - 1)
        with lower, pytest.raises(bounds.BoundExceeded) as caught:
            sandbox.bounded_range(start, stop, step)
        assert str(caught.value) == (
            f"range() of {items} items is over the bound of {items - 1} (MAX_RANGE)"
        )


def test_a_repetition_is_refused_before_it_is_built_from_either_side(small):
    """'a' * 1001 and 1001 * 'a' are both estimated (not built, then measured)."""
    assert _refusal("{{ 'a' * 1001 }}") == _over("'*'", 1001)
    assert _refusal("{{ 1001 * 'a' }}") == _over("'*'", 1001)
    assert _refusal("{{ 1001 * [0] }}") == _over("'*'", 1001)


def test_a_power_is_estimated_from_the_bits_of_its_base(monkeypatch):
    """At 64 bits: 3 ** 32 is estimated at 2 x 32 = 64 bits and computed; 3 ** 33 (66)
    and 2 ** 64 (128, though the result has 65) are refused before they are computed; 1
    and -1 to any power cost nothing; + of two integers is not a power."""
    monkeypatch.setattr(bounds, "MAX_INT_BITS", 64)
    assert _render("{{ 3 ** 32 }}") == str(3**32)
    for power, bits in (("3 ** 33", 66), ("(-3) ** 33", 66), ("2 ** 64", 128)):
        assert _refusal(f"{{{{ {power} }}}}") == (
            f"'**' would build an integer of {bits} bits is over the bound of 64 (MAX_INT_BITS)"
        )
    assert _render("{{ 1 ** (10 ** 9) }} {{ (-1) ** (10 ** 9 + 1) }}") == "1 -1"
    assert _render("{{ 40 + 40 }} {{ 40 * 40 }}") == "80 1600"


def test_percent_checks_a_tuple_of_arguments_item_by_item(small):
    """'%*d' % (1001, 1): the width argument inside the tuple is refused."""
    assert _refusal("{{ '%*d' % (1001, 1) }}") == _over("'%' argument", 1001)
    assert _render("{{ '%*d' % (5, 1) }}") == "    1"


def test_format_passes_keywords_and_checks_format_maps_values(small):
    assert _render("{{ '{a}-{b:>3}'.format(a=1, b='x') }}") == "1-  x"
    assert _render("{{ '{x:>{w}}'.format_map({'w': 3, 'x': 1}) }}") == "  1"
    assert _refusal("{{ '{x:>{w}}'.format_map({'w': 1001, 'x': 1}) }}") == _over(
        "format_map() argument", 1001
    )


def test_expandtabs_is_estimated_with_its_tabsize_given_by_keyword(small):
    """Ten tabs at 101 columns: 10 x 101 + 10 = 1020 (each tab at its widest, and the
    string), whether the tab size is positional or a keyword."""
    assert _refusal("{{ ('\t' * 10).expandtabs(101) }}") == _over("expandtabs()", 1020)
    assert _refusal("{{ ('\t' * 10).expandtabs(tabsize=101) }}") == _over("expandtabs()", 1020)
    assert _render("{{ ('\t' * 10).expandtabs(tabsize=98) }}") == " " * 980


def test_the_output_is_bounded_at_its_length_exactly(small):
    """1000 characters render; two pieces of 600 are refused at 1200, as they stream."""
    assert _render("{{ 'x' * 1000 }}") == "x" * 1000
    assert _refusal("{% set s = 'x' * 600 %}{{ s }}{{ s }}") == (
        "the output (1200 characters so far) is over the bound of 1000 (MAX_OUTPUT_CHARS)"
    )


def test_the_text_written_in_all_frames_is_bounded_at_four_outputs(small):
    """A set block of 3000 characters and an output of 1000: 4000 written renders; one
    character more in the block (template text counts too) is refused."""
    head = "{% set s = 'x' * 1000 %}{% set b %}{{ s }}{{ s }}{{ s }}"
    assert _render(head + "{% endset %}{{ s }}") == "x" * 1000
    assert _refusal(head + "y{% endset %}{{ s }}") == (
        "the text written, in all macros and blocks (4001 characters so far), is over the "
        "bound of 4000 (4 x MAX_OUTPUT_CHARS)"
    )


def test_recursion_and_memory_are_one_line_each():
    refusal = _refusal("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}")
    assert refusal == (
        f"recursion deeper than Python's limit of {sys.getrecursionlimit()} frames (a macro "
        "or recursive loop that does not end)"
    )

    class Exhausting:
        def __str__(self):
            raise MemoryError

    assert _refusal("{{ value }}", value=Exhausting()) == "out of memory while rendering"


def test_a_template_is_bounded_at_its_length_exactly(monkeypatch):
    monkeypatch.setattr(bounds, "MAX_TEMPLATE_CHARS", 50)
    assert chat.ChatTemplate("edge of the bound" + "." * 33).render([]) == (
        "edge of the bound" + "." * 33
    )
    with pytest.raises(chat.TemplateError) as caught:
        chat.ChatTemplate("edge of the bound" + "." * 34).render([])
    assert str(caught.value) == (
        "chat template: a template of 51 characters is over the bound of 50 (MAX_TEMPLATE_CHARS)"
    )


def test_a_template_file_is_bounded_at_its_size_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(bounds, "MAX_TEMPLATE_CHARS", 50)
    path = tmp_path / "chat_template.jinja"
    path.write_text("x" * 50)
    assert sandbox.read_source(path) == "x" * 50
    path.write_text("x" * 51)
    with pytest.raises(bounds.BoundExceeded) as caught:
        sandbox.read_source(path)
    assert str(caught.value) == (
        "a template file of 51 bytes is over the bound of 50 (MAX_TEMPLATE_CHARS)"
    )


def test_a_file_longer_than_its_size_says_is_read_to_one_past_the_bound(tmp_path, monkeypatch):
    """A FIFO reports size 0 (as a file that grew after its stat): 60 characters come
    through it, and only 51 are read before the template is refused."""
    monkeypatch.setattr(bounds, "MAX_TEMPLATE_CHARS", 50)
    fifo = tmp_path / "chat_template.jinja"
    os.mkfifo(fifo)

    def write():
        with open(fifo, "w") as f:  # blocks until read_source opens it
            f.write("x" * 60)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        with pytest.raises(bounds.BoundExceeded) as caught:
            sandbox.read_source(fifo)
    finally:
        writer.join(timeout=10)
    assert str(caught.value) == (
        "a template of 51 characters is over the bound of 50 (MAX_TEMPLATE_CHARS)"
    )


def test_a_template_file_is_read_as_utf8_whatever_the_locale(tmp_path):
    """Under LC_CTYPE=C (ASCII, unless Python runs in UTF-8 mode) a template with 'é' is
    still read as UTF-8."""
    path = tmp_path / "chat_template.jinja"
    path.write_bytes("caf\u00e9 {{ x }}".encode())
    before = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    try:
        assert sandbox.read_source(path) == "caf\u00e9 {{ x }}"
    finally:
        locale.setlocale(locale.LC_CTYPE, before)
