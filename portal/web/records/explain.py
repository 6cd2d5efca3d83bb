"""Plain-language explanations of a send record: its status, and the cause its error code names.

This is the portal's side of the seed's "A user says it never arrived" guide: one entry per
status, per marker code and per error category, so every record page can say what happened
and what to do next. The cause texts are the domain's (``classify.MARKER_HELP`` and
``CATEGORY_HELP``); this module adds the status texts and picks the right entry for a record.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from portal.messaging.classify import (
    CATEGORY_HELP,
    DEFERRAL_HELP,
    DeferralCode,
    ErrorCategory,
    MarkerCode,
    classify,
    is_retryable,
    marker_help,
)
from portal.models import Channel, SendStatus


class Tone(StrEnum):
    """How the panel looks: it matches the status pill's colour family."""

    GOOD = "good"
    WAIT = "wait"
    BAD = "bad"
    NEUTRAL = "neutral"


@dataclass(frozen=True)
class StatusHelp:
    label: str  # what the status pill says, in plain words
    happened: str
    todo: str
    tone: Tone


STATUS_HELP: dict[SendStatus, StatusHelp] = {
    SendStatus.PENDING: StatusHelp(
        "Waiting to send",
        "Accepted and waiting for a delivery worker to pick it up.",
        "Nothing, usually: it goes out within seconds. If it waits for long, check that the "
        "delivery workers are running and not all tied up by a slow server.",
        Tone.WAIT,
    ),
    SendStatus.SENDING: StatusHelp(
        "Sending now",
        "A delivery worker is sending it right now.",
        "Nothing, usually. A record Sending for more than 5 minutes is put back to retry "
        "automatically (its worker stopped or crashed).",
        Tone.WAIT,
    ),
    SendStatus.SENT: StatusHelp(
        "Sent",
        "The server or provider accepted it, so any problem is further along.",
        "Check the delivery receipt or bounce, then ask the recipient to look in spam.",
        Tone.GOOD,
    ),
    SendStatus.RETRY: StatusHelp(
        "Will try again",
        "An attempt failed with a temporary error; it is tried again when its next retry "
        "time comes.",
        "Read the error code and reason below. Nothing else to do unless it keeps failing.",
        Tone.WAIT,
    ),
    SendStatus.FAILED: StatusHelp(
        "Failed",
        "It was not sent, and retrying automatically would not help.",
        "Fix the cause the error code points to (below), then press Retry.",
        Tone.BAD,
    ),
    SendStatus.DEAD_LETTER: StatusHelp(
        "Gave up after retries",
        "Every automatic retry failed, so it was archived as a dead letter for operators.",
        "Fix the cause the error code points to (below), then press Retry: it gets one more "
        "chance.",
        Tone.BAD,
    ),
    SendStatus.CANCELLED: StatusHelp(
        "Cancelled",
        "It was stopped before it was sent.",
        "Nothing. Send a new message if it is still wanted.",
        Tone.NEUTRAL,
    ),
    SendStatus.SUPPRESSED: StatusHelp(
        "Not sent: recipient suppressed",
        "The recipient is on the suppression list (an earlier hard bounce, complaint or "
        "unsubscribe), so it was not sent.",
        "Remove the recipient from the suppression list only if you are sure they want the "
        "message, then send a new one.",
        Tone.NEUTRAL,
    ),
    SendStatus.UNCERTAIN: StatusHelp(
        "Outcome unknown",
        "An attempt may have reached the server or provider, but no answer came back, so "
        "we cannot tell whether it was delivered.",
        "Check with the provider (recipient, time, message id) before sending it again, so "
        "the recipient does not get it twice.",
        Tone.BAD,
    ),
}

# "Sent" needs a different next step per channel (seed 000: bounce flag and spam folder for
# mail, the provider's receipt for SMS).
SENT_TODO: dict[Channel, str] = {
    Channel.MAIL: (
        "Check the bounce code on this record (a bounce received turns it to Failed), then "
        "ask the recipient to look in their spam folder."
    ),
    Channel.SMS: (
        "Check the provider's delivery receipt for the provider message id; the handset may "
        "have been off or out of coverage."
    ),
}

CATEGORY_LABEL: dict[ErrorCategory, str] = {
    ErrorCategory.TRANSIENT: "Temporary fault",
    ErrorCategory.QUOTA: "Rate limit or quota",
    ErrorCategory.UNKNOWN: "Unrecognised error",
    ErrorCategory.PERMANENT: "Recipient refused",
    ErrorCategory.INVALID_INPUT: "Invalid message or recipient",
    ErrorCategory.AUTH: "Credentials refused",
    ErrorCategory.CONFIG: "Configuration incomplete",
}

MARKER_LABEL: dict[MarkerCode, str] = {
    MarkerCode.TEMPLATE_NOT_RESOLVABLE: "Template missing, disabled or broken",
    MarkerCode.CONFIG_NOT_RESOLVABLE: "Send configuration incomplete",
    MarkerCode.MONTHLY_QUOTA_EXCEEDED: "Monthly quota used up",
    MarkerCode.CONTENT_INVALID: "Content invalid",
    MarkerCode.QUOTA_EXCEEDED: "Rate-limit window full",
    MarkerCode.RATE_LIMIT_UNAVAILABLE: "Rate-limit check unavailable",
    MarkerCode.ZOMBIE_RECOVERED: "Stuck send recovered",
    MarkerCode.ZOMBIE_EXHAUSTED: "Stuck send, retries used up",
    MarkerCode.EXPIRED: "Expired before sending",
    MarkerCode.RETRY_WINDOW_EXPIRED: "Retry window ran out",
    MarkerCode.SUPPRESSED: "Recipient on the suppression list",
    MarkerCode.RESOLVED_FAILED: "Resolved as failed by an operator",
}

DEFERRAL_LABEL: dict[DeferralCode, str] = {
    DeferralCode.SERVER_UNAVAILABLE: "Waiting for the server to come back",
    DeferralCode.SERVER_BUSY: "Waiting for a slow server",
}

_MARKERS = frozenset(m.value for m in MarkerCode)
_DEFERRALS = frozenset(d.value for d in DeferralCode)

# Statuses whose next step is the error's: fix what the code points to (or wait for it).
CAUSE_DECIDES = frozenset({SendStatus.RETRY, SendStatus.FAILED, SendStatus.DEAD_LETTER})

# Past this, a record still Pending or Sending deserves a word (the sweep's default threshold).
LONG_WAIT_S = 300.0


@dataclass(frozen=True)
class Cause:
    title: str  # e.g. "Monthly quota used up"
    code: str | None
    category: ErrorCategory
    happened: str
    todo: str


@dataclass(frozen=True)
class Explanation:
    status: str
    label: str
    tone: Tone
    happened: str
    todo: str
    cause: Cause | None
    notes: tuple[str, ...] = ()


def label(status: str) -> str:
    """The plain-language label of a status (the raw value for one we do not know)."""
    try:
        return STATUS_HELP[SendStatus(status)].label
    except ValueError:
        return status


def cause_of(code: str | None, message: str | None, channel: Channel | None = None) -> Cause | None:
    """What an error code (or, failing that, its message) says happened, or None if no error
    (in the channel's own words where a marker means something different per channel)."""
    if not code and not message:
        return None
    category = classify(code, message)
    normalised = (code or "").strip().upper()
    if normalised in _DEFERRALS:
        deferral = DeferralCode(normalised)
        happened, todo = DEFERRAL_HELP[deferral]
        return Cause(DEFERRAL_LABEL[deferral], code, category, happened, todo)
    if normalised in _MARKERS:
        marker = MarkerCode(normalised)
        happened, todo = marker_help(marker, channel.value if channel else None)
        # A marker added to the domain before it gets a label here still reads sensibly.
        title = MARKER_LABEL.get(marker, marker.value.replace("_", " ").capitalize())
        return Cause(title, code, category, happened, todo)
    happened, todo = CATEGORY_HELP[category]
    return Cause(CATEGORY_LABEL[category], code, category, happened, todo)


def _retried_by_itself(status: SendStatus, cause: Cause) -> bool:
    """A dead letter's cause that would be retried by itself (a transient failure, a full
    window): its retries are used up, so nothing happens by itself any more; the status says
    what to do (fix the cause, press Retry), not the cause ("Nothing: tried again")."""
    return status is SendStatus.DEAD_LETTER and is_retryable(cause.category)


def explain(
    status: str,
    channel: Channel,
    error_code: str | None = None,
    error_message: str | None = None,
    *,
    waited_s: float | None = None,
    ambiguous: bool = False,
) -> Explanation:
    """The "what happened and what to do" panel for a record in ``status``.

    ``waited_s``: how long the record has been in its status (for Pending / Sending);
    ``ambiguous``: an earlier attempt may have been accepted (seed 002), which no later
    outcome erases.
    """
    try:
        known = SendStatus(status)
    except ValueError:
        return Explanation(
            status, status, Tone.NEUTRAL, f"The status {status!r} is not one we know.", "", None
        )
    help_ = STATUS_HELP[known]
    # A Sent record may still carry an old attempt's error; it no longer explains anything.
    cause = None if known is SendStatus.SENT else cause_of(error_code, error_message, channel)
    if known is SendStatus.SENT:
        todo = SENT_TODO[channel]
    elif cause is not None and known in CAUSE_DECIDES and not _retried_by_itself(known, cause):
        todo = cause.todo
    else:
        # Waiting, in flight, uncertain, cancelled or suppressed: the status says what to do,
        # whatever the last error's category would advise ("retried automatically" would be
        # wrong for an uncertain record, say).
        todo = help_.todo
    notes: list[str] = []
    if waited_s is not None and waited_s > LONG_WAIT_S:
        minutes = int(waited_s // 60)
        if known is SendStatus.PENDING:
            notes.append(
                f"It has waited {minutes} minutes. Check that the delivery workers are running."
            )
        elif known is SendStatus.SENDING:
            notes.append(
                f"It has been Sending for {minutes} minutes: the stuck-send sweep puts it back "
                "to retry within a minute or two."
            )
    if ambiguous:
        notes.append(
            "An earlier attempt got no answer and may have been delivered: before pressing "
            "Retry, check with the provider that it did not arrive."
        )
    return Explanation(
        known.value, help_.label, help_.tone, help_.happened, todo, cause, tuple(notes)
    )
