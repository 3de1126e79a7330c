"""``posttrain.chat.bounds``'s estimates at their edges: the length a value would have
is computed by hand and the refusal names it exactly; the value at the bound renders.
The size bound is 1000 characters here (the module reads it at each call), so each case
renders in milliseconds. (tests/test_chat_bounds.py holds the runaway templates.)"""

from __future__ import annotations

import pytest

from posttrain import chat
from posttrain.chat import bounds

pytestmark = pytest.mark.host

BOUND = 1000


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(bounds, "MAX_OUTPUT_CHARS", BOUND)


def _render(source: str) -> str:
    return chat.ChatTemplate(source, origin="t").render([])


def _refusal(source: str) -> str:
    with pytest.raises(chat.TemplateError) as caught:
        _render(source)
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
