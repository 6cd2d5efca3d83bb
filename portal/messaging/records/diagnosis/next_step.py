"""What to do about a record next, the least role that can, and the notes that go with it."""

from __future__ import annotations

from datetime import datetime

from portal.messaging.records.diagnosis.reads import Reads, Record, frozen_config, when
from portal.messaging.records.diagnosis.reasons import Reason, admin_of
from portal.messaging.records.diagnosis.verdict import Verdict
from portal.messaging.sending.classify import classify, is_retryable
from portal.models import Channel, Role, SendStatus

LONG_WAIT_S = 300.0  # a record Pending or Sending longer than this deserves a word


def next_step(
    record: Record,
    status: SendStatus | None,
    verdict: Verdict | None,
    reads: Reads,
    now: datetime,
) -> tuple[str, Role, tuple[str, ...]]:
    """(what to do, who can, notes)."""
    notes: list[str] = []
    waited = (now - record.updated_time).total_seconds() if record.updated_time else None
    if status is SendStatus.UNCERTAIN:
        where = reads.where(frozen_config(record))
        action = (
            f"Check with {where} whether it arrived (recipient, time, message id), then "
            "resolve it: mark it delivered or failed, or send it again as a new message. "
            "It is never resent by itself."
        )
        if verdict is not None:
            notes.append(f"Sending it again now would fail: {verdict.why}.")
        return action, admin_of(record.tenant_id), tuple(notes)
    if status is SendStatus.SENT:
        action = (
            "Check the bounce code on this record (a bounce received turns it to Failed), then "
            "ask the recipient to look in their spam folder."
            if reads.channel is Channel.MAIL
            else "Check the provider's delivery receipt for the provider message id; the "
            "handset may have been off or out of coverage."
        )
        return action, Role.SUPPORT, ()
    if status is SendStatus.CANCELLED:
        return "Nothing. Send a new message if it is still wanted.", admin_of(record.tenant_id), ()
    if status is SendStatus.SENDING:
        if waited is not None and waited > LONG_WAIT_S:
            notes.append(
                f"It has been Sending for {int(waited // 60)} minutes: the stuck-send sweep "
                "puts it back to retry within a minute or two."
            )
        return "Nothing: wait for the attempt to end.", Role.SUPPORT, tuple(notes)
    if status is SendStatus.SUPPRESSED:
        if verdict is not None and verdict.reason is Reason.SUPPRESSED:
            return (
                "Check the address with the recipient. If it works again, take it off the "
                "suppression list (with a reason), then send a new message.",
                verdict.who,
                (),
            )
        return (
            "It is no longer stopped by the list: send a new message if it is still wanted.",
            admin_of(record.tenant_id),
            (),
        )
    if verdict is not None:
        if record.ambiguous_attempt:
            notes.append(
                "An earlier attempt got no answer and may have been delivered: before retrying, "
                "check that it did not arrive."
            )
        return verdict.action, verdict.who, tuple(notes)
    if status is SendStatus.PENDING:
        if waited is not None and waited > LONG_WAIT_S:
            notes.append(
                f"It has waited {int(waited // 60)} minutes. Check that the delivery workers "
                "are running and not all tied up by a slow server."
            )
            return (
                "Check that the delivery workers are running.",
                Role.PLATFORM_OPERATOR,
                tuple(notes),
            )
        return "Nothing: it goes out within seconds.", Role.SUPPORT, ()
    category = classify(record.error_code, record.error_message)
    if record.ambiguous_attempt:
        return (
            "Check with the server or provider that it did not arrive, then retry it: it may "
            "have been delivered, and a retry would deliver it twice.",
            Role.SUPPORT,
            (),
        )
    if status is SendStatus.RETRY:
        return (
            f"Nothing: it is tried again by itself at {when(record.next_retry_at)}. Nothing "
            "found stops it now.",
            Role.SUPPORT,
            (),
        )
    if status is SendStatus.DEAD_LETTER and is_retryable(category):
        return (
            "Nothing found stops it now: retry it. If it keeps failing the same way, read the "
            "attempts below for what the server or provider said.",
            Role.SUPPORT,
            (),
        )
    return "Nothing found stops it now: retry it.", Role.SUPPORT, ()
