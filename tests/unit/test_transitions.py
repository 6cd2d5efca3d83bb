"""The transition table (portal/messaging/transitions.py) is the only writer of a record's
status in Python, its copy in docs/ARCHITECTURE.md is current, and it tells a whole life.

The scan reads every module under portal/ as a syntax tree. A status write is ``status`` given
a send status: a keyword (``update(...).values(status=...)``, a model's constructor), a dict
entry (``{"status": ...}``, what ``values(**d)`` or ``values |= d`` write), an attribute or item
assignment (``record.status = ...``, ``values["status"] = ...``), or SQL text that sets one
(``SET status = 'Sent'``, ``INSERT INTO mail_send_record (..., status, ...)``). A send status is
an expression built from ``SendStatus`` (through names the module or function binds, or a
parameter typed ``SendStatus``), or a status's literal text where a write takes one. Only
acceptance may write one itself: a new record's status, which the table lists as a transition
from nothing.
"""

from __future__ import annotations

import ast
import importlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy import column

from portal.messaging.transitions import (
    CREATED,
    SILENT,
    TABLE,
    Cause,
    UnlistedTransition,
    Write,
    change,
    markdown_table,
)
from portal.models import MailSendRecord, SendStatus, SmsSendRecord

ROOT = Path(__file__).resolve().parents[2]
PORTAL = ROOT / "portal"
MESSAGING = PORTAL / "messaging"
WRITER = MESSAGING / "transitions.py"
STATUS_VALUES = frozenset(s.value for s in SendStatus)
DYNAMIC = "(a SendStatus value known only when it runs)"
_STATUS_TEXT = "|".join(STATUS_VALUES)
# SQL that writes a status: a SET clause assigning one (a literal status, or a parameter when
# the text names a record table), or an INSERT into a record table naming the column.
_SQL_SET = re.compile(
    r"\bSET\b(?:(?!\b(?:WHERE|FROM|RETURNING)\b|;).)*?\bstatus\s*=\s*"
    rf"(?:'(?-i:(?P<status>{_STATUS_TEXT}))'|(?P<param>\x00|:\w+|%\(\w+\)s|%s|\$\d+|\?))",
    re.IGNORECASE | re.DOTALL,
)
_SQL_INSERT = re.compile(
    r"\bINSERT\s+INTO\s+(?:mail|sms)_send_record\b[^)]*\bstatus\b", re.IGNORECASE | re.DOTALL
)
_RECORD_TABLE = re.compile(r"(?:mail|sms)_send_record|\x00")


@dataclass
class Scope:
    """The names one scope (a module or a function) binds, and its parameters typed
    SendStatus."""

    names: dict[str, list[ast.expr]] = field(default_factory=dict)
    typed: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Found:
    line: int
    how: str
    statuses: frozenset[str]

    def __str__(self) -> str:
        return f"line {self.line}: {self.how} ({', '.join(sorted(self.statuses))})"


def _binds(body: ast.AST, scope: Scope) -> None:
    for node in ast.walk(body):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name):
                scope.names.setdefault(target.id, []).append(node.value)


def _mentions_send_status(annotation: ast.expr | None) -> bool:
    return annotation is not None and any(
        isinstance(n, ast.Name) and n.id == "SendStatus" for n in ast.walk(annotation)
    )


def statuses(
    node: ast.expr, scopes: list[Scope], *, text: bool, seen: frozenset[str] = frozenset()
) -> set[str]:
    """The send statuses ``node`` may be: SendStatus members, names bound to them, typed
    parameters (DYNAMIC), and with ``text`` a status's literal text."""
    found: set[str] = set()
    for sub in ast.walk(node):
        if (
            isinstance(sub, ast.Attribute)
            and isinstance(sub.value, ast.Name)
            and sub.value.id == "SendStatus"
        ):
            found.add(SendStatus[sub.attr].value)
        elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name):
            if sub.func.id == "SendStatus":
                found.add(DYNAMIC)
        elif isinstance(sub, ast.Name) and sub.id not in seen:
            for scope in reversed(scopes):
                if sub.id in scope.typed:
                    found.add(DYNAMIC)
                    break
                if sub.id in scope.names:
                    for value in scope.names[sub.id]:
                        found |= statuses(value, scopes, text=text, seen=seen | {sub.id})
                    break
        elif (
            text
            and isinstance(sub, ast.Constant)
            and isinstance(sub.value, str)
            and sub.value.strip("'") in STATUS_VALUES
        ):
            found.add(sub.value.strip("'"))
    return found


def _sql_text(node: ast.Constant | ast.JoinedStr) -> str:
    if isinstance(node, ast.Constant):
        return str(node.value)
    return "".join(
        str(part.value) if isinstance(part, ast.Constant) else "\x00" for part in node.values
    )


def status_writes(source: str) -> list[Found]:
    """Every write of a send status in a module's source."""
    tree = ast.parse(source)
    module = Scope()
    for statement in tree.body:
        if isinstance(statement, ast.Assign | ast.AnnAssign):
            _binds(statement, module)
    found: list[Found] = []

    def check(node: ast.expr, how: str, line: int, scopes: list[Scope], text: bool) -> None:
        got = statuses(node, scopes, text=text)
        if got:
            found.append(Found(line, how, frozenset(got)))

    def visit(node: ast.AST, scopes: list[Scope]) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            scope = Scope()
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                if _mentions_send_status(arg.annotation):
                    scope.typed.add(arg.arg)
            _binds(node, scope)
            scopes = [*scopes, scope]
        if isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg == "status":
                    check(keyword.value, "status=", node.lineno, scopes, text=True)
            called = node.func.attr if isinstance(node.func, ast.Attribute) else None
            for arg in node.args:
                if called == "values" and isinstance(arg, ast.Dict):
                    for key, value in zip(arg.keys, arg.values, strict=True):
                        if isinstance(key, ast.Constant) and key.value == "status":
                            check(value, "values({'status': ...})", node.lineno, scopes, True)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "status":
                    check(value, "{'status': ...}", key.lineno, scopes, text=False)
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                named = (isinstance(target, ast.Attribute) and target.attr == "status") or (
                    isinstance(target, ast.Subscript)
                    and isinstance(target.slice, ast.Constant)
                    and target.slice.value == "status"
                )
                if named and node.value is not None:
                    check(node.value, "... .status =", node.lineno, scopes, text=True)
        elif isinstance(node, ast.Constant | ast.JoinedStr) and (
            isinstance(node, ast.JoinedStr) or isinstance(node.value, str)
        ):
            sql = _sql_text(node)
            for match in _SQL_SET.finditer(sql):
                if match["status"] or _RECORD_TABLE.search(sql):
                    found.append(
                        Found(
                            node.lineno, "SQL SET status", frozenset({match["status"] or DYNAMIC})
                        )
                    )
            if _SQL_INSERT.search(sql):
                found.append(Found(node.lineno, "SQL INSERT of a status", frozenset({DYNAMIC})))
            return  # an f-string's parts are read above
        for child in ast.iter_child_nodes(node):
            visit(child, scopes)

    visit(tree, [module])
    return found


def _modules() -> list[Path]:
    return sorted(p for p in PORTAL.rglob("*.py") if p != WRITER)


def _name(path: Path) -> str:
    """A module as the table's ``by`` names it (under portal/messaging/), else under portal/."""
    base = MESSAGING if path.is_relative_to(MESSAGING) else PORTAL
    return str(path.relative_to(base))


CREATING = {m for t in TABLE if None in t.from_ for m in t.by}


def test_no_module_but_the_transitions_writes_a_status() -> None:
    modules = _modules()
    assert len(modules) > 100  # the walk found the package
    stray: list[str] = []
    for path in modules:
        for found in status_writes(path.read_text()):
            creates = found.statuses <= set(CREATED) and found.statuses
            if _name(path) in CREATING and creates:
                continue  # a new record's status, as the table's creating transition has it
            stray.append(f"{path.relative_to(ROOT)} {found}")
    assert not stray, (
        "a status written outside portal/messaging/transitions.py; build the statement's SET "
        "and guard with transitions.change(cause, to) (and list the transition if it is new):\n"
        + "\n".join(stray)
    )


SCANNED = """
from portal.models import SendStatus
from sqlalchemy import update, text
DONE = SendStatus.SENT.value
READ_ONLY = SendStatus.FAILED.value

def a(model):
    return update(model).values(status=SendStatus.FAILED.value)

def b(model):
    values = {"status": DONE, "version": model.version + 1}
    return update(model).values(**values)

def c(record, status: SendStatus):
    record.status = status.value

def d(values):
    values["status"] = "Cancelled"

def e(model):
    return update(model).values({"status": "Retry"})

SQL = "UPDATE mail_send_record SET version = version + 1, status = 'Pending' WHERE id = :id"
TEMPLATE = f"UPDATE {table} SET status = {value} WHERE id = 1"
INSERT = "INSERT INTO sms_send_record (tenant_id, status) VALUES (1, 'Pending')"

def reads(model, record):
    found = model.status == READ_ONLY
    body = {"status": record.status, "id": 1}
    answer = {"status": "Cancelled"}  # a response, not a write
    callbacks = "UPDATE callback_delivery SET status = 'sending' WHERE id = 1"
    kept = "SELECT r.id FROM mail_send_record r WHERE r.status = 'Pending'"
    return found, body, answer, callbacks, kept
"""


def test_the_scan_finds_each_way_of_writing_a_status_and_no_read() -> None:
    found = {(f.line, f.how, f.statuses) for f in status_writes(SCANNED)}
    assert found == {
        (8, "status=", frozenset({"Failed"})),
        (11, "{'status': ...}", frozenset({"Sent"})),
        (15, "... .status =", frozenset({DYNAMIC})),
        (18, "... .status =", frozenset({"Cancelled"})),
        (21, "values({'status': ...})", frozenset({"Retry"})),
        (23, "SQL SET status", frozenset({"Pending"})),
        (24, "SQL SET status", frozenset({DYNAMIC})),
        (25, "SQL INSERT of a status", frozenset({DYNAMIC})),
    }


def _writer_calls(source: str) -> set[tuple[str, str | None]]:
    """(cause, to) of every ``transitions.change(Cause.X, SendStatus.Y | None, ...)``."""
    calls: set[tuple[str, str | None]] = set()
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "change"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "transitions"
        ):
            continue
        cause, to = node.args[0], node.args[1]
        assert isinstance(cause, ast.Attribute), ast.unparse(node)
        if isinstance(to, ast.Constant) and to.value is None:
            calls.add((cause.attr, None))
        else:
            assert isinstance(to, ast.Attribute), ast.unparse(node)
            calls.add((cause.attr, to.attr))
    return calls


def test_each_change_is_written_where_the_table_says_and_nowhere_else() -> None:
    calls = {_name(p): _writer_calls(p.read_text()) for p in _modules()}
    listed = {(t.cause.name, None if t.to is None else t.to.name) for t in TABLE}
    for module, made in calls.items():
        assert made <= listed, f"{module} writes transitions the table lacks: {made - listed}"
    for t in TABLE:
        key = (t.cause.name, None if t.to is None else t.to.name)
        if not t.changes_status or None in t.from_:
            continue  # a write that keeps the status needs no writer; acceptance creates
        writers = {module for module, made in calls.items() if key in made}
        assert writers == set(t.by), f"{t.cause} to {t.to}: written by {writers}, not {t.by}"


def test_every_writer_builds_its_statements() -> None:
    """Importing a module runs its ``transitions.change`` calls: a from-status the table does
    not list for a change raises there."""
    for path in _modules():
        if _writer_calls(path.read_text()):
            dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            importlib.import_module(dotted)


def test_the_writer_refuses_a_change_the_table_does_not_list() -> None:
    with pytest.raises(UnlistedTransition):
        change(Cause.SENT, SendStatus.FAILED)
    with pytest.raises(UnlistedTransition):
        change(Cause.CANCELLED, SendStatus.CANCELLED, [SendStatus.FAILED])
    with pytest.raises(UnlistedTransition):
        change(Cause.RELEASED, SendStatus.RETRY)  # a release keeps the status: to is None


def test_the_writer_gives_the_set_and_the_guard() -> None:
    status = column("status")
    cancel = change(Cause.CANCELLED, SendStatus.CANCELLED)
    assert dict(cancel.values) == {"status": "Cancelled"}
    assert cancel.froms == ("Pending", "Retry")
    assert str(cancel.where(status)) == "status IN (__[POSTCOMPILE_status_1])"
    assert cancel.sql_where("r.status") == "r.status IN ('Pending', 'Retry')"
    claim = change(Cause.CLAIMED, SendStatus.SENDING, [SendStatus.PENDING])
    assert str(claim.where(status, literal=True)) == "status = 'Pending'"
    assert str(dict(claim.literal_values)["status"]) == "'Sending'"
    assert claim.sql_where("r.status") == "r.status = 'Pending'"
    release = change(Cause.RELEASED, None)
    assert dict(release.values) == {}
    assert release.froms == ("Retry",)


def test_the_table_tells_a_whole_life() -> None:
    assert set(CREATED) == {SendStatus.PENDING}
    reached = set(CREATED)
    while True:  # every status is reached from a new record
        more = {t.to for t in TABLE if t.to and reached.intersection(t.from_)} - reached
        if not more:
            break
        reached |= more
    assert reached == set(SendStatus)
    # Sending and the due statuses always move on; the others end a record or wait for a person.
    leaves = {s for t in TABLE if t.changes_status for s in t.from_ if s is not None}
    assert {SendStatus.PENDING, SendStatus.SENDING, SendStatus.RETRY} <= leaves
    assert SendStatus.CANCELLED not in leaves
    # Every change after acceptance bumps the version.
    assert all(Write.VERSION in t.writes for t in TABLE if None not in t.from_)
    # The callback trigger writes one for every arrival at a status outside SILENT.
    for t in TABLE:
        expected = t.changes_status and t.to not in SILENT
        assert (Write.CALLBACK in t.writes) == expected, t
    # A new record's status is the models' default too.
    for model in (MailSendRecord, SmsSendRecord):
        default = model.__table__.c.status.default
        assert default is not None
        assert default.arg in CREATED


DOC = ROOT / "docs" / "ARCHITECTURE.md"
BEGIN = "<!-- transitions: portal/messaging/transitions.py markdown_table() -->\n"
END = "<!-- /transitions -->"


def test_the_architecture_doc_shows_the_table_as_it_is() -> None:
    text = DOC.read_text()
    assert BEGIN in text, f"{DOC.name} lost the start of its transition table"
    assert END in text, f"{DOC.name} lost the end of its transition table"
    shown = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert shown == markdown_table(), (
        "docs/ARCHITECTURE.md's transition table differs from the module: paste the output of "
        "`python -m portal.messaging.transitions` between its markers"
    )


def test_every_module_the_table_names_exists() -> None:
    for t in TABLE:
        for module in t.by:
            assert (MESSAGING / module).is_file(), f"{t.cause}: no module {module}"
