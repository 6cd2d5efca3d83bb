"""The ``test`` provider: completes without any network (seed 002's test mode).

Every send is accepted at once with a synthetic message id derived from the record's
idempotency key, so a demo or a staging tier exercises the whole pipeline and sends nothing.
"""

from __future__ import annotations

import httpx

from portal.messaging.transports.sms.result import OutgoingSms, ProviderAccount, SmsResult

MESSAGE_ID_PREFIX = "test-"


def send(client: httpx.Client, account: ProviderAccount, sms: OutgoingSms) -> SmsResult:
    """Accept the message without sending it anywhere."""
    return SmsResult.sent(f"{MESSAGE_ID_PREFIX}{sms.idempotency_key}")
