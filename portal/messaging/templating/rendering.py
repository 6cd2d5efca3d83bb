"""Tenant templates: sandboxed Liquid rendering with resource limits, and variable listing.

Tenant admins write these templates, so a template is untrusted input (DESIGN.md, "Tenant-authored
templates"). Liquid itself cannot reach Python objects: paths resolve by subscript only, and
variables are checked to be plain JSON data. `include` and `render` are removed, so a template
can never name another template or a file. What remains is resource exhaustion, which
python-liquid's own limits (loop iterations per loop nest, output size, context depth, local
namespace size, block nesting) only partly cover. Measured gaps, and what closes each:

- its lexer is quadratic on some malformed input (an unclosed "{{", a blank "{{   }}"):
  a linear scan rejects those before parsing;
- its loop limit is per loop nest, so many sequential loops are unbounded: a total iteration
  budget per render;
- its output limit checks what is written, not what filters build (`s | append: s | ...`,
  `s | replace: "a", s`): every filter result is size-checked, `replace` and `join` are
  estimated before they run, and `uniq` and `strip_html` get linear implementations;
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
  parsed template is kept per process, so a batch parses once.

Saving a template checks the limits; a template saved before them keeps sending while within
twice them (`_stored_ceiling`), beyond which it fails at once, before any parse.

`html_to_text` uses html.parser, which is quadratic on half-open markup ("<a<a<a..."), so its
input is first cut into well-formed pieces in one linear pass.
"""

from __future__ import annotations

import functools
import json
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from html.parser import HTMLParser
from io import StringIO
from typing import TYPE_CHECKING, Any, TextIO

from liquid import BoundTemplate, DictLoader, Environment, Markup, RenderContext
from liquid.context import builtin as liquid_builtins
from liquid.exceptions import (
    BlockNestingError,
    ContextDepthError,
    LiquidError,
    LiquidSyntaxError,
    LocalNamespaceLimitError,
    LoopIterationLimitError,
    OutputStreamLimitError,
    ResourceLimitError,
)
from liquid.filter import with_environment
from liquid.output import LimitedStringIO
from liquid.static_analysis import TemplateAnalysis
from liquid.undefined import UNDEFINED

if TYPE_CHECKING:
    from liquid.builtin.tags.for_tag import ForLoop
    from liquid.builtin.tags.tablerow_tag import TableRow
    from liquid.token import Token

    from portal.config import Settings


@dataclass(frozen=True)
class TemplateLimits:
    """Resource limits for rendering one template; the defaults suit mail and SMS bodies."""

    source_max_chars: int = 50_000
    # Counted before parsing: with all of them at their limit, a 50,000-character
    # template parses in about 15 ms, where 200,000 characters of `assign` lines took 0.6 s.
    tags_max: int = 350  # {{ }} and {% %}, and each line of a {% liquid %} tag
    expression_tokens_max: int = 2_500  # names, path segments, values and operators in all
    path_segments_max: int = 32  # in one variable path: a.b[0].c is 4
    nesting_max: int = 20  # blocks inside blocks, or parentheses inside parentheses
    variables_max_bytes: int = 64 * 1024  # JSON-encoded, UTF-8
    variables_max_depth: int = 32
    loop_iterations: int = 10_000  # per loop nest (python-liquid's own limit)
    total_iterations: int = 10_000  # across the whole render (python-liquid: per loop nest)
    # A little over the default mail body limit (1 MiB), so that an over-long render is
    # reported by the content check as CONTENT_INVALID rather than as a template failure.
    output_max_chars: int = 1_100_000
    work_max_chars: int = 10_000_000  # everything written or built by filters, in total
    list_max_items: int = 100_000
    namespace_max_bytes: int = 4_400_000  # assigned variables, by sys.getsizeof
    context_depth: int = 30
    int_max_bits: int = 256
    render_timeout_s: float = 0.25

    @classmethod
    def from_settings(cls, settings: Settings) -> TemplateLimits:
        """Limits that follow the settings for template size, variables and body length."""
        output = max(settings.mail_body_max_chars + settings.mail_body_max_chars // 20, 1)
        return cls(
            source_max_chars=settings.template_max_chars,
            variables_max_bytes=settings.variables_max_bytes,
            output_max_chars=output,
            work_max_chars=max(10 * output, cls.work_max_chars),
            namespace_max_bytes=4 * output,
        )


DEFAULT_LIMITS = TemplateLimits()
_configured: list[TemplateLimits] = []


def configure(settings: Settings) -> None:
    """Use limits that follow the settings in this process (create_app calls this)."""
    _configured[:] = [TemplateLimits.from_settings(settings)]


def configured_limits() -> TemplateLimits:
    """The limits set by ``configure``, or the defaults before it is called."""
    return _configured[0] if _configured else DEFAULT_LIMITS


def _stored_ceiling(limits: TemplateLimits) -> TemplateLimits:
    """What a saved template may reach at send time: one saved before the limits (or before
    they were lowered) keeps working while within twice them, and the old 200,000 characters,
    which still parses well inside the render deadline; beyond that it fails before parsing."""
    return replace(
        limits,
        source_max_chars=max(2 * limits.source_max_chars, 200_000),
        tags_max=2 * limits.tags_max,
        expression_tokens_max=2 * limits.expression_tokens_max,
        path_segments_max=2 * limits.path_segments_max,
        nesting_max=min(2 * limits.nesting_max, Environment.block_nesting_limit),
    )


class TemplateRenderError(Exception):
    """A template that cannot be parsed or rendered, with its position when known."""

    def __init__(self, message: str, *, line: int | None = None, column: int | None = None):
        super().__init__(message)
        self.message = message
        self.line = line
        self.column = column

    def __str__(self) -> str:
        if self.line is None:
            return self.message
        if self.column is None:
            return f"{self.message} (line {self.line})"
        return f"{self.message} (line {self.line}, column {self.column})"


class InvalidVariablesError(TemplateRenderError):
    """The variables are not plain JSON data, or are too large or too deep."""


@dataclass
class RenderedMail:
    """A mail's rendered parts; a part that had no template stays None."""

    subject: str
    html: str | None
    text: str | None


# --- Public functions ---------------------------------------------------------------------


def compile_check(source: str, *, html: bool, limits: TemplateLimits | None = None) -> None:
    """Raise TemplateRenderError (with line and column) if the template would not parse, or
    is over the limits: what a template must pass to be saved."""
    env = _environment(html, limits or configured_limits())
    template = _parse(env, source, draft=True)
    # Unknown filters are otherwise only reported when rendering reaches them.
    analysis = _analyse(template)
    for name, spans in analysis.filters.items():
        if name not in env.filters:
            index = spans[0].index if spans else 0
            raise _error_at(f"unknown filter '{name}'", source, index)


def render(
    source: str,
    variables: Mapping[str, object],
    *,
    html: bool,
    limits: TemplateLimits | None = None,
    draft: bool = False,
) -> str:
    """Render an untrusted template; HTML-escape values when `html` is true.

    A saved template is checked against `_stored_ceiling`; a `draft` (the editor's preview)
    against the limits themselves, as saving it would be."""
    limits = limits or configured_limits()
    data = validate_variables(variables, limits)
    return _render(_environment(html, limits), source, data, draft=draft)


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
    text_env = _environment(False, limits)
    rendered_subject = _render(text_env, subject, data) if subject else ""
    return RenderedMail(
        # A newline in a subject would end the header (and could start a forged one).
        subject=" ".join(part.strip() for part in rendered_subject.splitlines() if part.strip()),
        html=_render(_environment(True, limits), html, data) if html is not None else None,
        text=_render(text_env, text, data) if text is not None else None,
    )


def variables_of(
    source: str, *, limits: TemplateLimits | None = None, draft: bool = False
) -> list[str]:
    """The top-level names a template expects from its caller (not those it assigns itself)."""
    template = _parse(_environment(False, limits or configured_limits()), source, draft=draft)
    # "now" and "today" are provided by python-liquid itself; the caller need not supply them.
    return [name for name in _analyse(template).globals if name not in liquid_builtins]


@dataclass(frozen=True)
class VariableNeeds:
    """What a template asks of a send's variables: ``needed`` names must be given
    (with any value, empty included) when the template is strict; ``optional`` ones may be
    left out. Both are top-level names, sorted."""

    needed: tuple[str, ...]
    optional: tuple[str, ...]


def variable_needs(
    sources: Sequence[str | None], *, limits: TemplateLimits | None = None, draft: bool = False
) -> VariableNeeds:
    """The names the parts of one template need and may use (``VariableNeeds``).

    A name is needed when the template outputs or filters it outside a ``default`` filter,
    wherever that is (inside an ``if`` body too); ``user.name`` needs only ``user``. A name
    used only in an ``if``/``elsif``/``unless``/``case``/``when`` condition, or only under
    ``default``, is optional; the names a template assigns or loops over itself never count.
    """
    env = _environment(False, limits or configured_limits())
    needed: dict[str, None] = {}
    optional: dict[str, None] = {}
    for source in sources:
        if source:
            _needs_of(_parse(env, source, draft=draft), needed, optional)
    return VariableNeeds(
        needed=tuple(sorted(needed)),
        optional=tuple(sorted(name for name in optional if name not in needed)),
    )


_CONDITIONS = (
    "IfNode",
    "UnlessNode",
    "CaseNode",
    "ConditionalBlockNode",
    "MultiExpressionBlockNode",
)


def _needs_of(template: BoundTemplate, needed: dict[str, None], optional: dict[str, None]) -> None:
    """Walk one parsed template as python-liquid's static analysis does (same scopes),
    sorting each top-level name by where it is used."""
    from liquid import RenderContext as _Context
    from liquid.builtin.expressions import FilteredExpression, Path, TernaryFilteredExpression

    assigned: set[str] = set()
    blocks: list[set[str]] = []
    static = _Context(template)

    def local(name: str) -> bool:
        return name in assigned or any(name in block for block in blocks)

    def note(path: Path, soft: bool) -> None:
        head = path.path[0] if path.path else None
        if isinstance(head, Path):
            note(head, soft)
        elif isinstance(head, str) and not local(head) and head not in liquid_builtins:
            (optional if soft else needed)[head] = None
        for segment in path.path[1:]:
            if isinstance(segment, Path):
                note(segment, soft)

    def defaulted(filters: Sequence[Any] | None) -> int:
        """How many filters, from the first, run up to the last ``default`` (0: none)."""
        last = 0
        for i, f in enumerate(filters or (), start=1):
            if f.name == "default":
                last = i
        return last

    def walk(expr: Any, soft: bool) -> None:
        if isinstance(expr, TernaryFilteredExpression):
            tail_soft = soft or defaulted(expr.tail_filters) > 0
            walk(expr.left, tail_soft or defaulted(expr.filters) > 0)
            walk(expr.condition, True)
            if expr.alternative is not None:
                walk(expr.alternative, tail_soft)
            for f in [*(expr.filters or ()), *(expr.tail_filters or ())]:
                for arg in f.children():
                    walk(arg, soft)
            return
        if isinstance(expr, FilteredExpression):
            upto = defaulted(expr.filters)
            walk(expr.left, soft or upto > 0)
            for i, f in enumerate(expr.filters or (), start=1):
                for arg in f.children():
                    walk(arg, soft or i <= upto)
            return
        if isinstance(expr, Path):
            note(expr, soft)
            return
        for child in expr.children():
            walk(child, soft)

    def visit(node: Any) -> None:
        condition = type(node).__name__ in _CONDITIONS
        for expr in node.expressions():
            walk(expr, condition)
        for ident in node.template_scope():
            assigned.add(str(ident))
        blocks.append({str(ident) for ident in node.block_scope()})
        for child in node.children(static, include_partials=False):
            visit(child)
        blocks.pop()

    try:
        for node in template.nodes:
            visit(node)
    except TemplateRenderError:
        raise
    except Exception as exc:
        raise TemplateRenderError(f"the template cannot be analysed: {exc}") from exc


def limit_problems(source: str, *, limits: TemplateLimits | None = None) -> list[str]:
    """What a saved template is over, before any parse (empty: within the limits); the
    migration that introduced the limits lists stored templates with it."""
    limits = limits or configured_limits()
    try:
        _check_shape(source, limits)
    except TemplateRenderError as exc:
        # Broken delimiters are a template error, not a limit: they never parsed.
        return [] if isinstance(exc, _ShapeError) and not exc.limit else [str(exc)]
    return []


def validate_variables(
    variables: Mapping[str, object], limits: TemplateLimits | None = None
) -> dict[str, object]:
    """Check that variables are plain JSON data within the size limits; return them as a dict."""
    limits = limits or configured_limits()
    if not isinstance(variables, Mapping):
        raise InvalidVariablesError("variables must be a JSON object")
    stack: list[tuple[object, int, str]] = [(variables, 0, "variables")]
    while stack:
        value, depth, where = stack.pop()
        if depth > limits.variables_max_depth:
            raise InvalidVariablesError(
                f"variables are nested too deeply (more than {limits.variables_max_depth})"
            )
        if value is None or isinstance(value, str | bool | int):
            continue
        if isinstance(value, float):
            if not math.isfinite(value):
                raise InvalidVariablesError(f"{where} is not a finite number")
            continue
        if isinstance(value, list):
            stack.extend((item, depth + 1, f"{where}[{i}]") for i, item in enumerate(value))
            continue
        # The top level may be any mapping (the caller's), anything below must be a dict.
        if isinstance(value, dict) or (depth == 0 and isinstance(value, Mapping)):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise InvalidVariablesError(f"{where} has a key that is not a string")
                stack.append((item, depth + 1, f"{where}.{key}"))
            continue
        raise InvalidVariablesError(f"{where} is a {type(value).__name__}, not JSON data")
    data = dict(variables)
    try:
        encoded = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    except ValueError as exc:  # e.g. an integer with more digits than Python will print
        raise InvalidVariablesError(f"variables cannot be encoded as JSON: {exc}") from None
    size = len(encoded.encode("utf-8"))
    if size > limits.variables_max_bytes:
        raise InvalidVariablesError(
            f"variables are too large: {size} bytes of JSON, the limit is "
            f"{limits.variables_max_bytes}"
        )
    return data


# --- Rendering ----------------------------------------------------------------------------


class _ShapeError(TemplateRenderError):
    """Found by the scan before parsing: a limit (``limit``) or broken delimiters."""

    def __init__(self, message: str, source: str, index: int, *, limit: bool) -> None:
        line, column = _line_col(source, index)
        super().__init__(message, line=line, column=column)
        self.limit = limit


# python-liquid lexes with one regular expression that backtracks badly on some malformed
# input: an unclosed "{{", "{%", "{% raw %}" or "{% doc %}" makes it rescan to the end of the
# source from every later delimiter, and a tag or output that is nothing but whitespace
# backtracks over every split of that whitespace. Both are quadratic: 8,000 characters took
# seconds and 200,000 would take hours. This linear scan rejects them before lexing, and
# counts what a parse costs (tags, expression tokens, path segments, nesting) on the way.
_OPENER = re.compile(r"\{[{%]")
_TAG_NAME = re.compile(r"\{%-?\s*(\w+)")
_VERBATIM_END = {
    "raw": re.compile(r"\{%-?\s*endraw\s*-?%\}"),
    "doc": re.compile(r"\{%-?\s*enddoc\s*-?%\}"),
}
_MAX_BLANK_TAG = 64  # whitespace after a tag name with no expression, e.g. "{% else    %}"
_BLOCKS = frozenset({"if", "unless", "for", "case", "capture", "tablerow", "comment", "ifchanged"})
_UNCOUNTED = frozenset({"comment", "raw", "doc"})  # their expression, if any, is not parsed
_EXPRESSION_TOKEN = re.compile(
    r"""
      "[^"]*" | '[^']*'
    | (?P<path>[A-Za-z_][\w-]*\??(?:\s*(?:\.\s*[A-Za-z_0-9][\w-]*\??|\[[^\[\]]*\]))*)
    | \d+(?:\.\d+)? | \.\. | (?P<open>\() | (?P<close>\)) | \S
    """,
    re.VERBOSE,
)
_LIQUID_LINE = re.compile(r"[^\n]+")


class _Shape:
    """What the scan has counted so far, checked against the limits as it goes."""

    __slots__ = ("depth", "limits", "source", "tags", "tokens")

    def __init__(self, source: str, limits: TemplateLimits) -> None:
        self.source = source
        self.limits = limits
        self.tags = 0
        self.tokens = 0
        self.depth = 0

    def fail(self, message: str, index: int) -> _ShapeError:
        return _ShapeError(message, self.source, index, limit=True)

    def tag(self, name: str | None, index: int) -> None:
        self.tags += 1
        if self.tags > self.limits.tags_max:
            raise self.fail(
                f"the template has too many tags (limit {self.limits.tags_max} "
                "{{ }} and {% %}, each line of a {% liquid %} tag counted)",
                index,
            )
        if name in _BLOCKS:
            self.depth += 1
            if self.depth > self.limits.nesting_max:
                raise self.fail(
                    f"blocks are nested too deeply (limit {self.limits.nesting_max})", index
                )
        elif name is not None and name.startswith("end"):
            self.depth = max(self.depth - 1, 0)

    def expression(self, start: int, end: int) -> None:
        """Count the tokens of the expression at source[start:end]."""
        limits = self.limits
        parens = 0
        for token in _EXPRESSION_TOKEN.finditer(self.source, start, end):
            path = token.group("path")
            if path is not None:
                segments = 1 + path.count(".") + path.count("[")
                if segments > limits.path_segments_max:
                    raise self.fail(
                        f"a variable path is too long: {segments} segments, "
                        f"the limit is {limits.path_segments_max}",
                        token.start(),
                    )
                self.tokens += segments
            else:
                self.tokens += 1
                if token.group("open") is not None:
                    parens += 1
                    if parens > limits.nesting_max:
                        raise self.fail(
                            f"parentheses are nested too deeply (limit {limits.nesting_max})",
                            token.start(),
                        )
                elif token.group("close") is not None:
                    parens -= 1
            if self.tokens > limits.expression_tokens_max:
                raise self.fail(
                    "the template has too many expressions (limit "
                    f"{limits.expression_tokens_max} names, values and operators)",
                    token.start(),
                )

    def liquid(self, start: int, end: int) -> None:
        """A {% liquid %} tag: one tag per line."""
        for line in _LIQUID_LINE.finditer(self.source, start, end):
            words = line.group().split(None, 1)
            if not words:
                continue
            name = words[0]
            self.tag(name, line.start())
            if not name.startswith("#"):
                self.expression(line.start() + line.group().index(name) + len(name), line.end())


def _check_shape(source: str, limits: TemplateLimits) -> None:
    """Refuse, before parsing, a template over the limits or with delimiters that would make
    python-liquid's lexer quadratic; one linear pass."""
    if not isinstance(source, str):
        raise TemplateRenderError("a template must be text")
    if len(source) > limits.source_max_chars:
        raise TemplateRenderError(
            f"the template is too long: {len(source)} characters, "
            f"the limit is {limits.source_max_chars}"
        )
    shape = _Shape(source, limits)
    pos = 0
    while opener := _OPENER.search(source, pos):
        start = opener.start()
        output = source[start + 1] == "{"
        end = source.find("}}" if output else "%}", start + 2)
        if end < 0:
            closing = "}}" if output else "%}"
            raise _ShapeError(
                f"'{opener.group()}' is never closed by '{closing}'", source, start, limit=False
            )
        pos = end + 2
        if output:
            if not source[start + 2 : end].strip(" \t\r\n\f\v-"):
                raise _ShapeError("empty output statement", source, start, limit=False)
            shape.tag(None, start)
            shape.expression(start + 2, end)
            continue
        name = _TAG_NAME.match(source, start, end)
        if name is None:
            shape.tag(None, start)  # an inline comment; python-liquid reports the rest itself
            continue
        tag = name.group(1)
        shape.tag(tag, start)
        rest = source[name.end() : end]
        if len(rest) > _MAX_BLANK_TAG and not rest.strip(" \t\r\n\f\v-"):
            raise _ShapeError(f"too much whitespace in the '{tag}' tag", source, start, limit=False)
        if tag == "liquid":
            shape.liquid(name.end(), end)
        elif tag not in _UNCOUNTED:
            shape.expression(name.end(), end)
        verbatim_end = _VERBATIM_END.get(tag)
        if verbatim_end is not None:
            block_end = verbatim_end.search(source, pos)
            if block_end is None:
                raise _ShapeError(
                    f"'{{% {tag} %}}' is never closed by '{{% end{tag} %}}'",
                    source,
                    start,
                    limit=False,
                )
            pos = block_end.end()


# Parsed templates, kept per process so that a batch with one template parses it once.
# The key is the source itself with what it is parsed for, so an edited template
# is a new entry and no version has to be passed in; errors are kept too, so a broken
# template fails every record of its batch without parsing again.
_CACHE_ENTRIES = 256
_CACHE_CHARS = 16_000_000  # source characters kept in all; a parse tree is some times more
_ParseKey = tuple[bool, TemplateLimits, bool, str]


class _ParseCache:
    """A small LRU of parse results, shared by a process's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[_ParseKey, BoundTemplate | TemplateRenderError] = OrderedDict()
        self._chars = 0
        self.parses = 0  # for tests: how many sources were actually parsed

    def get(self, key: _ParseKey) -> BoundTemplate | TemplateRenderError | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def put(self, key: _ParseKey, value: BoundTemplate | TemplateRenderError) -> None:
        with self._lock:
            self.parses += 1
            if key in self._entries:
                return
            self._entries[key] = value
            self._chars += len(key[3])
            while len(self._entries) > _CACHE_ENTRIES or (
                self._chars > _CACHE_CHARS and len(self._entries) > 1
            ):
                old, _ = self._entries.popitem(last=False)
                self._chars -= len(old[3])

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._chars = 0
            self.parses = 0


_parsed = _ParseCache()


def _parse(env: _SandboxEnvironment, source: str, *, draft: bool = False) -> BoundTemplate:
    """The parsed template, from the cache when this source was parsed before. A draft is
    held to the limits; a saved template to `_stored_ceiling`."""
    if not isinstance(source, str):
        raise TemplateRenderError("a template must be text")
    key = (env.autoescape, env.limits, draft, source)
    found = _parsed.get(key)
    if found is None:
        try:
            _check_shape(source, env.limits if draft else _stored_ceiling(env.limits))
            found = env.from_string(source)
        except Exception as exc:
            found = _to_render_error(exc, source, env.limits, env)
        _parsed.put(key, found)
    if isinstance(found, TemplateRenderError):
        # A copy: the kept one is raised in many threads and must not collect tracebacks.
        raise TemplateRenderError(found.message, line=found.line, column=found.column)
    return found


def _analyse(template: BoundTemplate) -> TemplateAnalysis:
    """python-liquid's static analysis; partials are never loaded (there are none)."""
    try:
        return template.analyze(include_partials=False)
    except Exception as exc:
        raise TemplateRenderError(f"the template cannot be analysed: {exc}") from exc


def _render(
    env: _SandboxEnvironment, source: str, data: Mapping[str, object], *, draft: bool = False
) -> str:
    budget = _Budget(env.limits)  # before parsing: the deadline covers the parse too
    template = _parse(env, source, draft=draft)
    context = _SandboxContext(template, globals=template.make_globals(data), budget=budget)
    buffer = _Buffer(env.limits.output_max_chars, budget)
    try:
        template.render_with_context(context, buffer)
    except Exception as exc:
        # Any failure inside the engine is this template's failure: the caller marks the
        # record TEMPLATE_NOT_RESOLVABLE instead of the worker crashing on tenant input.
        raise _to_render_error(exc, source, env.limits, env) from exc
    return buffer.getvalue()


def _to_render_error(
    exc: Exception, source: str, limits: TemplateLimits, env: Environment | None = None
) -> TemplateRenderError:
    if isinstance(exc, TemplateRenderError):
        return exc
    if not isinstance(exc, LiquidError):
        return TemplateRenderError(f"the template failed: {type(exc).__name__}: {exc}")
    token = exc.token
    message = _friendly_message(exc, limits)
    if token is not None and token.start_index >= 0 and token.source == source:
        return _error_at(message, source, token.start_index)
    found = _locate(message, source, env) if isinstance(exc, LiquidSyntaxError) else None
    unclosed = _EXPECTED_END.match(message)
    if unclosed is not None:
        end = unclosed.group(1)
        message = f"the {{% {end.removeprefix('end')} %}} block is never closed: add {{% {end} %}}"
    if found is not None:
        return _error_at(message, source, found)
    return TemplateRenderError(message)


# Markup as python-liquid reads it: an output statement, or a tag and its name.
_MARKUP = re.compile(r"\{\{.*?\}\}|\{%-?\s*(\w*).*?%\}", re.S)
_BLOCK_ENDS = {name: f"end{name}" for name in (*_BLOCKS, "raw", "doc")}
_EXPECTED_END = re.compile(r"expected tag (end\w+)")


def _locate(message: str, source: str, env: Environment | None) -> int | None:
    """Where a syntax error is, when the engine says what but not where (it reports the end
    of the expression it was reading, which has no position): the block that is never
    closed (an unclosed ``{% if %}``), or else the first statement that fails on its own
    with the same message (``{% for x in %}``). Only ever on the error path."""
    unclosed = _EXPECTED_END.match(message)
    if unclosed is not None:
        stack: list[tuple[str, int]] = []
        for markup in _MARKUP.finditer(source):
            name = markup.group(1) or ""
            if name in _BLOCK_ENDS:
                stack.append((name, markup.start()))
            elif stack and _BLOCK_ENDS[stack[-1][0]] == name:
                stack.pop()
        return next(
            (at for name, at in reversed(stack) if _BLOCK_ENDS[name] == unclosed.group(1)), None
        )
    if env is None:
        return None
    for markup in _MARKUP.finditer(source):
        name = markup.group(1)
        snippet = markup.group()
        if name in _BLOCK_ENDS:
            snippet += "{% " + _BLOCK_ENDS[name] + " %}"
        elif name is not None and (name.startswith("end") or name in _INNER_TAGS):
            continue  # only meaningful inside its block
        try:
            env.from_string(snippet)
        except LiquidError as exc:
            if str(exc.message) == message:
                return markup.start()
    return None


_INNER_TAGS = frozenset({"else", "elsif", "when", "break", "continue"})


def _friendly_message(exc: LiquidError, limits: TemplateLimits) -> str:
    """Say which limit a tenant admin hit, in words, rather than the engine's class name."""
    match exc:
        case LoopIterationLimitError():
            return f"loops run too many times (limit {limits.loop_iterations} per loop nest)"
        case OutputStreamLimitError():
            return f"the output is too long (limit {limits.output_max_chars} characters)"
        case LocalNamespaceLimitError():
            return "assigned variables are too large"
        case BlockNestingError():
            return f"blocks are nested too deeply (limit {Environment.block_nesting_limit})"
        case ContextDepthError():
            return f"the template nests too deeply (limit {limits.context_depth})"
        case _:
            return str(exc.message)


def _error_at(message: str, source: str, index: int) -> TemplateRenderError:
    line, column = _line_col(source, index)
    return TemplateRenderError(message, line=line, column=column)


def _line_col(source: str, index: int) -> tuple[int, int]:
    """1-based line and column of a character index."""
    line_start = source.rfind("\n", 0, index) + 1
    return source.count("\n", 0, index) + 1, index - line_start + 1


# --- The sandbox ----------------------------------------------------------------------------


class _LimitError(ResourceLimitError):
    """One of our own budgets ran out (python-liquid's are reported by its own classes)."""

    def __init__(self, message: str, token: Token | None = None) -> None:
        super().__init__(message, token=token)


_one = threading.local()
# The render deadline counts this thread's CPU time, not the wall clock: a runaway template
# burns CPU, while a render that merely waits (for the GIL behind a busy pool's other
# workers, or on a machine loaded past its cores) is not the template's doing, and on the
# wall clock it failed legitimate templates for good (TEMPLATE_NOT_RESOLVABLE) under load.
_clock = time.thread_time


@contextmanager
def one_deadline(limits: TemplateLimits | None = None) -> Iterator[None]:
    """The renders inside the block (a mail's subject, HTML and text) share one render
    deadline, so a record costs at most one deadline's CPU, not one per part."""
    timeout = (limits or configured_limits()).render_timeout_s
    outer = getattr(_one, "deadline", None)
    _one.deadline = _clock() + timeout if outer is None else outer
    try:
        yield
    finally:
        _one.deadline = outer


class _Budget:
    """Per-render counters shared by the render context and every buffer it writes to."""

    __slots__ = ("deadline", "iterations", "limits", "ticks", "work")

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.deadline = _clock() + limits.render_timeout_s
        shared = getattr(_one, "deadline", None)
        if shared is not None:
            self.deadline = min(self.deadline, shared)
        self.iterations = 0
        self.work = 0
        self.ticks = 0

    def tick(self, token: Token | None = None) -> None:
        # The clock at the first tick (after the parse) and every 16th after it: reading a
        # thread's CPU time is a system call (0.6 us), and a render makes hundreds of ticks,
        # each bounded by the deterministic budgets above.
        self.ticks += 1
        if self.ticks & 15 == 1 and _clock() > self.deadline:
            raise _LimitError(
                f"the template took too long to render (limit {self.limits.render_timeout_s} s)",
                token,
            )

    def add_iterations(self, count: int, token: Token | None = None) -> None:
        self.iterations += count
        if self.iterations > self.limits.total_iterations:
            raise _LimitError(
                f"loops run too many times in total (limit {self.limits.total_iterations})",
                token,
            )
        self.tick(token)

    def add_work(self, chars: int, token: Token | None = None) -> None:
        self.work += chars
        if self.work > self.limits.work_max_chars:
            raise _LimitError(
                "the template builds too much text "
                f"(limit {self.limits.work_max_chars} characters in total)",
                token,
            )
        self.tick(token)


class _Buffer(LimitedStringIO):
    """An output buffer that counts characters (not UTF-8 bytes) and charges the budget."""

    def __init__(self, limit: int, budget: _Budget) -> None:
        # newline="\n": write text as is (python-liquid's buffer would turn "\r\n" into "\n").
        super().__init__(limit=limit, newline="\n")
        self._budget = budget

    def write(self, s: str, /) -> int:
        if s:
            self.size += len(s)
            if self.size > self.limit:
                raise OutputStreamLimitError("output stream limit reached", token=None)
            self._budget.add_work(len(s))
        return StringIO.write(self, s)


class _SandboxContext(RenderContext):
    """A render context that enforces our budgets at every hook python-liquid offers."""

    __slots__ = ("_budget",)
    _budget: _Budget

    def __init__(
        self,
        template: BoundTemplate,
        *,
        globals: Mapping[str, object] | None = None,
        disabled_tags: list[str] | None = None,
        copy_depth: int = 0,
        parent_context: RenderContext | None = None,
        loop_iteration_carry: int = 1,
        local_namespace_size_carry: int = 0,
        budget: _Budget | None = None,
    ) -> None:
        super().__init__(
            template,
            globals=globals,
            disabled_tags=disabled_tags,
            copy_depth=copy_depth,
            parent_context=parent_context,
            loop_iteration_carry=loop_iteration_carry,
            local_namespace_size_carry=local_namespace_size_carry,
        )
        # A copied context (python-liquid copies for some tags) shares its parent's budget.
        if budget is None and isinstance(parent_context, _SandboxContext):
            budget = parent_context._budget
        if budget is None:
            raise TypeError("a sandboxed render context needs a budget")
        self._budget = budget

    def get(
        self, path: list[object], *, token: Token | None, default: object = UNDEFINED
    ) -> object:
        self._budget.tick(token)
        return super().get(path, token=token, default=default)

    def assign(self, key: str, val: Any) -> None:
        self._budget.tick()
        super().assign(key, val)

    @contextmanager
    def loop(
        self, namespace: Mapping[str, object], forloop: ForLoop | TableRow
    ) -> Iterator[RenderContext]:
        self._budget.add_iterations(forloop.length)
        with super().loop(namespace, forloop) as context:
            yield context

    def stopindex(self, key: str, index: int | None = None) -> int:
        # Called with the loop's stop position before `reversed` copies the iterable or
        # `offset:` skips through it, which is the only moment to refuse a huge range.
        if index is not None and index > self._budget.limits.list_max_items:
            raise _LimitError(
                "a loop reaches too far into its collection "
                f"(limit {self._budget.limits.list_max_items} items)"
            )
        return super().stopindex(key, index)

    def get_buffer(self, buf: TextIO | None = None) -> StringIO:
        self._budget.tick()
        carry = buf.size if isinstance(buf, LimitedStringIO) else 0
        return _Buffer(self._budget.limits.output_max_chars - carry, self._budget)

    def filter(self, name: str, token: Token | None) -> Callable[..., object]:
        func = super().filter(name, token)
        budget = self._budget
        precheck = _FILTER_PRECHECKS.get(name)

        def guarded(left: object, *args: object, **kwargs: object) -> object:
            budget.tick(token)
            for value in (left, *args):
                if isinstance(value, range) and len(value) > budget.limits.list_max_items:
                    raise _LimitError(f"{name}: the range is too long", token)
            if precheck is not None:
                precheck(budget.limits, name, left, args, token)
            result = func(left, *args, **kwargs)
            _check_filter_result(budget, name, result, token)
            return result

        return guarded


def _check_filter_result(budget: _Budget, name: str, result: object, token: Token | None) -> None:
    limits = budget.limits
    if isinstance(result, str):
        if len(result) > limits.output_max_chars:
            raise _LimitError(f"{name}: the result is too long", token)
        budget.add_work(len(result), token)
    elif isinstance(result, list | tuple):
        if len(result) > limits.list_max_items:
            raise _LimitError(f"{name}: the result has too many items", token)
        budget.add_work(len(result), token)
    elif isinstance(result, int) and result.bit_length() > limits.int_max_bits:
        raise _LimitError(f"{name}: the number is too large", token)


# Filters whose result can dwarf their inputs are estimated before they run.


def _precheck_replace(
    limits: TemplateLimits, name: str, left: object, args: Sequence[object], token: Token | None
) -> None:
    if not args:
        return
    text = "" if left is None else str(left)
    old = str(args[0])
    new = str(args[1]) if len(args) > 1 else ""
    growth = len(new) - len(old)
    if growth > 0 and len(text) + text.count(old) * growth > limits.output_max_chars:
        raise _LimitError(f"{name}: the result would be too long", token)


def _precheck_join(
    limits: TemplateLimits, name: str, left: object, args: Sequence[object], token: Token | None
) -> None:
    if not isinstance(left, list | tuple | range):
        return
    separator = len(str(args[0])) if args else 1
    total = 0
    for item in left:
        total += (len(item) if isinstance(item, str) else len(str(item))) + separator
        if total > limits.output_max_chars:
            raise _LimitError(f"{name}: the result would be too long", token)


_Precheck = Callable[[TemplateLimits, str, object, Sequence[object], "Token | None"], None]
_FILTER_PRECHECKS: dict[str, _Precheck] = {
    "replace": _precheck_replace,
    "join": _precheck_join,
}

# python-liquid's uniq compares every item with every earlier one (it supports unhashable
# items): 30,000 distinct items take seconds. Plain values take a linear path; the quadratic
# one is kept for lists of objects, and capped (1,000 objects: about 50 ms).
_UNIQ_QUADRATIC_MAX = 1_000


def _fast_uniq(original: Callable[..., object]) -> Callable[..., object]:
    """uniq in linear time for lists of plain values, which is what templates have."""

    def uniq(sequence: object, key: object = None) -> object:
        if (
            key is None
            and isinstance(sequence, list)
            and all(item is None or isinstance(item, str | int | float) for item in sequence)
        ):
            return list(dict.fromkeys(sequence))  # keeps first occurrences, like the original
        if isinstance(sequence, list | tuple) and len(sequence) > _UNIQ_QUADRATIC_MAX:
            raise _LimitError(f"uniq: too many items (limit {_UNIQ_QUADRATIC_MAX})")
        return original(sequence, key)

    return uniq


class _SandboxEnvironment(Environment):
    """A Liquid environment that reads no files and carries its TemplateLimits."""

    def __init__(self, *, html: bool, limits: TemplateLimits) -> None:
        # An empty dict loader: nothing can be loaded, whatever a template asks for.
        super().__init__(autoescape=html, loader=DictLoader({}))
        self.limits = limits
        # Removed so that a template naming another one fails when saved, not when sent.
        for tag in ("include", "render"):
            self.tags.pop(tag, None)
        self.add_filter("uniq", _fast_uniq(self.filters["uniq"]))
        self.add_filter("strip_html", _strip_html)


@functools.lru_cache(maxsize=16)
def _environment(html: bool, limits: TemplateLimits) -> _SandboxEnvironment:
    """One environment per (HTML or text, limits): python-liquid's limits are class attributes."""

    class _Limited(_SandboxEnvironment):
        loop_iteration_limit = limits.loop_iterations
        output_stream_limit = limits.output_max_chars
        local_namespace_limit = limits.namespace_max_bytes
        context_depth_limit = limits.context_depth

    return _Limited(html=html, limits=limits)


# --- HTML to text ---------------------------------------------------------------------------

_SKIPPED = frozenset({"script", "style", "head", "title", "template"})
_PARAGRAPHS = frozenset(
    {"p", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "pre", "table", "ul", "ol", "hr"}
)
_LINES = frozenset(
    {
        "address", "article", "aside", "dd", "div", "dl", "dt", "fieldset", "figcaption",
        "figure", "footer", "form", "header", "li", "main", "nav", "section", "tr",
    }
)  # fmt: skip
_WHITESPACE = re.compile(r"\s+")

# html.parser rescans to the end of the input from every "<" that does not finish a construct:
# "<a" repeated 80,000 times took 18 s, "<!--" repeated 80,000 times 42 s (Python 3.11). The
# HTML here is tenant-made, so it is first cut into pieces in one linear pass: text, comments
# (dropped), declarations (dropped), and tags that are complete with balanced quotes and no
# "<" outside their quoted values. What html.parser then sees always finishes what it starts.
_TAG = re.compile(r"""</?[A-Za-z][^<>'"]*(?:(?:"[^"]*"|'[^']*')[^<>'"]*)*>""")
_DECLARATION = re.compile(r"<[!?][^<>]*>")  # <!DOCTYPE ...>, <![CDATA[...]]>, <?xml ...?>
_TAG_NAME_OF = re.compile(r"</?([A-Za-z][^\s/>]*)")


def _html_pieces(html: str) -> Iterator[tuple[bool, str]]:
    """Split HTML into (is_tag, piece) in one pass; comments and declarations are left out."""
    pos = text_start = 0
    while (lt := html.find("<", pos)) >= 0:
        tag = None
        if html.startswith("<!--", lt):
            end = html.find("-->", lt + 4)
            resume = len(html) if end < 0 else end + 3  # an unclosed comment hides the rest
        elif match := _TAG.match(html, lt) or _DECLARATION.match(html, lt):
            resume = match.end()
            tag = match.group() if match.re is _TAG else None
        else:
            pos = lt + 1  # a "<" that starts nothing is text
            continue
        if lt > text_start:
            yield False, html[text_start:lt]
        if tag is not None:
            yield True, tag
        pos = text_start = resume
    if text_start < len(html):
        yield False, html[text_start:]


def _safe_html(html: str) -> str:
    """The same document with every stray "<" escaped and comments removed."""
    return "".join(
        piece if is_tag else piece.replace("<", "&lt;") for is_tag, piece in _html_pieces(html)
    )


@with_environment
def _strip_html(value: object, *, environment: Environment) -> str:
    """python-liquid's strip_html (tags, comments, script and style removed), in linear time."""
    text = "" if value is None else str(value)
    kept: list[str] = []
    hidden = 0  # inside <script> or <style>
    for is_tag, piece in _html_pieces(text):
        if not is_tag:
            if not hidden:
                kept.append(piece)
            continue
        name = _TAG_NAME_OF.match(piece)
        if name and name.group(1).lower() in ("script", "style"):
            hidden = max(hidden + (-1 if piece.startswith("</") else 1), 0)
    stripped = "".join(kept)
    return Markup(stripped) if environment.autoescape and isinstance(value, Markup) else stripped


class _TextExtractor(HTMLParser):
    """Collects the visible text of an HTML document, with line breaks where blocks end."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._pending = 0  # line breaks owed before the next text: 0, 1 or 2 (a blank line)
        self._skip_depth = 0
        self._links: list[tuple[str | None, int]] = []  # (href, index of the first part)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "body":
            self._skip_depth = 0  # a <head> whose end tag was left out must not hide the body
        if tag in _SKIPPED:
            self._skip_depth += 1
        if self._skip_depth:
            return
        if tag == "br":
            self._flush()
            self.parts.append("\n")
        elif tag in _PARAGRAPHS:
            self._break(2)
        elif tag in _LINES:
            self._break(1)
        elif tag in ("td", "th") and not self._pending:
            self.parts.append(" ")
        if tag == "li":
            self._flush()
            self.parts.append("- ")
        elif tag == "a":
            self._links.append((dict(attrs).get("href"), len(self.parts)))

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIPPED:
            self._skip_depth = max(self._skip_depth - 1, 0)
            return
        if self._skip_depth:
            return
        if tag == "a" and self._links:
            href, start = self._links.pop()
            self._end_link(href, start)
        elif tag in _PARAGRAPHS:
            self._break(2)
        elif tag in _LINES:
            self._break(1)

    def handle_data(self, data: str) -> None:
        if self._skip_depth:
            return
        text = _WHITESPACE.sub(" ", data)
        if text.strip():
            self._flush()
            self.parts.append(text)
        elif not self._pending:
            self.parts.append(" ")  # whitespace between inline elements still separates words

    def _break(self, lines: int) -> None:
        # Breaks are owed rather than written, so that nested or adjacent blocks
        # (</li><li>, </p><div>) give one break, not one per tag.
        self._pending = max(self._pending, lines)

    def _flush(self) -> None:
        if self._pending and self.parts:
            self.parts.append("\n" * self._pending)
        self._pending = 0

    def _end_link(self, href: str | None, start: int) -> None:
        url = (href or "").strip()
        if not url or url.startswith("#") or url.lower().startswith("javascript:"):
            return
        label = " ".join("".join(self.parts[start:]).split())
        shown = url.removeprefix("mailto:") if url.lower().startswith("mailto:") else url
        if not label:
            self._flush()
            self.parts.append(shown)
        elif label != shown:
            self.parts.append(f" ({shown})")


def html_to_text(html: str) -> str:
    """A plain-text alternative of an HTML body: visible text, links as "text (url)"."""
    parser = _TextExtractor()
    parser.feed(_safe_html(html))
    parser.close()
    lines = [" ".join(line.split()) for line in "".join(parser.parts).split("\n")]
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):  # at most one blank line between paragraphs
            out.append(line)
    return "\n".join(out).strip()
