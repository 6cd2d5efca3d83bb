"""A send's variables: the names a template expects (``variables_of``) and which of them it
needs or may do without (``variable_needs``), and the check that variables are plain JSON
data within the limits (``validate_variables``)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from liquid import BoundTemplate
from liquid.context import builtin as liquid_builtins

from portal.messaging.templating.limits import TemplateLimits, configured_limits
from portal.messaging.templating.parsing import TemplateRenderError, analyse, parse
from portal.messaging.templating.sandbox import environment


class InvalidVariablesError(TemplateRenderError):
    """The variables are not plain JSON data, or are too large or too deep."""


def variables_of(
    source: str, *, limits: TemplateLimits | None = None, draft: bool = False
) -> list[str]:
    """The top-level names a template expects from its caller (not those it assigns itself)."""
    template = parse(environment(False, limits or configured_limits()), source, draft=draft)
    # "now" and "today" are provided by python-liquid itself; the caller need not supply them.
    return [name for name in analyse(template).globals if name not in liquid_builtins]


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
    env = environment(False, limits or configured_limits())
    needed: dict[str, None] = {}
    optional: dict[str, None] = {}
    for source in sources:
        if source:
            _needs_of(parse(env, source, draft=draft), needed, optional)
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
