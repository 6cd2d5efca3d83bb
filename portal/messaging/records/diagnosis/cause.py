"""What happened to a record, in its own particulars: the diagnosis's title and cause."""

from __future__ import annotations

from datetime import datetime

from portal.messaging.after_send import suppression
from portal.messaging.records.diagnosis.reads import Reads, Record, frozen_config, when
from portal.messaging.records.diagnosis.reasons import (
    CATEGORY_TITLE,
    DEFERRAL_TITLE,
    MARKER_TITLE,
    STATUS_TITLE,
)
from portal.messaging.sending.classify import (
    DEFERRAL_HELP,
    MARKER_HELP,
    DeferralCode,
    ErrorCategory,
    MarkerCode,
    classify,
)
from portal.models import Channel, SendAttempt, SendStatus

# Preparation's own markers: the error message is preparation's words for what stopped it.
_PREPARATION = frozenset(
    {
        MarkerCode.TEMPLATE_NOT_RESOLVABLE,
        MarkerCode.CONFIG_NOT_RESOLVABLE,
        MarkerCode.MONTHLY_QUOTA_EXCEEDED,
        MarkerCode.CONTENT_INVALID,
    }
)
MARKERS = frozenset(m.value for m in MarkerCode)
DEFERRALS = frozenset(d.value for d in DeferralCode)
# Transport codes for no answer at all: the server or provider could not be reached.
_UNREACHED = frozenset({"NETWORK_ERROR", "TIMEOUT"})


def refused_for_good(channel: Channel, code: str | None, message: str | None) -> bool:
    """Whether a server's or provider's answer refused the recipient for good: a permanent
    refusal (550, 551, 553, "no such user"), or a provider's code for a number it never
    delivers to. Our own markers are not answers."""
    normalised = (code or "").strip().upper()
    if normalised in MARKERS or normalised in DEFERRALS:
        return False
    if suppression.refuses_recipient(channel, code):
        return True
    return classify(code, message) is ErrorCategory.PERMANENT


def _sentence(text: str) -> str:
    """``text`` as a sentence: a capital first, one full stop last."""
    text = text.strip().rstrip(".")
    return f"{text[:1].upper()}{text[1:]}." if text else ""


def cause_of(
    record: Record, status: SendStatus | None, reads: Reads, now: datetime
) -> tuple[str, str]:
    """(title, cause): what happened to the record, in its own particulars."""
    if status is None:
        return record.status, f"The status {record.status!r} is not one we know."
    if status is SendStatus.SENT:
        where = reads.where(frozen_config(record))
        return STATUS_TITLE[status], _sentence(
            f"{where} accepted it at {when(record.sent_at)}, so any problem is further along"
        )
    if status is SendStatus.PENDING and not record.error_code:
        return STATUS_TITLE[status], (
            f"Accepted at {when(record.created_time)} and waiting for a delivery worker."
        )
    if status is SendStatus.SENDING:
        return STATUS_TITLE[status], "A delivery worker is sending it right now."
    if status is SendStatus.CANCELLED:
        return STATUS_TITLE[status], "It was stopped before it was sent."
    code = (record.error_code or "").strip()
    message = (record.error_message or "").strip()
    attempt = reads.last.get(record.id)
    upper = code.upper()
    if upper in MARKERS:
        marker = MarkerCode(upper)
        title = MARKER_TITLE[marker]
        if marker in _PREPARATION:
            cause = f"It could not be prepared: {message or MARKER_HELP[marker][0]}"
        else:
            cause = MARKER_HELP[marker][0]
            if message:
                cause += f" ({message})"
    elif upper in DEFERRALS:
        deferral = DeferralCode(upper)
        title = DEFERRAL_TITLE[deferral]
        cause = message or DEFERRAL_HELP[deferral][0]
    elif code or message:
        title, cause = _answer(record, reads, attempt, code, message)
    else:
        title, cause = STATUS_TITLE.get(status, status.value), ""
    if record.ambiguous_attempt:
        if status is SendStatus.UNCERTAIN:
            title = STATUS_TITLE[status]
        cause = cause.rstrip(".") + (
            f". An attempt at {when(record.ambiguous_at)} got no answer after the message was "
            "handed over, so it may have been delivered"
        )
    if status is SendStatus.RETRY and upper not in DEFERRALS:
        cause = cause.rstrip(".") + f". It is tried again at {when(record.next_retry_at)}"
    elif status is SendStatus.DEAD_LETTER:
        cause = cause.rstrip(".") + (
            f". Its automatic retries are used up ({record.retry_count} made)"
        )
    elif status is SendStatus.SUPPRESSED and upper != MarkerCode.SUPPRESSED.value:
        title = STATUS_TITLE[status]
    return title, _sentence(cause)


def _answer(
    record: Record,
    reads: Reads,
    attempt: SendAttempt | None,
    code: str,
    message: str,
) -> tuple[str, str]:
    """(title, cause) of a failure the server or provider answered (or did not)."""
    category = classify(code, message)
    config_id = attempt.config_id if attempt is not None else frozen_config(record)
    where = reads.where(config_id, attempt.config_name if attempt else None)
    at = when(attempt.finished_at if attempt is not None else record.updated_time)
    said = " ".join(x for x in (code, message) if x)
    to = _one_recipient(record)
    if record.delivery_outcome == "bounced" and category is not ErrorCategory.AUTH:
        return "Bounced", f"It was sent, then bounced{f' for {to}' if to else ''}: {said}"
    if refused_for_good(reads.channel, code, message):
        whom = f" {to}" if to else " the recipient"
        return CATEGORY_TITLE[ErrorCategory.PERMANENT], f"{where} refused{whom} at {at}: {said}"
    if code.upper() in _UNREACHED:
        if record.ambiguous_attempt:
            return "No answer", f"{where} did not answer at {at}: {said}"
        return "Server unreachable", f"{where} could not be reached at {at}: {said}"
    verbs = {
        ErrorCategory.INVALID_INPUT: "refused the message",
        ErrorCategory.AUTH: "refused our credentials",
        ErrorCategory.CONFIG: "could not be used as configured",
        ErrorCategory.QUOTA: "refused it for a rate limit or quota",
        ErrorCategory.TRANSIENT: "answered with a temporary fault",
        ErrorCategory.UNKNOWN: "failed with an error we do not recognise",
    }
    verb = verbs.get(category, "failed")
    if attempt is None and category is ErrorCategory.UNKNOWN:
        return CATEGORY_TITLE[category], f"It failed with an error we do not recognise: {said}"
    return CATEGORY_TITLE[category], f"{where} {verb} at {at}: {said}"


def _one_recipient(record: Record) -> str | None:
    found = suppression.recipients(record)
    return found[0] if len(found) == 1 else None
