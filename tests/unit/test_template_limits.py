"""Templates: the limits checked before parsing, the worst case they allow, the parse
cache, and the wiring of the settings."""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from portal.config import Settings
from portal.messaging.templating import limits, parsing, sandbox
from portal.messaging.templating.limits import DEFAULT_LIMITS, TemplateLimits
from portal.messaging.templating.rendering import (
    TemplateRenderError,
    compile_check,
    limit_problems,
    render,
    variables_of,
)
from tests.support.timing import cpu_best_of, machine_slowness

# The issue's "any parse under 50 ms on these machines", on a slower machine as much longer
# as it is slower (tests/support/timing.py).
PARSE_DEADLINE_S = 0.05

# The two templates of the issue's review: legal then, about 200,000 characters each.
HOSTILE_ASSIGNS = "{% liquid\n" + "assign a = 1\n" * 15_000 + "%}"
HOSTILE_PATH = "{{ x" + ".a" * 100_000 + " }}"


def costliest(limits: TemplateLimits = DEFAULT_LIMITS) -> dict[str, str]:
    """Templates at every parse limit at once (tags, expression tokens, path segments,
    nesting), one per shape of markup; the first is the costliest to parse (measured)."""
    tags, tokens = limits.tags_max, limits.expression_tokens_max
    per_tag = tokens // tags
    path = "x" + ".a" * (min(per_tag, limits.path_segments_max) - 1)
    depth = limits.nesting_max
    nested = "{% if a %}" * depth + "{{ a }}" + "{% endif %}" * depth
    shapes = {
        "liquid assign lines": "{% liquid\n"
        + "".join(f"assign a = {path[: 2 * (per_tag - 3) - 1]}\n" for _ in range(tags - 1))
        + "%}",
        "outputs with paths": f"{{{{ {path} }}}}" * tags,
        "conditions": ("{% if a" + " or a" * ((per_tag - 2) // 2) + " %}x{% endif %}")
        * (tags // 2),
        "filters": ("{{ 1" + " | plus: 1" * ((per_tag - 1) // 4) + " }}") * tags,
        "nesting": nested * (tags // (2 * depth + 1)),
        "loops": "{% for i in x.b limit: 2 %}{{ i }}{% endfor %}" * (tags // 3),
    }
    return shapes


# Timing runs get a deadline far off, so that a busy machine makes an attempt slow rather than
# failed; the best of three is then held to the real deadline.
UNHURRIED = replace(DEFAULT_LIMITS, render_timeout_s=30.0)


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[None]:
    parsing._parsed.clear()
    yield
    parsing._parsed.clear()


# --- the worst case the limits allow ------------------------------------------------------------


@pytest.mark.parametrize("shape", costliest().keys())
def test_the_costliest_template_the_limits_allow_parses_and_renders_in_time(shape: str) -> None:
    source = costliest()[shape]
    assert len(source) <= DEFAULT_LIMITS.source_max_chars
    compile_check(source, html=True)  # it is allowed: it can be saved

    def parse() -> None:
        parsing._parsed.clear()  # every attempt parses
        compile_check(source, html=True)

    def parse_and_render() -> None:
        parsing._parsed.clear()
        variables = {"x": {"a": {"a": "y"}, "b": [1, 2, 3]}, "a": "b"}
        render(source, variables, html=True, limits=UNHURRIED)

    deadline = PARSE_DEADLINE_S * machine_slowness()
    parsed = cpu_best_of(parse, under=deadline)
    rendered = cpu_best_of(parse_and_render, under=DEFAULT_LIMITS.render_timeout_s)
    print(
        f"{shape}: {len(source)} chars, parse {parsed * 1000:.1f} ms, render {rendered * 1000:.1f}"
    )
    assert parsed < deadline
    assert rendered < DEFAULT_LIMITS.render_timeout_s


def test_a_template_saved_before_the_limits_sends_within_the_deadline_up_to_its_ceiling() -> None:
    # A saved template gets twice the limits at send time; at that ceiling it still parses
    # and renders within the render deadline, so it keeps working until it is next saved.
    ceiling = limits.stored_ceiling(DEFAULT_LIMITS)
    for shape, source in costliest(ceiling).items():
        with pytest.raises(TemplateRenderError):
            compile_check(source, html=False)

        def send(source: str = source) -> None:
            parsing._parsed.clear()
            render(source, {"x": {}, "a": "b"}, html=False, limits=UNHURRIED)

        elapsed = cpu_best_of(send, under=DEFAULT_LIMITS.render_timeout_s)
        print(f"{shape} at the ceiling: {elapsed * 1000:.1f} ms")
        assert elapsed < DEFAULT_LIMITS.render_timeout_s


# --- the issue's two templates ------------------------------------------------------------------


@pytest.mark.parametrize("source", [HOSTILE_ASSIGNS, HOSTILE_PATH], ids=["assigns", "path"])
def test_the_issues_templates_are_refused_at_save_naming_the_limit(source: str) -> None:
    with pytest.raises(TemplateRenderError, match=r"too long: \d+ characters, the limit is 50000"):
        compile_check(source, html=True)
    assert limit_problems(source) == [
        f"the template is too long: {len(source)} characters, the limit is 50000"
    ]


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (HOSTILE_ASSIGNS, "too many tags"),
        (HOSTILE_PATH, "too long: 200007 characters, the limit is 200000"),
    ],
    ids=["assigns", "path"],
)
def test_the_issues_templates_fail_at_send_before_any_parse(source: str, expected: str) -> None:
    def send() -> None:
        parsing._parsed.clear()
        with pytest.raises(TemplateRenderError, match=expected):
            render(source, {}, html=True)

    deadline = PARSE_DEADLINE_S * machine_slowness()
    elapsed = cpu_best_of(send, under=deadline)
    print(f"{elapsed * 1000:.1f} ms")  # 0.5-0.7 s of parse before the limits
    assert elapsed < deadline


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("{% liquid\n" + "assign a = 1\n" * 3_800 + "%}", "too many tags"),
        ("{{ x" + ".a" * 24_990 + " }}", "path is too long: 24991 segments, the limit is 32"),
        ("{{ x" + ".a" * 32 + " }}", "path is too long: 33 segments"),
        ("{{ x[0]" + "[0]" * 32 + " }}", "path is too long"),
        ("{{ a" + " | append: 1" * 2_000 + " }}", "too many expressions"),
        ("{% if a %}" * 21 + "{% endif %}" * 21, "nested too deeply (limit 20)"),
        ("{% liquid\n" + "if a\n" * 21 + "endif\n" * 21 + "%}", "nested too deeply"),
        ("{{ " + "(" * 21 + "1..2" + ")" * 21 + " }}", "parentheses are nested too deeply"),
        ("{{ a }}" * 351, "too many tags (limit 350"),
    ],
    ids=[
        "assigns",
        "path",
        "path-33",
        "brackets",
        "filters",
        "ifs",
        "liquid-ifs",
        "parentheses",
        "outputs",
    ],
)
def test_templates_within_the_size_but_over_a_count_are_refused(source: str, expected: str) -> None:
    assert len(source) <= DEFAULT_LIMITS.source_max_chars
    with pytest.raises(TemplateRenderError, match=re.escape(expected)):
        compile_check(source, html=False)
    assert any(expected.split(" (")[0] in problem for problem in limit_problems(source))


def test_what_is_not_parsed_is_not_counted() -> None:
    # Plain text, raw blocks and comments cost little to parse, so they use none of the caps.
    body = "<p>" + "word " * 5_000 + "</p>"
    raw = "{% raw %}" + "{{ a }}" * 1_000 + "{% endraw %}"
    comment = "{%# " + "a.b.c " * 1_000 + "%}"
    for source in (body, raw, comment):
        compile_check(source, html=True)
    assert limit_problems("{{ a.b[0].c }}{% if a %}{% endif %}") == []


def test_strings_are_not_paths() -> None:
    compile_check("{{ '" + "a." * 100 + "' }}", html=False)


def test_broken_delimiters_are_template_errors_not_limits() -> None:
    assert limit_problems("{{ a") == []
    with pytest.raises(TemplateRenderError, match="never closed"):
        compile_check("{{ a", html=False)


# --- the cache ----------------------------------------------------------------------------------


def test_a_batch_parses_its_template_once() -> None:
    source = costliest()["liquid assign lines"] + "{{ name }}"
    for n in range(50):
        assert render(source, {"name": f"n{n}"}, html=True).endswith(f"n{n}")
    assert parsing._parsed.parses == 1
    render(source + " ", {"name": "x"}, html=True)  # an edited template is a new entry
    assert parsing._parsed.parses == 2


def test_a_broken_template_fails_every_record_without_parsing_again() -> None:
    for _ in range(5):
        with pytest.raises(TemplateRenderError, match="too many tags"):
            render(HOSTILE_ASSIGNS, {}, html=False)
    assert parsing._parsed.parses == 1


def test_a_draft_is_held_to_the_limits_a_saved_template_to_its_ceiling() -> None:
    source = "{{ a }}" * 600  # over 350 tags, within the 700 a saved template may keep
    assert render(source, {"a": "x"}, html=False) == "x" * 600
    with pytest.raises(TemplateRenderError, match="too many tags"):
        render(source, {"a": "x"}, html=False, draft=True)
    assert variables_of(source) == ["a"]


# --- settings -------------------------------------------------------------------------------------


def test_configure_makes_every_render_follow_the_settings() -> None:
    settings = Settings(
        database_url="sqlite://",
        redis_url=None,
        secret_key="k",
        template_max_chars=100,
        mail_body_max_chars=2_000_000,
    )
    big = "{% for i in (1..2000) %}" + "x" * 1_000 + "{% endfor %}"
    with pytest.raises(TemplateRenderError, match="output is too long"):
        render(big, {}, html=False)  # 2,000,000 characters: over the old fixed 1.1 M
    try:
        limits.configure(settings)
        assert limits.configured_limits() == TemplateLimits.from_settings(settings)
        assert len(render(big, {}, html=False)) == 2_000_000
        with pytest.raises(TemplateRenderError, match="the limit is 100"):
            compile_check("x" * 101, html=False)
    finally:
        limits._configured.clear()
    assert limits.configured_limits() is DEFAULT_LIMITS


def test_the_render_deadline_counts_the_threads_cpu_not_the_wall_clock() -> None:
    """A render that waits (for the GIL behind a busy pool, on a loaded machine) is not the
    template's doing and must not fail it; one that burns CPU past the limit does."""
    budget = sandbox.Budget(replace(DEFAULT_LIMITS, render_timeout_s=0.05))
    time.sleep(0.15)  # three times the limit on the wall clock, almost no CPU
    for _ in range(16):  # the clock is read at the first tick and every 16th after
        budget.tick()
    started = time.thread_time()
    while time.thread_time() - started < 0.1:  # twice the limit in CPU
        pass
    with pytest.raises(sandbox._LimitError, match="took too long to render"):
        budget.tick()  # the 17th: the clock is read


def test_the_render_deadline_leaves_out_the_garbage_collectors_time() -> None:
    """A full collection runs in whichever thread allocates: in a process with a large heap it
    took longer than a render's whole deadline, and a one-character template failed. The
    collector's CPU is not the template's; the template's own CPU still counts."""
    heap = [[i] for i in range(400_000)]  # what a full collection must walk
    started = time.thread_time()
    gc.collect()
    collection_s = time.thread_time() - started
    limit = collection_s / 3  # the collection alone takes three deadlines
    budget = sandbox.Budget(replace(DEFAULT_LIMITS, render_timeout_s=limit))
    for _ in range(4):
        gc.collect()
    for _ in range(16):  # the clock is read at the first tick and every 16th after
        budget.tick()
    started = time.thread_time()
    while time.thread_time() - started < 2 * limit:  # the template's own CPU: twice the limit
        pass
    with pytest.raises(sandbox._LimitError, match="took too long to render"):
        budget.tick()  # the 17th: the clock is read
    assert len(heap) == 400_000
