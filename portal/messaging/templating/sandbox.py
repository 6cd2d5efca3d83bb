"""The sandbox a template renders in: an environment that reads no files and has no
``include`` or ``render``, and a render context that charges every lookup, filter call,
assignment, loop and write to one budget per render (iterations in total, text built, items,
integer size) with a deadline on the rendering thread's CPU time as the backstop."""

from __future__ import annotations

import functools
import gc
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from io import StringIO
from typing import TYPE_CHECKING, Any, TextIO

from liquid import BoundTemplate, DictLoader, Environment, RenderContext
from liquid.exceptions import OutputStreamLimitError, ResourceLimitError
from liquid.output import LimitedStringIO
from liquid.undefined import UNDEFINED

from portal.messaging.templating.html_text import strip_html
from portal.messaging.templating.limits import TemplateLimits, configured_limits

if TYPE_CHECKING:
    from liquid.builtin.tags.for_tag import ForLoop
    from liquid.builtin.tags.tablerow_tag import TableRow
    from liquid.token import Token


class _LimitError(ResourceLimitError):
    """One of our own budgets ran out (python-liquid's are reported by its own classes)."""

    def __init__(self, message: str, token: Token | None = None) -> None:
        super().__init__(message, token=token)


_one = threading.local()
# The render deadline counts this thread's CPU time, not the wall clock: a runaway template
# burns CPU, while a render that merely waits (for the GIL behind a busy pool's other
# workers, or on a machine loaded past its cores) is not the template's doing, and on the
# wall clock it failed legitimate templates for good (TEMPLATE_NOT_RESOLVABLE) under load.
# Nor is the garbage collector's time: a full collection runs in whichever thread allocated
# last, and in a process with a large heap it took longer than a render's whole deadline (a
# one-character template failed so). The collector's CPU in each thread is left out; what a
# template may allocate is bounded by the deterministic budgets above all the same.
_collecting = threading.local()


def _collector(phase: str, _info: dict[str, int]) -> None:
    if phase == "start":
        _collecting.started = time.thread_time()
    else:
        started = getattr(_collecting, "started", None)
        if started is not None:
            _collecting.spent = getattr(_collecting, "spent", 0.0) + time.thread_time() - started
            _collecting.started = None


gc.callbacks.append(_collector)


def _clock() -> float:
    """This thread's CPU time (seconds) outside the garbage collector."""
    return time.thread_time() - getattr(_collecting, "spent", 0.0)


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


class Budget:
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

    def __init__(self, limit: int, budget: Budget) -> None:
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
    _budget: Budget

    def __init__(
        self, template: BoundTemplate, *, budget: Budget | None = None, **given: Any
    ) -> None:
        super().__init__(template, **given)  # whatever python-liquid passes, as it passes it
        # A copied context (python-liquid copies for some tags) shares its parent's budget.
        parent = given.get("parent_context")
        if budget is None and isinstance(parent, _SandboxContext):
            budget = parent._budget
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


def _check_filter_result(budget: Budget, name: str, result: object, token: Token | None) -> None:
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


class SandboxEnvironment(Environment):
    """A Liquid environment that reads no files and carries its TemplateLimits."""

    def __init__(self, *, html: bool, limits: TemplateLimits) -> None:
        # An empty dict loader: nothing can be loaded, whatever a template asks for.
        super().__init__(autoescape=html, loader=DictLoader({}))
        self.limits = limits
        # Removed so that a template naming another one fails when saved, not when sent.
        for tag in ("include", "render"):
            self.tags.pop(tag, None)
        self.add_filter("uniq", _fast_uniq(self.filters["uniq"]))
        self.add_filter("strip_html", strip_html)


def run(template: BoundTemplate, data: Mapping[str, object], budget: Budget) -> str:
    """Render a parsed template with ``data`` in the sandbox, charging ``budget``."""
    context = _SandboxContext(template, globals=template.make_globals(data), budget=budget)
    buffer = _Buffer(budget.limits.output_max_chars, budget)
    template.render_with_context(context, buffer)
    return buffer.getvalue()


@functools.lru_cache(maxsize=16)
def environment(html: bool, limits: TemplateLimits) -> SandboxEnvironment:
    """One environment per (HTML or text, limits): python-liquid's limits are class attributes."""

    class _Limited(SandboxEnvironment):
        loop_iteration_limit = limits.loop_iterations
        output_stream_limit = limits.output_max_chars
        local_namespace_limit = limits.namespace_max_bytes
        context_depth_limit = limits.context_depth

    return _Limited(html=html, limits=limits)
