"""What a template needs of a send's variables: needed and optional names."""

from __future__ import annotations

import pytest

from portal.messaging.templating.variables import variable_needs


@pytest.mark.parametrize(
    ("source", "needed", "optional"),
    [
        ("Hello {{ name }}", ("name",), ()),
        ("{{ plan | upcase }}", ("plan",), ()),  # filtered
        ("{% if vip %}{{ perk }}{% endif %}", ("perk",), ("vip",)),  # inside an if body
        ("{% unless quiet %}x{% endunless %}", (), ("quiet",)),
        ("{% case kind %}{% when 'a' %}{{ z }}{% endcase %}", ("z",), ("kind",)),
        ("{% if a %}{% elsif b %}{% endif %}", (), ("a", "b")),
        ("{{ footer | default: 'Bye' }}", (), ("footer",)),
        ("{{ x | default: y }}", (), ("x", "y")),  # only under default
        ("{{ s | default: '' | append: t }}", ("t",), ("s",)),  # after default: needed
        ("{{ user.name }} {{ user.email }}", ("user",), ()),
        ("{{ a[b] }}", ("a", "b"), ()),
        ("{% assign g = 'hi' %}{{ g }}", (), ()),  # its own
        ("{% capture c %}{{ m }}{% endcapture %}{{ c }}", ("m",), ()),
        ("{% for i in items %}{{ i }}{{ forloop.index }}{% endfor %}", ("items",), ()),
        ("{{ now }} {{ today }}", (), ()),  # python-liquid's own
        ("{% if name %}Hi {{ name }}{% endif %}", ("name",), ()),  # output somewhere: needed
    ],
)
def test_needed_and_optional_names(
    source: str, needed: tuple[str, ...], optional: tuple[str, ...]
) -> None:
    found = variable_needs([source])
    assert (found.needed, found.optional) == (needed, optional)


def test_parts_are_combined_and_a_name_needed_anywhere_is_not_optional() -> None:
    found = variable_needs(["Hi {{ name }}", "{% if plan %}x{% endif %}", None, "{{ plan }}"])
    assert (found.needed, found.optional) == (("name", "plan"), ())
