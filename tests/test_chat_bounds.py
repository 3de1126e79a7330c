"""Chat templates run within bounds (#56 class 6, :mod:`posttrain.chat.sandbox`): time,
output size, the size of any value built on the way, and the template's own size. Each
runaway template stops quickly with one line naming the bound and the value; a
published template renders as before (``tests/test_chat_families.py``)."""

from __future__ import annotations

import time

import pytest

from posttrain import chat
from posttrain.chat import bounds

pytestmark = pytest.mark.host

# each runaway form -> a piece of the one line it gives
RUNAWAY = {
    "nested-loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "time bound of 0.3 s (MAX_RENDER_SECONDS)",
    ),
    "loops-over-a-variable": (  # no call inside: the loop items themselves are checked
        "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% for k in r %}"
        "{% endfor %}{% endfor %}{% endfor %}",
        "time bound of 0.3 s",
    ),
    "repeat": ("{{ 'a' * 400000000 }}", "'*' would build a value of length 400000000, over"),
    "repeat-list": ("{{ ([1] * 10**9)|length }}", "value of length 1000000000, over the bound"),
    "lipsum": ("{{ lipsum(20000000) }}", "lipsum() would build a value of length"),
    "range": ("{{ range(10**12)|length }}", "range() of 1000000000000 items is over the bound"),
    "recursive-macro": (
        "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}",
        "recursion deeper than Python's limit",
    ),
    "recursive-loop": (
        "{% for x in [[1]] recursive %}{{ loop([x]) }}{% endfor %}",
        "recursion deeper than Python's limit",
    ),
    "strftime": ("{{ strftime_now('%c' * 100000) }}", "strftime_now's format of length 200000"),
    "output": (
        "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
        "the output (",  # streamed: stops at the bound, not at the end
    ),
    "macro-buffer": (  # pieces within the bound, joined only when the macro returns
        "{% set s = 'x' * 4000000 %}{% macro m() %}{% for i in range(100000) %}{{ s }}"
        "{% endfor %}{% endmacro %}{{ m()|length }}",
        "the text written, in all macros and blocks (",
    ),
    "set-block": (
        "{% set s = 'x' * 4000000 %}{% set b %}{% for i in range(100000) %}{{ s }}{% endfor %}"
        "{% endset %}{{ b|length }}",
        "the text written",
    ),
    "doubling": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s|length }}",
        "a value of length",
    ),
    "power": ("{{ 10 ** (10 ** 8) }}", "'**' would build an integer of 400000000 bits"),
    "squaring": (  # each product within the bound until one is not
        "{% set ns = namespace(n=10 ** 1000) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}"
        "{% endfor %}{{ ns.n > 0 }}",
        "an integer of",
    ),
    "percent-width": ("{{ '%999999999d' % 1 }}", "'%' width would build a value"),
    "format-width": ("{{ '{:>999999999}'.format(1) }}", "format() width would build"),
    "nested-format-width": ("{{ '{:>{w}}'.format(1, w=999999999) }}", "format() argument"),
    "center": ("{{ 'a'|center(999999999) }}", "filter center argument would build"),
    "ljust": ("{{ 'a'.ljust(999999999) }}", "ljust() argument would build"),
    "replace": (
        "{{ ('a' * 1000000).replace('a', 'b' * 1000) }}",
        "replace() would build a value of length 1000000000",
    ),
    "expandtabs": ("{{ ('\\t' * 1000).expandtabs(100000) }}", "expandtabs() would build"),
    "join": ("{{ range(100000)|join('x' * 1000) }}", "filter join would build"),
    "join-items": ("{{ (['x' * 4000000] * 100)|join }}", "filter join would build"),
    "join-method": ("{{ ''.join(['x' * 4000000] * 100) }}", "join() would build"),
    "wordwrap": (
        "{{ ('a ' * 100000)|wordwrap(2, true, 'x' * 1000) }}",
        "filter wordwrap would build",
    ),
    "tojson-indent": ("{{ range(1000)|list|tojson(indent=100000) }}", "filter tojson would"),
    "indent": ("{{ ('a\\n' * 100000)|indent('x' * 1000) }}", "filter indent would build"),
}


@pytest.fixture
def quick(monkeypatch):
    """A 0.3 s time bound and a 4 Mi character size bound: the cases finish in a second."""
    monkeypatch.setattr(bounds, "MAX_RENDER_SECONDS", 0.3)
    monkeypatch.setattr(bounds, "MAX_OUTPUT_CHARS", 1 << 22)


@pytest.mark.parametrize(("source", "words"), RUNAWAY.values(), ids=RUNAWAY.keys())
def test_a_runaway_template_stops_in_one_line_naming_the_bound(quick, source, words):
    template = chat.ChatTemplate(source, origin="t.jinja")
    start = time.monotonic()
    with pytest.raises(chat.TemplateError) as caught:
        template.render([{"role": "user", "content": "hi"}])
    message = str(caught.value)
    assert message.startswith("chat template t.jinja: ") and words in message, message
    assert "\n" not in message and time.monotonic() - start < 5


def test_the_bounds_leave_ordinary_rendering_alone(quick):
    """Loops, ``*``, ``%``, ``format``, filters and ``strftime_now`` within the bounds
    render as Jinja renders them."""
    source = (
        "{% for m in messages %}{{ loop.index }}:{{ m.content|upper }}{% endfor %}"
        "{{ '-' * 3 }}{{ '%03d' % 7 }}{{ '{:>4}'.format('x') }}{{ 'a'|center(5) }}"
        "{{ range(3)|join(',') }}{{ 2 ** 10 }}{{ 'x' ~ 'y' }}{{ strftime_now('%Y')|length }}"
    )
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert chat.ChatTemplate(source).render(messages) == "1:A2:B---007   x  a  0,1,21024xy4"


def test_a_template_over_the_size_bound_is_not_read(tmp_path, monkeypatch):
    """A 100 MB ``chat_template.jinja`` (sparse: nothing is written) is refused by its
    size, as ``--chat-template`` and beside a tokenizer; a ``tokenizer_config.json``
    string over the bound too."""
    import json

    big = tmp_path / "chat_template.jinja"
    with open(big, "wb") as f:
        f.truncate(100_000_000)
    for load in (chat.load_template, lambda p: chat.resolve_template(None, str(big))):
        with pytest.raises(chat.TemplateError) as caught:
            load(tmp_path)
        assert str(caught.value) == (
            f"{big}: a template file of 100000000 bytes is over the bound of 1048576 "
            "(MAX_TEMPLATE_CHARS)"
        )
    big.unlink()
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": "x" * (bounds.MAX_TEMPLATE_CHARS + 1)}))
    with pytest.raises(chat.TemplateError, match="a template of 1048577 characters is over"):
        chat.load_template(tmp_path)


@pytest.mark.parametrize(
    "source",
    ["{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "{% if 1 %}" * 2000 + "{% endif %}" * 2000],
    ids=["parentheses", "blocks"],
)
def test_a_template_nested_past_the_recursion_limit_is_one_line(source):
    with pytest.raises(chat.TemplateError, match="^chat template does not parse: nested deeper"):
        chat.ChatTemplate(source).render([])
