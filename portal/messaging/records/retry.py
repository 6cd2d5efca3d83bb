"""Manual retry (seed 000 "Manual retry"): one record or many, back to Retry due now.

Pending, Retry, Failed and DeadLetter can be retried; Sent and Sending are refused. The update
is conditional on the status, so a record a worker claimed meanwhile is skipped, never sent
twice. A manual retry counts as one retry: a record whose retries are used up gets exactly this
one chance and returns to DeadLetter if it fails again. A record that failed before it was
prepared has no ``prepared_at`` and is prepared afresh on its next attempt.

Three more rules. A manual retry starts a new resend window, whatever the record's status
(Retry, Failed, DeadLetter) and its error: the window runs from the first claim
(``first_claimed_at``), which is cleared here so the next claim sets it again. The window
stops automatic retries once a provider's duplicate protection may have lapsed; pressing Retry
is a person's decision to send after that, so it is not held to the old window, while the
automatic retries that follow are held to the new one. A record past its ``expires_at`` is
refused unless the caller gives a new, later one (``expires_at``), which the requeue writes. A
record that failed ``CONFIG_NOT_RESOLVABLE`` (its frozen server or provider disabled or deleted) is
requeued like any other: it keeps its error code and its frozen render, and preparation sees
``status = Retry`` with that code and chooses the server or provider again. An Uncertain record
is never retried: it is resolved, or sent again as a new message (``resend_as_new``), a new
record with a new business key.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, or_, select, update
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.messaging import transitions
from portal.messaging.records import acceptance, cancel, timeline, validation
from portal.messaging.transitions import Cause
from portal.models import (
    Channel,
    MailSendRecord,
    RecordEventKind,
    Scope,
    SendStatus,
    SmsSendRecord,
    db_now,
)
from portal.tenancy import tenant_context

Model = type[MailSendRecord] | type[SmsSendRecord]
MAX_BULK = 1000
_REQUEUE = transitions.change(Cause.RETRIED_BY_HAND, SendStatus.RETRY)  # from RETRYABLE_BY_HAND

REFUSAL_REASONS = {
    SendStatus.SENT.value: "already sent: the server or provider accepted it",
    SendStatus.SENDING.value: "being sent right now",
    SendStatus.CANCELLED.value: "cancelled",
    SendStatus.SUPPRESSED.value: "the recipient is on the suppression list",
    SendStatus.UNCERTAIN.value: "its outcome is uncertain; resolve it instead of resending",
}
# Not a status: a retryable record whose expiresAt has passed, retried without a new one.
_LOCAL_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}(:\d{2})?")  # <input type=datetime-local>
EXPIRED_REASON = "it has expired; give a new, later expiresAt to retry it"


@dataclass
class RetryReport:
    """What happened to each id. ``tenant_of`` holds the tenant of every id that exists within
    the scope asked for (requeued or skipped for its status), so a caller acting across
    tenants can say whose records it touched (the audit log does)."""

    requeued: list[int] = field(default_factory=list)
    skipped: dict[int, str] = field(default_factory=dict)
    tenant_of: dict[int, int] = field(default_factory=dict)


def retry_records(
    session: Session,
    model: Model,
    ids: Sequence[int],
    tenant_id: int | None,
    *,
    expires_at: datetime | None = None,
    by: str | None = None,
    anyway: Mapping[int, tuple[str, str]] | None = None,
) -> RetryReport:
    """Requeue the retryable ones among ``ids`` (of ``tenant_id``; None: any tenant), each
    with its event (``by``: who, as the audit log labels them).

    ``expires_at``: a new expiry for the records requeued (a caller checks it is in the
    future); without it, a record whose ``expires_at`` has passed is skipped (EXPIRED_REASON).
    ``anyway``: id -> (reason code, why) the record would fail again, for those requeued
    although it would.
    """
    wanted = list(dict.fromkeys(ids))
    report = RetryReport()
    if not wanted:
        return report
    owned = cancel.picked(model, wanted, tenant_id)
    live: list[ColumnElement[bool]] = []
    values: dict[str, Any] = {
        **_REQUEUE.values,
        "next_retry_at": db_now(),
        "retry_count": model.retry_count + 1,
        "version": model.version + 1,
        "updated_time": db_now(),
        # A new resend window, whatever stopped or delayed the record: the next claim starts it.
        "first_claimed_at": None,
    }
    if expires_at is None:
        live.append(or_(model.expires_at.is_(None), model.expires_at > db_now()))
    else:
        values["expires_at"] = expires_at
    requeued = session.execute(
        update(model)
        .where(*owned, _REQUEUE.where(model.status), *live)
        .values(**values)
        .returning(model.id, model.tenant_id)
        .execution_options(synchronize_session=False)
    ).all()
    report.tenant_of = {rid: tid for rid, tid in requeued}
    forced = anyway or {}
    timeline.note_many(
        session,
        channel_of(model),
        report.tenant_of,
        RecordEventKind.RETRIED,
        actor=by,
        messages={
            rid: (
                "retried anyway: would fail again ({}): {}".format(*forced[rid])
                if rid in forced
                else "requeued by hand"
            )
            + (f"; new expiry {expires_at.isoformat()}" if expires_at else "")
            for rid in report.tenant_of
        },
    )
    report.requeued = [i for i in wanted if i in report.tenant_of]
    rest = [i for i in wanted if i not in report.tenant_of]
    if rest:
        found: dict[int, tuple[str, bool]] = {}
        expired = and_(model.expires_at.is_not(None), model.expires_at <= db_now())
        for rid, status, tid, past in session.execute(
            select(model.id, model.status, model.tenant_id, expired).where(
                *owned[1:], model.id.in_(rest)
            )
        ):
            found[rid] = (status, bool(past))
            report.tenant_of[rid] = tid
        for record_id in rest:
            row = found.get(record_id)
            if row is None:
                report.skipped[record_id] = "no such record"
            elif row[0] in REFUSAL_REASONS or row[0] not in RETRYABLE_STATUSES:
                report.skipped[record_id] = REFUSAL_REASONS.get(
                    row[0], f"its status {row[0]} cannot be retried"
                )
            elif row[1]:
                report.skipped[record_id] = EXPIRED_REASON
            else:  # retryable, yet changed between the update and this read
                report.skipped[record_id] = "it changed meanwhile; look again"
    return report


RETRYABLE_STATUSES = frozenset(_REQUEUE.froms)


def new_expiry(raw: Any, now: datetime) -> datetime:
    """A retry's new ``expiresAt``: ISO 8601 with a time zone (as acceptance takes it), or a
    portal form's ``YYYY-MM-DDTHH:MM`` read as UTC; later than ``now``.
    Raises ``AcceptanceError`` (field ``expiresAt``, status 422) otherwise."""
    if isinstance(raw, str) and _LOCAL_TIME.fullmatch(raw):
        raw += "Z"
    value = validation.parse_expires_at({"expiresAt": raw})  # the one parser of expiresAt
    if value is None:
        raise validation.AcceptanceError("required", "expiresAt", "expiresAt is required")
    if value <= now:
        raise validation.AcceptanceError(
            "invalid", "expiresAt", "the new expiresAt must be in the future"
        )
    return value


def new_business_key(record: MailSendRecord | SmsSendRecord) -> str:
    """A business key no earlier request used: the old one (or the record id) plus a nonce."""
    base = (record.business_key or f"record-{record.id}")[: validation.MAX_KEY_CHARS - 24]
    return f"{base}:resend-{uuid.uuid4().hex[:16]}"


def resend_request(record: MailSendRecord | SmsSendRecord) -> dict[str, Any]:
    """The caller's original request of ``record``, as acceptance takes it, with a new
    business key and no expiry (the old one may have passed)."""
    request: dict[str, Any] = {"businessKey": new_business_key(record)}
    if record.scope == Scope.PLATFORM.value:
        request["scope"] = Scope.PLATFORM.value
    if record.template_code is not None:
        request["templateCode"] = record.template_code
    if record.variables is not None:
        request["variables"] = record.variables
    if isinstance(record, SmsSendRecord):
        request["phoneNumber"] = record.phone_number
        if record.content is not None:
            request["content"] = record.content
        return request
    if record.template_id is not None and record.template_code is None:
        request["templateId"] = record.template_id
    optional = {
        "cc": record.cc_addrs,
        "bcc": record.bcc_addrs,
        "replyTo": record.reply_to,
        "subject": record.subject,
        "html": record.html_body,
        "text": record.text_body,
        "serverId": record.server_id,
        "priority": record.priority,
        "attachments": record.attachments,
    }
    request["to"] = record.to_addrs
    request |= {k: v for k, v in optional.items() if v}
    return request


def channel_of(model: Model) -> Channel:
    return Channel.SMS if model is SmsSendRecord else Channel.MAIL


def resend_as_new(
    session: Session,
    record: MailSendRecord | SmsSendRecord,
    settings: Settings,
    *,
    by: str | None = None,
) -> acceptance.Accepted:
    """Seed 002: "Only enqueue a new business key when you have evidence that another send is
    appropriate." Accept the record's request again as a new Pending record of its tenant, in
    the caller's transaction; the old record, and its ambiguity, stay as they are.
    Raises ``AcceptanceError`` when the request is refused now (a template since disabled)."""
    request = resend_request(record)
    with tenant_context(record.tenant_id):
        if isinstance(record, SmsSendRecord):
            accepted = acceptance.send_sms(session, request, settings=settings)
        else:
            accepted = acceptance.send_mail(session, request, settings=settings)
    timeline.note(
        session,
        channel_of(type(record)),
        record.id,
        record.tenant_id,
        RecordEventKind.RESENT,
        message=f"sent again as a new message: record {accepted.id}",
        actor=by,
    )
    return accepted
