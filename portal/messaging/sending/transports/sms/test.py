"""The ``test`` provider: completes without any network (seed 002's test mode).

Every send is accepted at once with a synthetic message id derived from the record's
idempotency key, so a demo or a staging tier exercises the whole pipeline and sends nothing.
The simulator's numbers (``portal.simulator.SMS``) are the exception: they fail, time out or
answer slowly on purpose, with the results a real provider's adapter gives for the same event.
"""

from __future__ import annotations

import time

import httpx

from portal import simulator
from portal.messaging.sending.transports.sms.result import (
    TIMEOUT,
    OutgoingSms,
    ProviderAccount,
    SmsErrorCode,
    SmsResult,
)
from portal.simulator import Behaviour

MESSAGE_ID_PREFIX = "test-"
PROVIDER = "test provider"

# Records whose first attempt the temporary-once number has failed (by idempotency key), in
# this delivery process.
_FAILED_ONCE = simulator.FirstTimes()


def send(client: httpx.Client, account: ProviderAccount, sms: OutgoingSms) -> SmsResult:
    """Accept the message without sending it anywhere, unless it goes to a simulator number."""
    behaviour = simulator.sms_behaviour(sms.to)
    if behaviour is not None:
        result = _simulate(client, behaviour, sms)
        if result is not None:
            return result
    return SmsResult.sent(f"{MESSAGE_ID_PREFIX}{sms.idempotency_key}")


def _simulate(client: httpx.Client, behaviour: Behaviour, sms: OutgoingSms) -> SmsResult | None:
    """The simulator's answer for ``sms.to``; None when it is accepted after all."""
    match behaviour:
        case Behaviour.REFUSED:
            return SmsResult.failed(
                SmsErrorCode.RECIPIENT_REFUSED,
                f"{PROVIDER}: simulator: the number refuses messages (barred or unreachable)",
                reply="simulator refused",
            )
        case Behaviour.TEMPORARY_ONCE if _FAILED_ONCE.first(sms.idempotency_key):
            return _temporary()
        case Behaviour.TEMPORARY_ONCE:
            return None
        case Behaviour.TEMPORARY_ALWAYS:
            return _temporary()
        case Behaviour.NO_ANSWER:
            return _no_answer()
        case Behaviour.SLOW:
            read = client.timeout.read
            if read is not None and read < simulator.SLOW_S:
                # A real provider this slow would outlast the read timeout.
                time.sleep(read)
                return _no_answer()
            time.sleep(simulator.SLOW_S)
            return None


def _temporary() -> SmsResult:
    return SmsResult.failed(
        SmsErrorCode.PROVIDER_ERROR,
        f"{PROVIDER}: simulator: temporary failure at the provider, try again later",
        reply="simulator temporary",
    )


def _no_answer() -> SmsResult:
    # What the HTTP adapters answer when the request was written and no answer came.
    return SmsResult.failed(
        TIMEOUT,
        f"{PROVIDER}: simulator: request sent, no answer in time; "
        "the provider may have accepted it",
        ambiguous=True,
    )
