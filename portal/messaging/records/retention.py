"""Retention: settled records past their tenant's retention are deleted
with everything that hangs off them, in short batches; a recipient can be forgotten on request.
The recipient pages' token rows (they hold the address in clear) go in the batch that takes
the last record to their address.

What is kept whatever the retention says: records still in the delivery loop (Pending, Retry,
Sending) or waiting for a person (Uncertain), records with an untriaged dead letter or a
callback not yet delivered, records whose ``expiresAt`` or resend window is still ahead (so
business-key deduplication outlives any resend), ``tenant_message_usage`` (seed 000: never
deleted) and the suppression list. Each batch of at most BATCH records is one short
transaction that takes its rows with SKIP LOCKED: a worker holding a record is never waited
for, and no lock outlives the batch.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, String, and_, cast, delete, exists, func, select, text, update
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.messaging.after_send import suppression
from portal.models import (
    CallbackDelivery,
    Channel,
    DeadLetterMessage,
    DeliveryEvent,
    MailSendRecipient,
    MailSendRecord,
    MailSendSubject,
    ReceivedMail,
    RecipientToken,
    RecordEvent,
    SendAttempt,
    SendStatus,
    SmsSendRecord,
    Suppression,
    Tenant,
    TriageStatus,
    db_now,
)
from portal.models.by_channel import PARTS

log = logging.getLogger("portal.retention")

BATCH = 1000
MIN_DAYS = 2
EARLY_EVENT_DAYS = 7
# Between batches the purge rests as long as the batch took (bench/retention.py: on a busy
# 2-core machine the claim rate while purging stays within the goal only with a rest).
PAUSE_RATIO = 1.0  # an event that never met its record is dropped after this
SETTLED = (
    SendStatus.SENT.value,
    SendStatus.FAILED.value,
    SendStatus.DEAD_LETTER.value,
    SendStatus.CANCELLED.value,
    SendStatus.SUPPRESSED.value,
)


def retention_days(tenant: Tenant, channel: Channel, settings: Settings) -> int | None:
    """The retention in force for one tenant and channel (None: kept forever)."""
    own = tenant.mail_retention_days if channel is Channel.MAIL else tenant.sms_retention_days
    return own if own is not None else settings.retention_days_default


def days_problem(value: int | None) -> str | None:
    if value is not None and value < MIN_DAYS:
        return f"must be at least {MIN_DAYS} days (deduplication must outlive the resend window)"
    return None


@dataclass
class Report:
    deleted: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, int]:
        return dict(self.deleted)


def _purgeable(
    model: type[MailSendRecord] | type[SmsSendRecord],
    channel: Channel,
    tenant_id: int,
    cutoff: datetime,
    now: datetime,
    window_start: datetime,
) -> Any:
    """The conditions under which a record of ``tenant_id`` may go."""
    return and_(
        model.tenant_id == tenant_id,
        model.status.in_(SETTLED),
        model.updated_time < cutoff,
        (model.expires_at.is_(None)) | (model.expires_at < now),
        (model.first_claimed_at.is_(None)) | (model.first_claimed_at < window_start),
        ~exists().where(
            DeadLetterMessage.channel == channel.value,
            DeadLetterMessage.event_id == cast(model.id, String),
            DeadLetterMessage.status == TriageStatus.PENDING.value,
        ),
        ~exists().where(
            CallbackDelivery.channel == channel.value,
            CallbackDelivery.record_id == model.id,
            CallbackDelivery.status.in_(["pending", "sending"]),
        ),
    )


def count_purgeable(
    session: Session, tenant_id: int, channel: Channel, days: int, settings: Settings
) -> int:
    """How many records a run would delete now with a retention of ``days``."""
    now = session.scalar(select(db_now()))
    assert now is not None
    model = PARTS[channel].record
    where = _purgeable(
        model,
        channel,
        tenant_id,
        now - timedelta(days=days),
        now,
        now - timedelta(seconds=settings.resend_window_s),
    )
    return int(session.scalar(select(func.count()).select_from(model).where(where)) or 0)


# PostgreSQL: every delete of a batch in one statement (data-modifying CTEs), the ids as one
# array parameter: one round trip and one plan per batch instead of six IN lists of 1,000.
# The recipient tokens (the recipient pages' rows, holding the address in clear) go with the
# last record to their address: the CTEs all see the statement's starting snapshot, so "no
# other record" is read as "no record outside this batch".
_PG_DELETE = """
WITH recipients AS ({recipients}),
     subjects AS ({subjects}),
     bounce_mails AS ({bounce_mails}),
     events AS (DELETE FROM delivery_event WHERE channel = :channel AND record_id = ANY(:ids)
                RETURNING 1),
     callbacks AS (DELETE FROM callback_delivery
                   WHERE channel = :channel AND record_id = ANY(:ids) RETURNING 1),
     attempts AS (DELETE FROM send_attempt
                  WHERE channel = :channel AND record_id = ANY(:ids) RETURNING 1),
     record_events AS (DELETE FROM record_event
                       WHERE channel = :channel AND record_id = ANY(:ids) RETURNING 1),
     dead_letters AS (DELETE FROM dead_letter_message
                      WHERE channel = :channel AND event_id = ANY(:text_ids) RETURNING 1),
     records AS (DELETE FROM {table} WHERE id = ANY(:ids) RETURNING {record_returning}),
     recipient_tokens AS (
         DELETE FROM recipient_token t
         USING (SELECT DISTINCT tenant_id, address FROM {addresses}) a
         WHERE t.tenant_id = a.tenant_id AND t.channel = :channel AND t.address = a.address
           AND NOT EXISTS ({remaining})
         RETURNING 1)
SELECT (SELECT count(*) FROM recipients), (SELECT count(*) FROM subjects),
       (SELECT count(*) FROM bounce_mails), (SELECT count(*) FROM events),
       (SELECT count(*) FROM callbacks), (SELECT count(*) FROM attempts),
       (SELECT count(*) FROM dead_letters), (SELECT count(*) FROM recipient_tokens),
       (SELECT count(*) FROM records)
"""
_PG_NOTHING = "SELECT 1 WHERE false"
_PG_STATEMENTS = {
    Channel.MAIL: _PG_DELETE.format(
        recipients="DELETE FROM mail_send_recipient WHERE record_id = ANY(:ids) "
        "RETURNING tenant_id, address",
        subjects="DELETE FROM mail_send_subject WHERE record_id = ANY(:ids) RETURNING 1",
        bounce_mails="DELETE FROM received_mail WHERE record_id = ANY(:ids) RETURNING 1",
        table=MailSendRecord.__tablename__,
        record_returning="1",
        addresses="recipients",
        remaining="SELECT 1 FROM mail_send_recipient r WHERE r.tenant_id = t.tenant_id "
        "AND r.address = t.address AND r.record_id <> ALL(:ids)",
    ),
    Channel.SMS: _PG_DELETE.format(
        recipients=_PG_NOTHING,
        subjects=_PG_NOTHING,
        bounce_mails=_PG_NOTHING,
        table=SmsSendRecord.__tablename__,
        record_returning="tenant_id, phone_number AS address",
        addresses="records",
        remaining="SELECT 1 FROM sms_send_record s WHERE s.tenant_id = t.tenant_id "
        "AND s.phone_number = t.address AND s.id <> ALL(:ids)",
    ),
}
_PG_KINDS = (
    "recipients",
    "subjects",
    "bounce_mails",
    "events",
    "callbacks",
    "attempts",
    "dead_letters",
    "recipient_tokens",
)


def _no_record_left(channel: Channel) -> Any:
    """A recipient token whose tenant has no record of its channel to its address."""
    if channel is Channel.MAIL:
        return ~exists().where(
            MailSendRecipient.tenant_id == RecipientToken.tenant_id,
            MailSendRecipient.address == RecipientToken.address,
        )
    return ~exists().where(
        SmsSendRecord.tenant_id == RecipientToken.tenant_id,
        SmsSendRecord.phone_number == RecipientToken.address,
    )


def delete_records(session: Session, channel: Channel, ids: list[int]) -> Counter[str]:
    """Delete records ``ids`` of one channel with their recipients, subjects, events, callback
    deliveries, attempts, bounce mails and dead letters, and the recipient tokens of the
    addresses that have no record left (the caller chose them and commits)."""
    out: Counter[str] = Counter()
    if not ids:
        return out
    model = PARTS[channel].record
    text_ids = [str(i) for i in ids]
    if session.get_bind().dialect.name == "postgresql":
        row = session.execute(
            text(_PG_STATEMENTS[channel]),
            {"ids": ids, "text_ids": text_ids, "channel": channel.value},
        ).one()
        out.update(dict(zip(_PG_KINDS, row[:-1], strict=True)))
        out[f"{channel.value}_records"] += row[-1]
        return +out  # only the kinds that deleted something

    def gone(statement: Any) -> int:
        return _rowcount(session.execute(statement))

    # The addresses these records went to, by tenant: their tokens may go with them.
    if channel is Channel.MAIL:
        addressed = select(MailSendRecipient.tenant_id, MailSendRecipient.address).where(
            MailSendRecipient.record_id.in_(ids)
        )
    else:
        addressed = select(SmsSendRecord.tenant_id, SmsSendRecord.phone_number).where(
            SmsSendRecord.id.in_(ids)
        )
    addresses: dict[int, set[str]] = {}
    for tenant_id, address in session.execute(addressed.distinct()):
        addresses.setdefault(tenant_id, set()).add(address)
    if channel is Channel.MAIL:
        out["recipients"] += gone(
            delete(MailSendRecipient).where(MailSendRecipient.record_id.in_(ids))
        )
        out["subjects"] += gone(delete(MailSendSubject).where(MailSendSubject.record_id.in_(ids)))
        out["bounce_mails"] += gone(delete(ReceivedMail).where(ReceivedMail.record_id.in_(ids)))
    out["events"] += gone(
        delete(DeliveryEvent).where(
            DeliveryEvent.channel == channel.value, DeliveryEvent.record_id.in_(ids)
        )
    )
    out["callbacks"] += gone(
        delete(CallbackDelivery).where(
            CallbackDelivery.channel == channel.value, CallbackDelivery.record_id.in_(ids)
        )
    )
    out["attempts"] += gone(
        delete(SendAttempt).where(
            SendAttempt.channel == channel.value, SendAttempt.record_id.in_(ids)
        )
    )
    session.execute(
        delete(RecordEvent).where(
            RecordEvent.channel == channel.value, RecordEvent.record_id.in_(ids)
        )
    )
    out["dead_letters"] += gone(
        delete(DeadLetterMessage).where(
            DeadLetterMessage.channel == channel.value, DeadLetterMessage.event_id.in_(text_ids)
        )
    )
    out[f"{channel.value}_records"] += gone(delete(model).where(model.id.in_(ids)))
    for tenant_id, found in addresses.items():
        out["recipient_tokens"] += gone(
            delete(RecipientToken).where(
                RecipientToken.tenant_id == tenant_id,
                RecipientToken.channel == channel.value,
                RecipientToken.address.in_(sorted(found)),
                _no_record_left(channel),
            )
        )
    return +out


def duty_cycle(ratio: float = PAUSE_RATIO) -> Callable[[float], None]:
    """Between batches, rest ``ratio`` times as long as the batch took: the purge then takes
    at most 1 / (1 + ratio) of a database core, and sending keeps the rest."""

    def rest(batch_s: float) -> None:
        time.sleep(batch_s * ratio)

    return rest


def purge(
    engine: Engine,
    settings: Settings,
    batch: int = BATCH,
    between: Callable[[float], None] | None = None,
) -> Report:
    """One run of the retention chore over every tenant with a retention in force;
    ``between(seconds the batch took)`` runs after each batch (default: ``duty_cycle()``)."""
    from portal.metrics import RETENTION_DELETED

    rest = duty_cycle() if between is None else between
    report = Report()
    with Session(engine) as session:
        tenants = list(session.scalars(select(Tenant)))
        session.expunge_all()
    for tenant in tenants:
        for channel, parts in PARTS.items():
            model = parts.record
            days = retention_days(tenant, channel, settings)
            if days is None:
                continue
            now: datetime | None = None
            while True:
                started = time.monotonic()
                with Session(engine) as session, session.begin():
                    if now is None:  # one cutoff per run: later batches never reach further
                        now = session.scalar(select(db_now()))
                        assert now is not None
                    where = _purgeable(
                        model,
                        channel,
                        tenant.id,
                        now - timedelta(days=max(days, MIN_DAYS)),
                        now,
                        now - timedelta(seconds=settings.resend_window_s),
                    )
                    ids = list(
                        session.scalars(
                            select(model.id)
                            .where(where)
                            .order_by(model.id)
                            .limit(batch)
                            .with_for_update(skip_locked=True)
                        )
                    )
                    report.deleted.update(delete_records(session, channel, ids))
                if len(ids) < batch:
                    break
                rest(time.monotonic() - started)
    while True:  # events that never met their record
        with Session(engine) as session, session.begin():
            now = session.scalar(select(db_now()))
            assert now is not None
            early = list(
                session.scalars(
                    select(DeliveryEvent.id)
                    .where(
                        DeliveryEvent.record_id.is_(None),
                        DeliveryEvent.received_at < now - timedelta(days=EARLY_EVENT_DAYS),
                    )
                    .limit(batch)
                )
            )
            if early:
                report.deleted["early_events"] += _rowcount(
                    session.execute(delete(DeliveryEvent).where(DeliveryEvent.id.in_(early)))
                )
        if len(early) < batch:
            break
    for kind, n in report.deleted.items():
        RETENTION_DELETED.labels(kind=kind).inc(n)
    if report.deleted:
        log.info("retention run", extra={"deleted": report.as_dict()})
    return report


def oldest_kept(session: Session, tenant_id: int, channel: Channel) -> datetime | None:
    """When the tenant's oldest record of ``channel`` still kept was created."""
    model = PARTS[channel].record
    first = session.scalar(select(func.min(model.id)).where(model.tenant_id == tenant_id))
    if first is None:
        return None
    return session.scalar(select(model.created_time).where(model.id == first))


# --- forget this recipient ------------------------------------------------------------------


def forget_ids(session: Session, tenant_id: int, channel: Channel, address: str) -> list[int]:
    """The records of ``tenant_id`` addressed to ``address`` (normalised), every status."""
    if channel is Channel.MAIL:
        query = select(MailSendRecipient.record_id).where(
            MailSendRecipient.tenant_id == tenant_id, MailSendRecipient.address == address
        )
    else:
        query = select(SmsSendRecord.id).where(
            SmsSendRecord.tenant_id == tenant_id, SmsSendRecord.phone_number == address
        )
    return sorted(set(session.scalars(query)))


def forget(session: Session, tenant_id: int, channel: Channel, raw: str) -> Counter[str]:
    """Erase a recipient from one tenant: every record to it (with recipients, events and
    callbacks), its unmatched events; an existing suppression stays, by hash only. The caller
    writes the audit row and commits. Raises suppression.InvalidAddress."""
    address = suppression.normalise(channel, raw)
    out: Counter[str] = Counter()
    ids = forget_ids(session, tenant_id, channel, address)
    for start in range(0, len(ids), BATCH):
        out.update(delete_records(session, channel, ids[start : start + BATCH]))
    out["events"] += _rowcount(
        session.execute(
            delete(DeliveryEvent).where(
                DeliveryEvent.tenant_id == tenant_id,
                DeliveryEvent.channel == channel.value,
                func.lower(DeliveryEvent.recipient) == address.lower(),
            )
        )
    )
    # The recipient page's token row holds the address in clear (portal.models.search).
    out["recipient_tokens"] += _rowcount(
        session.execute(
            delete(RecipientToken).where(
                RecipientToken.tenant_id == tenant_id,
                RecipientToken.channel == channel.value,
                RecipientToken.address == address,
            )
        )
    )
    out["suppressions_hashed"] += _rowcount(
        session.execute(
            update(Suppression)
            .where(
                Suppression.tenant_id == tenant_id,
                Suppression.channel == channel.value,
                Suppression.address == address,
            )
            .values(address=suppression.hashed(address), detail=None)
            .execution_options(synchronize_session=False)
        )
    )
    return out


def _rowcount(result: Any) -> int:
    return int(result.rowcount)
