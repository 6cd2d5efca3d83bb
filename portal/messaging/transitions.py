"""A send record's life: every change of its status the product makes, what causes it, the
module that writes it, and what the same statement (or transaction) writes beside the status.

A record is accepted Pending. A worker claims it, Pending or a Retry whose time has come, and
it is Sending while that worker holds it: on its first attempt preparation freezes the render
and the server or provider chosen and charges the quota (after a manual retry of a record
whose server went away, it only chooses again), all without leaving Sending. The attempt then
ends it: Sent; Retry, when it failed with retries left, or was deferred without using one
(the server busy, its breaker open, a rate-limit window full); Failed, refused for good or
past its deadline; DeadLetter, its retries used up; Uncertain, when no answer came and the
server's policy is to hold; Suppressed, every recipient on the suppression list. A worker that
stopped mid-send leaves its record in Sending, and the sweep moves it on (Retry, DeadLetter or
Uncertain). A breaker that closes makes the records waiting for it due now; they stay Retry.

People act on records too: a Pending or Retry record is cancelled; a Pending, Retry, Failed or
DeadLetter one is retried by hand (Retry, due now); an Uncertain one, or one that ended with an
ambiguous attempt, is resolved (Sent, or Failed; resolved as not sent, an ended record keeps
its status). After the send, a permanent bounce turns Sent into Failed. Retention deletes
settled records later: that ends a record, but writes no status.

Every change after acceptance bumps ``version`` and is guarded by the version its writer read,
or by its from-statuses, or both; a write that matches no row lost a race and did not happen.
The database takes part too: its triggers write the status callbacks (migration 0015) for every
change to a status outside ``SILENT``, and a PL/pgSQL function picks the claim's next due record
(migration 0022).

``TABLE`` lists every transition. ``change`` is the one writer of a status in Python: a
statement that writes one gets its SET values (``Change.values``) and its guard on the
from-statuses (``Change.where``, ``Change.sql_where``) from it when the statement is built, at
import or at its first use, never per record; it raises ``UnlistedTransition`` for a change the
table does not list. tests/unit/test_transitions.py fails for a status written anywhere else
in ``portal/`` and keeps docs/ARCHITECTURE.md's copy of the table current;
tests/integration/test_transitions_sql.py fails for a status the database's functions and
triggers handle that the table does not list.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from sqlalchemy import ColumnElement, literal_column

from portal.models.enums import DUE_STATUSES, RETRYABLE_BY_HAND, SendStatus

PENDING = SendStatus.PENDING
SENDING = SendStatus.SENDING
SENT = SendStatus.SENT
RETRY = SendStatus.RETRY
FAILED = SendStatus.FAILED
DEAD_LETTER = SendStatus.DEAD_LETTER
CANCELLED = SendStatus.CANCELLED
SUPPRESSED = SendStatus.SUPPRESSED
UNCERTAIN = SendStatus.UNCERTAIN


class Cause(StrEnum):
    """Why a record's status changes (or, for a write that keeps it, why it is written)."""

    ACCEPTED = "accepted"
    CLAIMED = "claimed"
    PREPARED = "prepared"
    REROUTED = "rerouted"
    SENT = "sent"
    RETRIED = "retried"
    DEFERRED = "deferred"
    FAILED = "failed"
    DEAD_LETTERED = "dead-lettered"
    HELD = "held"
    EXPIRED = "expired"
    SUPPRESSED = "suppressed"
    SWEPT = "swept"
    RELEASED = "released"
    CANCELLED = "cancelled"
    RETRIED_BY_HAND = "retried by hand"
    RESOLVED = "resolved"
    BOUNCED = "bounced"


class Write(StrEnum):
    """What a transition writes beside the status, in the same statement or transaction."""

    VERSION = "version + 1"
    RECIPIENTS = "recipient rows"
    SEARCH = "search side rows (trigger)"
    QUOTA = "quota charge"
    ATTEMPT = "send_attempt row"
    ATTEMPT_OR_EVENT = "send_attempt row, or record_event when none reached the transport"
    EVENT = "record_event"
    DEAD_LETTER = "dead_letter_message row"
    SUPPRESSION = "suppression rows"
    NEXT_CLAIM = "the worker's next claim"
    DELIVERY_EVENTS = "waiting delivery events applied"
    CALLBACK = "status callback (trigger)"


# The statuses whose arrival writes no status callback: the delivery loop's own steps (the
# callback trigger's WHEN clause, migration 0015).
SILENT = frozenset({SENDING, RETRY})

# The PL/pgSQL that takes part in the table's transitions, by what it does: the claim's pick of
# the next due record (migration 0022), and the status callbacks' triggers (migration 0015).
CLAIM_FUNCTIONS = ("postroom_claim_one_mail_send_record", "postroom_claim_one_sms_send_record")
CALLBACK_FUNCTIONS = ("callback_enqueue_change", "callback_enqueue_insert")


@dataclass(frozen=True)
class Transition:
    """One change the product makes: ``cause`` moves a record from any of ``from_`` (None: a
    new record) to ``to`` (None: the status stays; the write is by version), written by the
    modules ``by`` (under ``portal/messaging/``) with ``writes`` beside it; ``sql``: the
    database functions that take part."""

    cause: Cause
    from_: tuple[SendStatus | None, ...]
    to: SendStatus | None
    by: tuple[str, ...]
    writes: tuple[Write, ...]
    sql: tuple[str, ...] = ()
    note: str = ""

    @property
    def changes_status(self) -> bool:
        return self.to is not None and self.from_ != (self.to,)


T = Transition
W = Write
VERSIONED = (W.VERSION,)

TABLE: tuple[Transition, ...] = (
    T(
        Cause.ACCEPTED,
        (None,),
        PENDING,
        ("records/acceptance.py",),
        (W.RECIPIENTS, W.SEARCH, W.CALLBACK),
        note="a repeated businessKey returns the first record and writes nothing",
    ),
    T(
        Cause.CLAIMED,
        DUE_STATUSES,
        SENDING,
        ("sending/claim.py",),
        VERSIONED,
        sql=CLAIM_FUNCTIONS,
        note="Retry once next_retry_at has come; first_claimed_at on the first claim",
    ),
    T(
        Cause.PREPARED,
        (SENDING,),
        None,
        ("sending/preparation.py",),
        (W.VERSION, W.QUOTA, W.SEARCH),
        note="the first attempt's render, route and Message-ID frozen (prepared_at)",
    ),
    T(
        Cause.REROUTED,
        (SENDING,),
        None,
        ("sending/preparation.py",),
        VERSIONED,
        note="after a manual retry of CONFIG_NOT_RESOLVABLE: the server or provider again",
    ),
    T(
        Cause.SENT,
        (SENDING,),
        SENT,
        ("sending/sent_write.py",),
        (W.VERSION, W.ATTEMPT, W.NEXT_CLAIM, W.CALLBACK),
        note="waiting delivery events and refused recipients' suppressions follow, each in "
        "a transaction of its own",
    ),
    T(
        Cause.RETRIED,
        (SENDING,),
        RETRY,
        ("sending/outcomes.py",),
        (W.VERSION, W.ATTEMPT_OR_EVENT),
        note="a retryable failure with retries left: retry_count + 1, due after the backoff",
    ),
    T(
        Cause.DEFERRED,
        (SENDING,),
        RETRY,
        ("sending/outcomes.py",),
        (W.VERSION, W.EVENT),
        note="no retry used (deferral_count + 1): the server busy, its breaker open, a "
        "rate-limit window full; the event only for the first of a stretch",
    ),
    T(
        Cause.FAILED,
        (SENDING,),
        FAILED,
        ("sending/outcomes.py",),
        (W.VERSION, W.ATTEMPT_OR_EVENT, W.SUPPRESSION, W.CALLBACK),
        note="not retryable; suppression rows when the answer refuses a recipient for good",
    ),
    T(
        Cause.DEAD_LETTERED,
        (SENDING,),
        DEAD_LETTER,
        ("sending/outcomes.py",),
        (W.VERSION, W.ATTEMPT_OR_EVENT, W.DEAD_LETTER, W.CALLBACK),
        note="retries used up",
    ),
    T(
        Cause.HELD,
        (SENDING,),
        UNCERTAIN,
        ("sending/outcomes.py",),
        (W.VERSION, W.ATTEMPT_OR_EVENT, W.CALLBACK),
        note="no answer after the request went out, and the uncertain policy is hold",
    ),
    T(
        Cause.EXPIRED,
        (SENDING,),
        FAILED,
        ("sending/outcomes.py",),
        (W.VERSION, W.EVENT, W.CALLBACK),
        note="past expiresAt (EXPIRED) or the resend window (RETRY_WINDOW_EXPIRED)",
    ),
    T(
        Cause.EXPIRED,
        (SENDING,),
        UNCERTAIN,
        ("sending/outcomes.py",),
        (W.VERSION, W.EVENT, W.CALLBACK),
        note="as above, after an ambiguous earlier attempt",
    ),
    T(
        Cause.SUPPRESSED,
        (SENDING,),
        SUPPRESSED,
        ("sending/outcomes.py",),
        (W.VERSION, W.EVENT, W.CALLBACK),
        note="every recipient on the tenant's suppression list; no provider call",
    ),
    T(
        Cause.SWEPT,
        (SENDING,),
        RETRY,
        ("sending/sweeper.py",),
        (W.VERSION, W.ATTEMPT_OR_EVENT),
        note="stuck past STUCK_SEND_THRESHOLD_S (ZOMBIE_RECOVERED): retry_count + 1, due now",
    ),
    T(
        Cause.SWEPT,
        (SENDING,),
        DEAD_LETTER,
        ("sending/sweeper.py",),
        (W.VERSION, W.ATTEMPT_OR_EVENT, W.DEAD_LETTER, W.CALLBACK),
        note="stuck, retries used up (ZOMBIE_EXHAUSTED)",
    ),
    T(
        Cause.SWEPT,
        (SENDING,),
        UNCERTAIN,
        ("sending/sweeper.py",),
        (W.VERSION, W.ATTEMPT_OR_EVENT, W.CALLBACK),
        note="stuck after it was prepared, and the uncertain policy is hold",
    ),
    T(
        Cause.RELEASED,
        (RETRY,),
        None,
        ("sending/breaker.py",),
        VERSIONED,
        note="waiting for a breaker that closed, or the one made due for its probe: due now",
    ),
    T(
        Cause.CANCELLED,
        (PENDING, RETRY),
        CANCELLED,
        ("records/cancel.py",),
        (W.VERSION, W.EVENT, W.CALLBACK),
        note="never with an ambiguous earlier attempt; a bulk cancel also by version",
    ),
    T(
        Cause.RETRIED_BY_HAND,
        RETRYABLE_BY_HAND,
        RETRY,
        ("records/retry.py",),
        (W.VERSION, W.EVENT),
        note="due now, retry_count + 1, a new resend window (first_claimed_at cleared)",
    ),
    T(
        Cause.RESOLVED,
        (UNCERTAIN, FAILED, DEAD_LETTER, SUPPRESSED),
        SENT,
        ("records/uncertain.py",),
        (W.VERSION, W.EVENT, W.DELIVERY_EVENTS, W.CALLBACK),
        note="accepted, with the provider's message id; Failed, DeadLetter and Suppressed only "
        "with an ambiguous attempt not yet resolved",
    ),
    T(
        Cause.RESOLVED,
        (UNCERTAIN,),
        FAILED,
        ("records/uncertain.py",),
        (W.VERSION, W.EVENT, W.CALLBACK),
        note="not sent (RESOLVED_FAILED)",
    ),
    T(
        Cause.RESOLVED,
        (FAILED, DEAD_LETTER, SUPPRESSED),
        None,
        ("records/uncertain.py",),
        (W.VERSION, W.EVENT),
        note="not sent, with an ambiguous attempt: the decision recorded beside the status",
    ),
    T(
        Cause.BOUNCED,
        (SENT,),
        FAILED,
        ("after_send/events.py", "after_send/receiving/apply.py"),
        (W.VERSION, W.SUPPRESSION, W.CALLBACK),
        note="a permanent bounce, from a provider's event or the bounce mailbox",
    ),
)

_BY_KEY = {(t.cause, t.to): t for t in TABLE}
if len(_BY_KEY) != len(TABLE):
    raise ValueError("a cause lists one to-status twice: merge the rows' from-statuses")

CREATED = tuple(t.to for t in TABLE if None in t.from_ and t.to is not None)


class UnlistedTransition(ValueError):
    """A status change the table does not list (raised when its statement is built)."""


def _literal(value: str) -> Any:
    return literal_column(f"'{value}'")


@dataclass(frozen=True)
class Change:
    """What a statement writing one transition needs, built once with it: ``values`` for its
    SET (empty when the status stays), ``literal_values`` the same written into the SQL, and
    the guard on the from-statuses it allows (``froms``)."""

    transition: Transition
    status: str | None
    froms: tuple[str, ...]
    values: Mapping[str, Any] = field(init=False)
    literal_values: Mapping[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        bound = {} if self.status is None else {"status": self.status}
        written = {} if self.status is None else {"status": _literal(self.status)}
        object.__setattr__(self, "values", MappingProxyType(bound))
        object.__setattr__(self, "literal_values", MappingProxyType(written))

    def where(self, column: Any, *, literal: bool = False) -> ColumnElement[bool]:
        """``column = 'X'`` for one from-status, ``column IN (...)`` for several; ``literal``
        writes them into the SQL (a statement planned once for its constants: the claim)."""
        froms: list[Any] = [_literal(s) for s in self.froms] if literal else list(self.froms)
        if len(froms) == 1:
            return column == froms[0]  # type: ignore[no-any-return]
        return column.in_(froms)  # type: ignore[no-any-return]

    def sql_where(self, column: str) -> str:
        """The guard as SQL text: ``r.status = 'Pending'`` or ``r.status IN ('A', 'B')``."""
        if len(self.froms) == 1:
            return f"{column} = '{self.froms[0]}'"
        listed = ", ".join(f"'{s}'" for s in self.froms)
        return f"{column} IN ({listed})"


def change(
    cause: Cause,
    to: SendStatus | None,
    from_: Iterable[SendStatus] | None = None,
) -> Change:
    """The one writer of a status: what a statement making ``cause``'s change to ``to`` (None:
    the status stays) sets, and its guard on ``from_`` (default: every from-status the table
    lists for it). Called when the statement is built; raises ``UnlistedTransition`` for a
    change the table does not list."""
    transition = _BY_KEY.get((cause, to))
    if transition is None:
        raise UnlistedTransition(f"no transition {cause.value!r} to {to} in the table")
    allowed = [s for s in transition.from_ if s is not None]
    froms = allowed if from_ is None else list(from_)
    for status in froms:
        if status not in allowed:
            raise UnlistedTransition(
                f"{cause.value!r} to {to} does not come from {status} (the table: "
                f"{', '.join(allowed)})"
            )
    return Change(transition, None if to is None else to.value, tuple(s.value for s in froms))


def markdown_table() -> str:
    """``TABLE`` as the markdown table docs/ARCHITECTURE.md shows (a unit test compares)."""
    lines = [
        "| cause | from | to | written by | beside the status | when |",
        "|---|---|---|---|---|---|",
    ]
    for t in TABLE:
        froms = ", ".join("(new)" if s is None else s.value for s in t.from_)
        to = "(stays)" if t.to is None else t.to.value
        by = ", ".join([f"`{m}`" for m in t.by] + [f"`{f}`" for f in t.sql])
        writes = "; ".join(w.value for w in t.writes)
        lines.append(f"| {t.cause.value} | {froms} | {to} | {by} | {writes} | {t.note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m portal.messaging.transitions: the doc's table
    print(markdown_table(), end="")
