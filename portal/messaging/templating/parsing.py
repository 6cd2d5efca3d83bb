"""From source to parsed template: a linear scan before parsing that refuses what would make
python-liquid's lexer quadratic and counts what a parse costs against the limits; the parse
cache a process's threads share; and a failed parse or render told as ``TemplateRenderError``
with its line and column."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict

from liquid import BoundTemplate, Environment
from liquid.exceptions import (
    BlockNestingError,
    ContextDepthError,
    LiquidError,
    LiquidSyntaxError,
    LocalNamespaceLimitError,
    LoopIterationLimitError,
    OutputStreamLimitError,
)
from liquid.static_analysis import TemplateAnalysis

from portal.messaging.templating.limits import TemplateLimits, stored_ceiling
from portal.messaging.templating.sandbox import SandboxEnvironment


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


class ShapeError(TemplateRenderError):
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

    def fail(self, message: str, index: int) -> ShapeError:
        return ShapeError(message, self.source, index, limit=True)

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


def check_shape(source: str, limits: TemplateLimits) -> None:
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
            raise ShapeError(
                f"'{opener.group()}' is never closed by '{closing}'", source, start, limit=False
            )
        pos = end + 2
        if output:
            if not source[start + 2 : end].strip(" \t\r\n\f\v-"):
                raise ShapeError("empty output statement", source, start, limit=False)
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
            raise ShapeError(f"too much whitespace in the '{tag}' tag", source, start, limit=False)
        if tag == "liquid":
            shape.liquid(name.end(), end)
        elif tag not in _UNCOUNTED:
            shape.expression(name.end(), end)
        verbatim_end = _VERBATIM_END.get(tag)
        if verbatim_end is not None:
            block_end = verbatim_end.search(source, pos)
            if block_end is None:
                raise ShapeError(
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


def parse(env: SandboxEnvironment, source: str, *, draft: bool = False) -> BoundTemplate:
    """The parsed template, from the cache when this source was parsed before. A draft is
    held to the limits; a saved template to `stored_ceiling`."""
    if not isinstance(source, str):
        raise TemplateRenderError("a template must be text")
    key = (env.autoescape, env.limits, draft, source)
    found = _parsed.get(key)
    if found is None:
        try:
            check_shape(source, env.limits if draft else stored_ceiling(env.limits))
            found = env.from_string(source)
        except Exception as exc:
            found = to_render_error(exc, source, env.limits, env)
        _parsed.put(key, found)
    if isinstance(found, TemplateRenderError):
        # A copy: the kept one is raised in many threads and must not collect tracebacks.
        raise TemplateRenderError(found.message, line=found.line, column=found.column)
    return found


def analyse(template: BoundTemplate) -> TemplateAnalysis:
    """python-liquid's static analysis; partials are never loaded (there are none)."""
    try:
        return template.analyze(include_partials=False)
    except Exception as exc:
        raise TemplateRenderError(f"the template cannot be analysed: {exc}") from exc


def to_render_error(
    exc: Exception, source: str, limits: TemplateLimits, env: Environment | None = None
) -> TemplateRenderError:
    if isinstance(exc, TemplateRenderError):
        return exc
    if not isinstance(exc, LiquidError):
        return TemplateRenderError(f"the template failed: {type(exc).__name__}: {exc}")
    token = exc.token
    message = _friendly_message(exc, limits)
    if token is not None and token.start_index >= 0 and token.source == source:
        return error_at(message, source, token.start_index)
    found = _locate(message, source, env) if isinstance(exc, LiquidSyntaxError) else None
    unclosed = _EXPECTED_END.match(message)
    if unclosed is not None:
        end = unclosed.group(1)
        message = f"the {{% {end.removeprefix('end')} %}} block is never closed: add {{% {end} %}}"
    if found is not None:
        return error_at(message, source, found)
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


def error_at(message: str, source: str, index: int) -> TemplateRenderError:
    line, column = _line_col(source, index)
    return TemplateRenderError(message, line=line, column=column)


def _line_col(source: str, index: int) -> tuple[int, int]:
    """1-based line and column of a character index."""
    line_start = source.rfind("\n", 0, index) + 1
    return source.count("\n", 0, index) + 1, index - line_start + 1
