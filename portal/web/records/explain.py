"""How a record's state looks on the portal's pages: each status's plain label and the colour
family of its pill and panel.

What happened, whether a retry would fail again, what to do and who can are the record's
diagnosis (``portal.messaging.records.diagnosis``); this module only dresses them.
"""

from __future__ import annotations

from enum import StrEnum

from portal.messaging.records.diagnosis import Diagnosis
from portal.models import Role, SendStatus


class Tone(StrEnum):
    """How the panel looks: it matches the status pill's colour family."""

    GOOD = "good"
    WAIT = "wait"
    BAD = "bad"
    NEUTRAL = "neutral"


# What each status pill says, in plain words, and its colour family.
STATUS_LOOK: dict[SendStatus, tuple[str, Tone]] = {
    SendStatus.PENDING: ("Waiting to send", Tone.WAIT),
    SendStatus.SENDING: ("Sending now", Tone.WAIT),
    SendStatus.SENT: ("Sent", Tone.GOOD),
    SendStatus.RETRY: ("Will try again", Tone.WAIT),
    SendStatus.FAILED: ("Failed", Tone.BAD),
    SendStatus.DEAD_LETTER: ("Gave up after retries", Tone.BAD),
    SendStatus.CANCELLED: ("Cancelled", Tone.NEUTRAL),
    SendStatus.SUPPRESSED: ("Not sent: recipient suppressed", Tone.NEUTRAL),
    SendStatus.UNCERTAIN: ("Outcome unknown", Tone.BAD),
}


def label(status: str) -> str:
    """The plain-language label of a status (the raw value for one we do not know)."""
    try:
        return STATUS_LOOK[SendStatus(status)][0]
    except ValueError:
        return status


def tone(status: str, found: Diagnosis | None = None) -> Tone:
    """The panel's colour: the status's, except that a record waiting to be retried which
    would fail again looks as bad as it is."""
    try:
        own = STATUS_LOOK[SendStatus(status)][1]
    except ValueError:
        return Tone.NEUTRAL
    if found is not None and found.would_fail_again and own is Tone.WAIT:
        return Tone.BAD
    return own


def who_can(found: Diagnosis, role: str | None) -> str | None:
    """The line a viewer who cannot act reads: who can (None when the viewer can)."""
    if role is not None and found.can_act(Role(role)):
        return None
    return f"You cannot do this yourself: {found.who_words} can."
