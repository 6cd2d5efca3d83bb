"""Simulator recipients: mail addresses and phone numbers that fail on purpose.

People learn a delivery service by watching it fail. The demo's SMTP sink
(``scripts/smtp_sink.py``) and the ``test`` SMS provider
(``portal.messaging.sending.transports.sms.test``) answer these recipients as this table says; the
template editor's Send test lists them. Any other recipient is accepted as before.

The mail addresses live under ``simulator.postroom.example`` (``.example`` is reserved, RFC 2606:
no real mail can go there). The numbers are Ofcom's London drama range, +44 20 7946 0xxx,
reserved for fiction; the mobile drama range (+44 7700 900xxx) cannot be used because
libphonenumber, and so our own validation, refuses it as not a valid number.

Stdlib only: the sink and the tests' servers import it without the rest of the portal.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from enum import StrEnum

MAIL_DOMAIN = "simulator.postroom.example"
# How long a "slow" recipient takes to answer: long enough to notice, well inside the default
# read timeouts (SMTP_READ_TIMEOUT_S and SMS_READ_TIMEOUT_S, 30 s).
SLOW_S = 3.0


class Behaviour(StrEnum):
    REFUSED = "refused"
    TEMPORARY_ONCE = "temporary_once"
    TEMPORARY_ALWAYS = "temporary_always"
    NO_ANSWER = "no_answer"
    SLOW = "slow"


@dataclass(frozen=True)
class Simulated:
    """One simulator recipient: what the sink or provider does, and what the portal shows."""

    address: str
    behaviour: Behaviour
    does: str
    shows: str


# What the demo's SMTP sink answers. A refusal and a busy mailbox come at RCPT, as a real
# server's would; the rest at the end of DATA, once the whole message has been received.
REFUSED_REPLY = "550 5.1.1 simulator: no such mailbox (refused on purpose)"
TEMPORARY_REPLY = "451 4.3.0 simulator: temporary failure, try again later"

_RETRIES = "after the retry schedule (MAX_RETRIES retries, BACKOFF_BASE_S apart, doubling)"

MAIL: Mapping[str, Simulated] = {
    entry.behaviour.value: entry
    for entry in (
        Simulated(
            f"refused@{MAIL_DOMAIN}",
            Behaviour.REFUSED,
            f"The server refuses the recipient at RCPT: {REFUSED_REPLY[:9]}.",
            "Failed at once with 550 5.1.1: the address does not exist; no retry.",
        ),
        Simulated(
            f"temporary-once@{MAIL_DOMAIN}",
            Behaviour.TEMPORARY_ONCE,
            "The server answers 451 to the first attempt of each message, then accepts it.",
            "Retry after the first attempt, then Sent: two attempts on the record's timeline.",
        ),
        Simulated(
            f"temporary-always@{MAIL_DOMAIN}",
            Behaviour.TEMPORARY_ALWAYS,
            "The server answers 451 at RCPT to every attempt.",
            f"Retry, again and again, then Dead letter {_RETRIES}.",
        ),
        Simulated(
            f"no-answer@{MAIL_DOMAIN}",
            Behaviour.NO_ANSWER,
            "The server receives the whole message, then drops the connection without answering.",
            "Ambiguous: it may have been delivered. On a server whose uncertain policy is "
            "'hold': Uncertain at once. On 'retry' (the demo's): retried (the sink keeps a copy "
            f"each time), then Dead letter {_RETRIES}, listed under Needs a decision.",
        ),
        Simulated(
            f"slow@{MAIL_DOMAIN}",
            Behaviour.SLOW,
            f"The server takes {SLOW_S:g} s to accept the message.",
            f"Sending for {SLOW_S:g} s, then Sent.",
        ),
    )
}

SMS: Mapping[str, Simulated] = {
    entry.behaviour.value: entry
    for entry in (
        Simulated(
            "+442079460001",
            Behaviour.REFUSED,
            "The provider refuses the number (barred or unreachable).",
            "Failed at once with SMS_RECIPIENT_REFUSED; no retry.",
        ),
        Simulated(
            "+442079460002",
            Behaviour.TEMPORARY_ONCE,
            "The provider fails the first attempt of each message (its own fault), then "
            "accepts it.",
            "Retry after the first attempt, then Sent.",
        ),
        Simulated(
            "+442079460003",
            Behaviour.TEMPORARY_ALWAYS,
            "The provider fails every attempt (its own fault).",
            f"Retry, again and again, then Dead letter {_RETRIES}.",
        ),
        Simulated(
            "+442079460004",
            Behaviour.NO_ANSWER,
            "The provider takes the request and never answers (a read timeout).",
            "Ambiguous: it may have been sent. On a provider whose uncertain policy is 'hold': "
            "Uncertain at once. On 'retry' (the test provider's default): retried, then Dead "
            f"letter {_RETRIES}, listed under Needs a decision.",
        ),
        Simulated(
            "+442079460005",
            Behaviour.SLOW,
            f"The provider takes {SLOW_S:g} s to accept the message.",
            f"Sending for {SLOW_S:g} s, then Sent.",
        ),
    )
}

_MAIL_BY_ADDRESS = {entry.address: entry.behaviour for entry in MAIL.values()}
_SMS_BY_NUMBER = {entry.address: entry.behaviour for entry in SMS.values()}


def mail_behaviour(address: str) -> Behaviour | None:
    """What the simulator does with a mail address (any case, with or without <>); None for an
    ordinary recipient."""
    return _MAIL_BY_ADDRESS.get(address.strip().strip("<>").lower())


def sms_behaviour(number: str) -> Behaviour | None:
    """What the simulator does with a phone number in E.164; None for an ordinary one."""
    return _SMS_BY_NUMBER.get(number.strip())


def entries(channel: str) -> list[Simulated]:
    """The table of ``channel`` ("mail" or "sms"), in a stable order, for pages to list."""
    return list((MAIL if channel == "mail" else SMS).values())


class FirstTimes:
    """Remembers which keys it has seen (the most recent ``size`` of them), for "fail the first
    attempt": a key is a message (its id and recipient), the same on every attempt.

    Kept in the memory of one process (the sink, or a worker's delivery process): a retry taken
    by another process, or one after a restart, fails once more; it still ends Sent."""

    def __init__(self, size: int = 10_000) -> None:
        self.size = size
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._lock = threading.Lock()

    def first(self, key: Hashable) -> bool:
        """True the first time ``key`` is seen, False after."""
        with self._lock:
            if key in self._seen:
                self._seen.move_to_end(key)
                return False
            self._seen[key] = None
            if len(self._seen) > self.size:
                self._seen.popitem(last=False)
            return True

    def forget(self, key: Hashable) -> None:
        """Make ``key`` new again."""
        with self._lock:
            self._seen.pop(key, None)
