"""One diagnosis of a send record: what happened, whether sending it again now would fail the
same way and why, what to do, and which role can do it.

Every page and endpoint that shows or acts on a record's state asks this package: the record
page's panel and its Retry, bulk retry's plan, the operator API's retries, the dead-letter and
"Needs a decision" pages, the recipient page and the API's record GET. None of them works out a
cause, advice or retry verdict of its own, so they cannot disagree. ``diagnose_many`` serves a
selection: each tier's configuration, its servers' health, the suppressions, the quotas and the
last attempts are read once for all of it; ``diagnose`` is the same for one record.

The verdict reads the causes as they are now, not the record's status or error code, in the
order an attempt would meet them; the first found answers:

1. past its ``expiresAt``: EXPIRED (a retry needs a new expiry);
2. every recipient on the tenant's suppression list: SUPPRESSED;
3. the last answer refused the recipient for good (a 5xx refusal, a hard bounce, a provider's
   "invalid number"): RECIPIENT_REFUSED;
4. preparation, by its own steps (``preparation.dry_run``), for a record not prepared yet or
   one whose server or provider is gone after CONFIG_NOT_RESOLVABLE (a retry chooses again):
   the template (NO_TEMPLATE, TEMPLATE_DISABLED, TEMPLATE_BROKEN), the content
   (CONTENT_INVALID), the choice (NO_ROUTE, NO_BINDING, SERVER_DISABLED,
   SERVER_MISCONFIGURED). The template is rendered again only for a record whose last failure
   was the render or the content (TEMPLATE_NOT_RESOLVABLE, CONTENT_INVALID); any other
   record rendered, or has not been tried;
5. the server or provider it was prepared for, missing or disabled: SERVER_DISABLED (the next
   attempt fails CONFIG_NOT_RESOLVABLE);
6. that server or provider down, as its health says it on its page (``health.states``):
   "Failing" (its recent attempts could not reach it, the breaker open or not yet) or
   "Paused by the breaker": SERVER_DOWN, naming that line;
7. what it answered last, unless its configuration was saved since: our credentials refused
   (CREDENTIALS_REFUSED), it cannot send as configured (SERVER_MISCONFIGURED), the message as
   prepared refused (MESSAGE_REFUSED);
8. the monthly quota of a record still to be charged, the selection's records counted in turn,
   oldest first: QUOTA_FULL.

Anything else (a temporary fault, a full rate-limit window, a stuck send, an error we do not
recognise) is not known to fail again. An earlier attempt that may have been delivered
(``ambiguous``) is no failure, but a retry asks first all the same: it may deliver twice.

Its parts, one question each: ``cause`` (what happened), ``verdict`` (would a retry fail
again), ``next_step`` (what to do, who can), on what ``reads`` read once for the selection and
in the words of ``reasons``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from portal.config import Settings
from portal.messaging.after_send import suppression
from portal.messaging.records.diagnosis.cause import cause_of
from portal.messaging.records.diagnosis.next_step import next_step
from portal.messaging.records.diagnosis.reads import Reads, Record
from portal.messaging.records.diagnosis.reasons import RANK, ROLE_WORDS, Reason
from portal.messaging.records.diagnosis.verdict import verdict_of
from portal.messaging.records.retry import REFUSAL_REASONS
from portal.models import Channel, Role, SendStatus
from portal.models.enums import RETRYABLE_BY_HAND

# The record columns a diagnosis reads (pages that load only some columns add these).
COLUMNS = (
    "id",
    "tenant_id",
    "scope",
    "status",
    "retry_count",
    "attempt_count",
    "next_retry_at",
    "error_code",
    "error_message",
    "template_id",
    "template_code",
    "variables",
    "expires_at",
    "pinned_template_version",
    "prepared_at",
    "ambiguous_attempt",
    "ambiguous_at",
    "ambiguous_reason",
    "delivery_outcome",
    "resolution",
    "created_time",
    "updated_time",
    "sent_at",
)
MAIL_COLUMNS = (
    "to_addrs",
    "cc_addrs",
    "bcc_addrs",
    "subject",
    "html_body",
    "text_body",
    "reply_to",
    "server_id",
    "server_config_id",
    "bounce_code",
)
SMS_COLUMNS = ("phone_number", "country_code", "content", "provider_config_id")
_RETRYABLE = frozenset(s.value for s in RETRYABLE_BY_HAND)


@dataclass(frozen=True)
class Diagnosis:
    """What the product knows about one record, for whoever looks or acts."""

    title: str  # what happened, in a few words ("Recipient refused")
    cause: str  # what happened, specific to this record's error and attempt
    would_fail_again: bool  # sending it again now would fail the same way
    reason: Reason | None  # why, when it would
    why: str | None  # why, in a line that ends with what to change first (bulk retry's words)
    action: str  # what to do next
    who: Role  # the least role that can do it
    retryable: bool  # its status lets a person retry it
    refusal: str | None  # why its status does not, when it does not
    ambiguous: bool  # an earlier attempt may have been delivered: a retry may deliver twice
    suppressed: dict[str, str] = field(default_factory=dict)  # its recipients on the list: why
    notes: tuple[str, ...] = ()

    @property
    def asks_first(self) -> bool:
        """A person's Retry asks before requeuing (naming the reason or the risk)."""
        return self.retryable and (self.would_fail_again or self.ambiguous)

    def can_act(self, role: Role | str) -> bool:
        """Whether ``role`` can do what ``action`` says."""
        return RANK[Role(role)] >= RANK[self.who]

    @property
    def who_words(self) -> str:
        """Who can act, as a sentence names them ("a platform operator")."""
        return ROLE_WORDS[self.who]


def diagnose_many(
    session: Session,
    channel: Channel,
    records: Sequence[Record],
    settings: Settings,
    *,
    operator: bool = False,
    now: datetime | None = None,
) -> dict[int, Diagnosis]:
    """Record id -> its diagnosis, for ``records`` (already scoped by the caller).
    ``operator``: the viewer is a platform operator, who sees the platform's servers and
    providers by name (``tenancy.names_config``)."""
    reads = Reads(session, channel, records, settings, operator)
    moment = now or datetime.now(UTC)
    found: dict[int, Diagnosis] = {}
    charged: dict[int, int] = {}  # per tier, the selection's records counted against its room
    for record in sorted(records, key=lambda r: r.id):  # the oldest first, as the claim goes
        found[record.id] = _diagnose(record, reads, moment, charged)
    return found


def diagnose(
    session: Session,
    channel: Channel,
    record: Record,
    settings: Settings,
    *,
    operator: bool = False,
) -> Diagnosis:
    """The diagnosis of one record (``diagnose_many`` of one)."""
    return diagnose_many(session, channel, [record], settings, operator=operator)[record.id]


def _diagnose(record: Record, reads: Reads, now: datetime, charged: dict[int, int]) -> Diagnosis:
    try:
        status = SendStatus(record.status)
    except ValueError:
        status = None
    retryable = status in RETRYABLE_BY_HAND
    mine = {
        a: why
        for a in suppression.recipients(record)
        if (why := reads.suppressed.get((record.tenant_id, a))) is not None
    }
    title, cause = cause_of(record, status, reads, now)
    verdict = None
    if status not in (SendStatus.SENT, SendStatus.SENDING, SendStatus.CANCELLED, None):
        verdict = verdict_of(record, reads, now, charged, mine)
    action, who, notes = next_step(record, status, verdict, reads, now)
    return Diagnosis(
        title=title,
        cause=cause,
        would_fail_again=verdict is not None,
        reason=verdict.reason if verdict else None,
        why=verdict.why if verdict else None,
        action=action,
        who=who,
        retryable=retryable,
        refusal=None if retryable else refusal(record.status),
        ambiguous=bool(record.ambiguous_attempt),
        suppressed=mine,
        notes=notes,
    )


def refusal(status: str) -> str | None:
    """Why a record in ``status`` cannot be retried by a person, or None when it can."""
    if status in _RETRYABLE:
        return None
    return REFUSAL_REASONS.get(status, f"its status {status} cannot be retried")


def as_json(found: Diagnosis) -> dict[str, Any]:
    """The API's shape: ``{cause, wouldFailAgain: {value, reason}, action, who}``."""
    return {
        "cause": found.cause,
        "wouldFailAgain": {
            "value": found.would_fail_again,
            "reason": found.reason.value if found.reason else None,
            "why": found.why,
        },
        "action": found.action,
        "who": found.who.value,
    }
