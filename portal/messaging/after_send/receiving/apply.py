"""Apply what a received message says to the mail send record it is about.

The record is found by our own Message-ID (``<mail-{id}@domain>``, written at preparation) in
the candidates the report lists: a receipt's Original-Message-ID, the original's headers a
DSN carries, In-Reply-To and References, or an original quoted as text. A mailbox only ever
touches records of its own tier: a tenant's mailbox its tenant's records; the platform's
mailbox also the records sent through a platform server (tenants without a server of their own
send through the platform's default one, so their bounces come back to the platform's mailbox).

- A permanent bounce (5.x.x, or Action: failed) turns a Sent record into Failed by version, with
  the bounce code (``550 5.1.1``) as its error code and bounce code, the diagnostic as its
  error message and ``bounced`` as its delivery outcome; the bounced address goes on the
  suppression list of the record's tenant (5.x.x only: a delivery given up after 4.x.x says
  nothing lasting about the address).
- A temporary bounce (4.x.x, Action: delayed) is recorded on the received row only.
- A read receipt ("displayed") sets ``read_at`` once.

Runs in the caller's transaction (the one that stores the received row and moves the UID
watermark), so a message is applied exactly when it is stored.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import case, select, update
from sqlalchemy.orm import Session

from portal.messaging import transitions
from portal.messaging.after_send import suppression
from portal.messaging.after_send.receiving.bounces import (
    Bounce,
    ReadReceipt,
    RecipientStatus,
    Report,
    Severity,
)
from portal.messaging.transitions import Cause
from portal.models import Channel, MailSendRecord, MailSendServerConfig, SendStatus, db_now
from portal.tenancy import PLATFORM_TENANT_ID

log = logging.getLogger("portal.receiving")

# The Message-ID preparation writes (preparation.message_id_for); matched exactly afterwards.
OUR_MESSAGE_ID = re.compile(r"^<mail-(\d{1,18})@[^<>\s]+>$", re.IGNORECASE)
MAX_ERROR_CHARS = 2000
MAX_VERSION_TRIES = 3
CLOCK_SKEW = timedelta(minutes=5)
BOUNCED = "bounced"
COMPLAINED = "complained"  # beats a bounce: an outcome never downgrades
_BOUNCED = transitions.change(Cause.BOUNCED, SendStatus.FAILED)  # from Sent


class Outcome(StrEnum):
    FAILED = "failed"  # a Sent record turned Failed by a permanent bounce
    RECORDED = "recorded"  # matched; stored on the received row only
    READ = "read"  # read_at set
    UNMATCHED = "unmatched"  # a bounce or receipt about no record of this tier
    NOTHING = "nothing"  # neither bounce nor receipt


@dataclass(frozen=True)
class Applied:
    outcome: Outcome
    record_id: int | None = None
    bounce_status: Severity | None = None
    bounce_code: str | None = None
    suppressed: tuple[str, ...] = ()


def find_record(
    session: Session, tenant_id: int, candidates: tuple[str, ...]
) -> MailSendRecord | None:
    """The first candidate Message-ID that is one of ours, on a record this tier may touch."""
    for message_id in candidates:
        m = OUR_MESSAGE_ID.match(message_id.strip())
        if m is None:
            continue
        record = session.get(MailSendRecord, int(m.group(1)))
        if record is None:
            continue
        if (record.message_id_header or "").strip().lower() != message_id.strip().lower():
            continue  # a lookalike id, or one another deployment wrote
        if _may_touch(session, tenant_id, record):
            return record
    return None


def _may_touch(session: Session, tenant_id: int, record: MailSendRecord) -> bool:
    if record.tenant_id == tenant_id:
        return True
    if tenant_id != PLATFORM_TENANT_ID or record.server_config_id is None:
        return False
    server_tier = session.scalar(
        select(MailSendServerConfig.tenant_id).where(
            MailSendServerConfig.id == record.server_config_id
        )
    )
    return server_tier == PLATFORM_TENANT_ID


def apply_report(session: Session, tenant_id: int, report: Report, *, by: str) -> Applied:
    """Apply one received message for the mailbox of ``tenant_id``; ``by`` names the mailbox
    (the suppression list's "by whom")."""
    record = find_record(session, tenant_id, report.referenced_ids)
    if report.bounce is not None:
        return _bounce(session, record, report.bounce, by=by)
    if report.receipt is not None:
        return _receipt(session, record, report.receipt)
    return Applied(Outcome.NOTHING, record.id if record is not None else None)


def _bounce(session: Session, record: MailSendRecord | None, bounce: Bounce, *, by: str) -> Applied:
    severity = bounce.severity
    first = bounce.first
    code = first.code if first is not None else None
    if record is None:
        return Applied(Outcome.UNMATCHED, None, severity, code)
    extra = {"record_id": record.id, "bounce_code": code, "bounce_status": severity}
    if severity is not Severity.PERMANENT:
        log.info("temporary bounce recorded", extra=extra)
        return Applied(Outcome.RECORDED, record.id, severity, code)
    outcome = Outcome.RECORDED
    if _fail(session, record, code, _message(first)):
        outcome = Outcome.FAILED
        log.warning("mail bounced permanently; record failed", extra=extra)
    else:
        log.info("permanent bounce for a record that is not Sent; recorded", extra=extra)
    suppressed = []
    for address in _bounced_addresses(record, bounce):
        try:
            suppression.suppress(
                session,
                record.tenant_id,
                Channel.MAIL,
                address,
                suppression.SuppressionReason.HARD_BOUNCE,
                detail=_message(first) or code,
                by=by,
                record_id=record.id,
            )
        except suppression.InvalidAddress:
            continue
        suppressed.append(suppression.normalise(Channel.MAIL, address))
    return Applied(outcome, record.id, severity, code, tuple(suppressed))


def _fail(session: Session, record: MailSendRecord, code: str | None, message: str | None) -> bool:
    """Sent -> Failed by version; False when the record is not (or no longer) Sent."""
    status, version = record.status, record.version
    values: dict[str, Any] = {
        **_BOUNCED.values,
        "version": MailSendRecord.version + 1,
        "updated_time": db_now(),
        "next_retry_at": None,
        "error_code": (code or "BOUNCED")[:100],
        "error_message": (message or "")[:MAX_ERROR_CHARS] or None,
        "bounce_code": (code or "BOUNCED")[:64],
        "delivery_outcome": case(
            (MailSendRecord.delivery_outcome == COMPLAINED, COMPLAINED), else_=BOUNCED
        ),
        "delivery_outcome_at": db_now(),
    }
    for _ in range(MAX_VERSION_TRIES):
        if status != SendStatus.SENT.value:
            return False
        result = session.execute(
            update(MailSendRecord)
            .where(
                MailSendRecord.id == record.id,
                MailSendRecord.version == version,
                _BOUNCED.where(MailSendRecord.status),
            )
            .values(**values)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount == 1:  # type: ignore[attr-defined]
            return True
        # Someone wrote the record meanwhile (an event, an operator): read it again.
        status, version = session.execute(
            select(MailSendRecord.status, MailSendRecord.version).where(
                MailSendRecord.id == record.id
            )
        ).one()
    return False


def _message(first: RecipientStatus | None) -> str | None:
    """The record's error message: the diagnostic, naming the recipient when it does not."""
    if first is None:
        return None
    text: str = first.diagnostic or f"bounced with status {first.status or 'unknown'}"
    if first.recipient and first.recipient not in text.lower():
        text = f"{first.recipient}: {text}"
    return text


def _bounced_addresses(record: MailSendRecord, bounce: Bounce) -> list[str]:
    """The hard-bounced addresses among the record's recipients. A bounce naming none of them
    (a forwarding alias answered) is about the record's only recipient, when it has one."""
    ours = [
        a.lower() for a in [*record.to_addrs, *(record.cc_addrs or []), *(record.bcc_addrs or [])]
    ]
    hard = [r for r in bounce.recipients if r.hard]
    found: list[str] = []
    for r in hard:
        for address in (r.recipient, r.original_recipient):
            if address and address in ours and address not in found:
                found.append(address)
                break
    if not found and hard and len(set(ours)) == 1:
        found = ours[:1]
    return found


def _receipt(session: Session, record: MailSendRecord | None, receipt: ReadReceipt) -> Applied:
    if record is None:
        return Applied(Outcome.UNMATCHED)
    if not receipt.displayed:
        return Applied(Outcome.RECORDED, record.id)
    when: Any = _plausible(receipt.date, record.sent_at) or db_now()
    result = session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == record.id, MailSendRecord.read_at.is_(None))
        .values(read_at=when, updated_time=db_now())
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        return Applied(Outcome.RECORDED, record.id)  # read already: the first read counts
    log.info("read receipt recorded", extra={"record_id": record.id})
    return Applied(Outcome.READ, record.id)


def _plausible(date: datetime | None, sent_at: datetime | None) -> datetime | None:
    """The receipt's own date when it can be a read time (after the send, not in the future
    beyond clock skew); otherwise None, and the time we read the receipt is used."""
    if date is None:
        return None
    date = date.astimezone(UTC)
    if date > datetime.now(UTC) + CLOCK_SKEW:
        return None
    if sent_at is not None:
        sent_at = sent_at.astimezone(UTC)
        if date < sent_at - CLOCK_SKEW:
            return None
        date = max(date, sent_at)  # within clock skew: never read before it was sent
    return date


__all__ = ["Applied", "Outcome", "apply_report", "find_record"]
