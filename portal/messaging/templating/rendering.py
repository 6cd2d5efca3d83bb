"""Tenant templates: sandboxed Liquid rendering with resource limits.

This module is the templating's front: ``compile_check`` (before a template is saved),
``render`` and ``render_mail``, ``limit_problems``, and beside them what callers use of its
parts: ``limits`` (``TemplateLimits``, the limits in force), ``parsing`` (the scan before
parsing, the parse cache, an error's position), ``sandbox`` (the environment and the render's
budget), ``variables`` (what a template needs of a send's variables, and their check) and
``html_text`` (an HTML body's plain-text part).

Tenant admins write these templates, so a template is untrusted input (DESIGN.md, "Tenant-authored
templates"). Liquid itself cannot reach Python objects: paths resolve by subscript only, and
variables are checked to be plain JSON data. `include` and `render` are removed, so a template
can never name another template or a file. What remains is resource exhaustion, which
python-liquid's own limits (loop iterations per loop nest, output size, context depth, local
namespace size, block nesting) only partly cover. Measured gaps, and what closes each:

- its lexer is quadratic on some malformed input (an unclosed "{{", a blank "{{   }}"):
  a linear scan rejects those before parsing (``parsing``);
- its loop limit is per loop nest, so many sequential loops are unbounded: a total iteration
  budget per render (``sandbox``, as are the next four);
- its output limit checks what is written, not what filters build (`s | append: s | ...`,
  `s | replace: "a", s`): every filter result is size-checked, `replace` and `join` are
  estimated before they run, and `uniq` and `strip_html` (``html_text``) get linear
  implementations;
- `reversed` and `offset:` walk a range before the loop limit is checked: loops may not reach
  past `list_max_items`;
- `times` can square an integer on every iteration: integer results are capped;
- a deadline on the rendering thread's CPU time (not the wall clock: a render that waits for
  the GIL or a loaded machine is not the template's doing), checked at the first of the
  variable lookups, filter calls, assignments, loops and writes and every 16th after, is the
  backstop for anything these deterministic budgets miss;
- parsing itself cannot be interrupted, and a legal 200,000-character template (15,000
  `assign` lines, or one path of 100,000 segments) took 0.5-0.7 s to parse, again for every
  record: the size, tags, expression tokens, path segments and nesting are counted
  in one linear scan before parsing, which keeps any parse in tens of milliseconds, and a
  parsed template is kept per process, so a batch parses once (``parsing``).

Saving a template checks the limits; a template saved before them keeps sending while within
twice them (``limits.stored_ceiling``), beyond which it fails at once, before any parse.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from portal.messaging.templating.html_text import html_to_text
from portal.messaging.templating.limits import TemplateLimits, configured_limits
from portal.messaging.templating.parsing import (
    ShapeError,
    TemplateRenderError,
    analyse,
    check_shape,
    error_at,
    parse,
    to_render_error,
)
from portal.messaging.templating.sandbox import (
    Budget,
    SandboxEnvironment,
    environment,
    one_deadline,
    run,
)
from portal.messaging.templating.variables import (
    VariableNeeds,
    validate_variables,
    variable_needs,
    variables_of,
)

# The templating's entry points, with the parts callers use beside them.
__all__ = [
    "RenderedMail",
    "TemplateRenderError",
    "VariableNeeds",
    "compile_check",
    "configured_limits",
    "html_to_text",
    "limit_problems",
    "one_deadline",
    "render",
    "render_mail",
    "validate_variables",
    "variable_needs",
    "variables_of",
]


@dataclass
class RenderedMail:
    """A mail's rendered parts; a part that had no template stays None."""

    subject: str
    html: str | None
    text: str | None


def compile_check(source: str, *, html: bool, limits: TemplateLimits | None = None) -> None:
    """Raise TemplateRenderError (with line and column) if the template would not parse, or
    is over the limits: what a template must pass to be saved."""
    env = environment(html, limits or configured_limits())
    template = parse(env, source, draft=True)
    # Unknown filters are otherwise only reported when rendering reaches them.
    analysis = analyse(template)
    for name, spans in analysis.filters.items():
        if name not in env.filters:
            index = spans[0].index if spans else 0
            raise error_at(f"unknown filter '{name}'", source, index)


def render(
    source: str,
    variables: Mapping[str, object],
    *,
    html: bool,
    limits: TemplateLimits | None = None,
    draft: bool = False,
) -> str:
    """Render an untrusted template; HTML-escape values when `html` is true.

    A saved template is checked against `stored_ceiling`; a `draft` (the editor's preview)
    against the limits themselves, as saving it would be."""
    limits = limits or configured_limits()
    data = validate_variables(variables, limits)
    return _render(environment(html, limits), source, data, draft=draft)


def render_mail(
    subject: str | None,
    html: str | None,
    text: str | None,
    variables: Mapping[str, object],
    *,
    limits: TemplateLimits | None = None,
) -> RenderedMail:
    """Render a mail template's parts; the subject is plain text on one line."""
    limits = limits or configured_limits()
    data = validate_variables(variables, limits)
    text_env = environment(False, limits)
    rendered_subject = _render(text_env, subject, data) if subject else ""
    return RenderedMail(
        # A newline in a subject would end the header (and could start a forged one).
        subject=" ".join(part.strip() for part in rendered_subject.splitlines() if part.strip()),
        html=_render(environment(True, limits), html, data) if html is not None else None,
        text=_render(text_env, text, data) if text is not None else None,
    )


def limit_problems(source: str, *, limits: TemplateLimits | None = None) -> list[str]:
    """What a saved template is over, before any parse (empty: within the limits); the
    migration that introduced the limits lists stored templates with it."""
    limits = limits or configured_limits()
    try:
        check_shape(source, limits)
    except TemplateRenderError as exc:
        # Broken delimiters are a template error, not a limit: they never parsed.
        return [] if isinstance(exc, ShapeError) and not exc.limit else [str(exc)]
    return []


def _render(
    env: SandboxEnvironment, source: str, data: Mapping[str, object], *, draft: bool = False
) -> str:
    budget = Budget(env.limits)  # before parsing: the deadline covers the parse too
    template = parse(env, source, draft=draft)
    try:
        return run(template, data, budget)
    except Exception as exc:
        # Any failure inside the engine is this template's failure: the caller marks the
        # record TEMPLATE_NOT_RESOLVABLE instead of the worker crashing on tenant input.
        raise to_render_error(exc, source, env.limits, env) from exc
