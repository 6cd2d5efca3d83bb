"""The database's side of the transition table (portal/messaging/transitions.py).

On a migrated database, every PL/pgSQL or SQL function of the project (``pg_proc.prosrc``) and
every trigger (``pg_get_triggerdef``: its WHEN clause) is read for the send statuses it names,
case-sensitively (the callback deliveries' own 'pending' and 'sending' are other statuses):

- an ``UPDATE`` of a record table that sets ``status = 'X'`` (or a trigger's ``NEW.status :=
  'X'``) is a transition, from the statuses its statement names (none: from any); the table must
  list it, naming the function among the SQL that takes part (``Transition.sql``);
- a function that only reads statuses (the claim's pick: ``r.status = 'Pending'``) must be named
  by transitions of the table, and read only their from- and to-statuses;
- the status callbacks' functions and triggers must tell of exactly the statuses the table's
  transitions with a status callback arrive at, and their WHEN clause leave out exactly
  ``transitions.SILENT``.

SQLite's callback triggers are read the same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from flask import Flask
from sqlalchemy import text
from sqlalchemy.engine import Connection

from portal.extensions import db
from portal.messaging.transitions import CALLBACK_FUNCTIONS, SILENT, TABLE, Write
from portal.models import SendStatus

_STATUS = "|".join(s.value for s in SendStatus)
_LITERAL = re.compile(rf"'({_STATUS})'")
_UPDATE = re.compile(r"\bUPDATE\s+(?:ONLY\s+)?(?:\w+\.)?(\w*_send_record)\b", re.IGNORECASE)
_SET = re.compile(r"\bSET\b(.*?)(?=\bWHERE\b|\bFROM\b|\bRETURNING\b|$)", re.I | re.S)
_SET_STATUS = re.compile(rf"\bstatus\s*=\s*'({_STATUS})'", re.IGNORECASE)
_NEW_STATUS = re.compile(rf"\bNEW\.status\s*:=\s*'({_STATUS})'", re.IGNORECASE)
_COMMENT = re.compile(r"--[^\n]*")

ANY = "any status"
CALLBACK_ARRIVALS = {t.to.value for t in TABLE if Write.CALLBACK in t.writes and t.to}


@dataclass
class Read:
    """What one function's body does with send statuses."""

    writes: list[tuple[frozenset[str], str]] = field(default_factory=list)  # (froms, to)
    named: set[str] = field(default_factory=set)


def read_body(body: str) -> Read:
    """The status writes and the other status literals of one function body."""
    read = Read()
    body = _COMMENT.sub("", body)
    olds = {m for m in re.findall(rf"\bOLD\.status\s*=\s*'({_STATUS})'", body, re.IGNORECASE)}
    for statement in body.split(";"):
        for match in _NEW_STATUS.finditer(statement):
            read.writes.append((frozenset(olds), match[1]))
        rest = _NEW_STATUS.sub("", statement)
        if _UPDATE.search(rest) and (clause := _SET.search(rest)):
            assigned = _SET_STATUS.findall(clause[1])
            if assigned:
                others = rest[: clause.start(1)] + _SET_STATUS.sub("", clause[1])
                others += rest[clause.end(1) :]
                froms = frozenset(_LITERAL.findall(others))
                read.writes += [(froms, to) for to in assigned]
                continue
        read.named |= set(_LITERAL.findall(rest))
    return read


def unlisted(functions: Mapping[str, str], triggers: Iterable[tuple[str, str, str]]) -> list[str]:
    """What in the database's functions and triggers the table does not list: ``functions``
    name -> body, ``triggers`` (name, function, definition)."""
    problems: list[str] = []
    for name, body in sorted(functions.items()):
        read = read_body(body)
        part_of = [t for t in TABLE if name in t.sql]
        for froms, to in read.writes:
            if not any(
                t.to is not None and t.to.value == to and froms and froms <= _values(t.from_)
                for t in part_of
            ):
                shown = ", ".join(sorted(froms)) or ANY
                problems.append(
                    f"{name} writes {shown} -> {to}: no transition of the table lists it there"
                )
        if not read.named:
            continue
        if name in CALLBACK_FUNCTIONS:
            if read.named != CALLBACK_ARRIVALS:
                problems.append(
                    f"{name} tells of {sorted(read.named)}, the table's callbacks arrive at "
                    f"{sorted(CALLBACK_ARRIVALS)}"
                )
            continue
        allowed = set().union(*(_values(t.from_) | _values((t.to,)) for t in part_of))
        if not part_of or not read.named <= allowed:
            problems.append(
                f"{name} reads {sorted(read.named)}, but the table lists "
                + (
                    f"only {sorted(allowed)} for it"
                    if part_of
                    else "no transition it takes part in"
                )
            )
    for trigger, function, definition in sorted(triggers):
        named = set(_LITERAL.findall(definition))
        if not named:
            continue
        if function not in CALLBACK_FUNCTIONS:
            problems.append(f"trigger {trigger} reads {sorted(named)}, which no transition lists")
        elif named != {s.value for s in SILENT}:
            problems.append(
                f"trigger {trigger} leaves out {sorted(named)}; the table's silent statuses "
                f"are {sorted(s.value for s in SILENT)}"
            )
    return problems


def _values(statuses: Iterable[SendStatus | None]) -> frozenset[str]:
    return frozenset(s.value for s in statuses if s is not None)


def pg_functions(connection: Connection) -> dict[str, str]:
    rows = connection.execute(
        text(
            "SELECT p.proname, p.prosrc FROM pg_proc p "
            "JOIN pg_namespace n ON n.oid = p.pronamespace "
            "JOIN pg_language l ON l.oid = p.prolang "
            "WHERE n.nspname = current_schema() AND l.lanname IN ('plpgsql', 'sql')"
        )
    )
    return {name: body for name, body in rows}


def pg_triggers(connection: Connection) -> list[tuple[str, str, str]]:
    rows = connection.execute(
        text(
            "SELECT t.tgname, p.proname, pg_get_triggerdef(t.oid) FROM pg_trigger t "
            "JOIN pg_proc p ON p.oid = t.tgfoid WHERE NOT t.tgisinternal"
        )
    )
    return [(name, function, definition) for name, function, definition in rows]


def test_the_database_makes_no_transition_the_table_does_not_list(app: Flask) -> None:
    with db.engine.connect() as connection:
        functions, triggers = pg_functions(connection), pg_triggers(connection)
    problems = unlisted(functions, triggers)
    assert not problems, "\n".join(problems)
    # What the migrations hold today: the claim's pick reads Pending and Retry, the callback
    # functions and triggers tell of the rest; nothing else names a status.
    handling = {name for name, body in functions.items() if _LITERAL.search(body)}
    assert handling == {
        "postroom_claim_one_mail_send_record",
        "postroom_claim_one_sms_send_record",
        *CALLBACK_FUNCTIONS,
    }
    assert read_body(functions["postroom_claim_one_mail_send_record"]) == Read(
        [], {"Pending", "Retry"}
    )
    assert len([t for t in triggers if _LITERAL.search(t[2])]) == 2  # the change triggers


def test_sqlite_callback_triggers_keep_to_the_table(sqlite_app: Flask) -> None:
    with sqlite_app.app_context(), db.engine.connect() as connection:
        rows = connection.execute(
            text("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'")
        ).all()
    callbacks = {name: sql for name, sql in rows if "callback_delivery" in sql}
    assert len(callbacks) == 4  # insert and change, mail and SMS
    for name, sql in callbacks.items():
        body = sql.split(" BEGIN ", 1)
        when, inside = (body[0], body[1]) if len(body) == 2 else ("", sql)
        mapped = set(_LITERAL.findall(inside))
        assert mapped == CALLBACK_ARRIVALS, name
        if "UPDATE" in when.upper():
            assert set(_LITERAL.findall(when)) == {s.value for s in SILENT}, name
    assert not [n for n, sql in rows if n not in callbacks and _LITERAL.search(sql)]


def test_the_reading_finds_a_transition_the_table_does_not_list() -> None:
    """The checks themselves, on bodies that break the table."""
    claim = "postroom_claim_one_mail_send_record"
    functions = {
        # Writes Failed -> Pending: no transition goes there.
        "reopen": "BEGIN UPDATE mail_send_record SET status = 'Pending', version = version + 1 "
        "WHERE status = 'Failed'; END",
        # The claim picking Failed records: not a from-status of the claim.
        claim: "BEGIN SELECT r.id FROM mail_send_record r WHERE r.status = 'Failed'; END",
        # A function nobody listed reading a status.
        "peek": "BEGIN RETURN (SELECT count(*) FROM sms_send_record WHERE status = 'Sent'); END",
        # A trigger function setting a status from any.
        "force": "BEGIN NEW.status := 'Cancelled'; RETURN NEW; END",
        # A callback function that forgot Suppressed.
        "callback_enqueue_insert": "CASE n.status WHEN 'Pending' THEN 'queued' "
        "WHEN 'Sent' THEN 'sent' WHEN 'Failed' THEN 'failed' WHEN 'DeadLetter' THEN "
        "'dead_letter' WHEN 'Uncertain' THEN 'uncertain' WHEN 'Cancelled' THEN 'cancelled' END",
    }
    triggers = [
        ("t_callback", "callback_enqueue_change", "WHEN (NEW.status NOT IN ('Sending'))"),
        ("t_other", "force", "WHEN (OLD.status = 'Sent')"),
    ]
    problems = unlisted(functions, triggers)
    assert problems == [
        "callback_enqueue_insert tells of ['Cancelled', 'DeadLetter', 'Failed', 'Pending', "
        "'Sent', 'Uncertain'], the table's callbacks arrive at ['Cancelled', 'DeadLetter', "
        "'Failed', 'Pending', 'Sent', 'Suppressed', 'Uncertain']",
        "force writes any status -> Cancelled: no transition of the table lists it there",
        "peek reads ['Sent'], but the table lists no transition it takes part in",
        f"{claim} reads ['Failed'], but the table lists only ['Pending', 'Retry', 'Sending'] "
        "for it",
        "reopen writes Failed -> Pending: no transition of the table lists it there",
        "trigger t_callback leaves out ['Sending']; the table's silent statuses are "
        "['Retry', 'Sending']",
        "trigger t_other reads ['Sent'], which no transition lists",
    ]
