"""SMS adapters: one small module per provider over one httpx client, with a uniform result.

Pure library (no Flask, no database). A delivery worker owns one ``httpx.Client`` (see
``new_client``) and calls ``send(client, account, sms)``, which picks the adapter by the
provider config's kind and never raises for a failed send: every outcome is an ``SmsResult``.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from portal.messaging.sending import outbound
from portal.messaging.sending.transports.sms import http_json, test, twilio, vonage
from portal.messaging.sending.transports.sms.result import (
    CONFIG_ERROR,
    NETWORK_ERROR,
    TIMEOUT,
    OutgoingSms,
    ProviderAccount,
    SmsErrorCode,
    SmsResult,
    idempotency_key,
)

__all__ = [
    "ADAPTERS",
    "CONFIG_ERROR",
    "NETWORK_ERROR",
    "TIMEOUT",
    "OutgoingSms",
    "ProviderAccount",
    "SmsErrorCode",
    "SmsResult",
    "idempotency_key",
    "new_client",
    "send",
]

Adapter = Callable[[httpx.Client, ProviderAccount, OutgoingSms], SmsResult]

# By the provider config's ``provider`` column (portal.models.SmsProviderKind's values).
ADAPTERS: dict[str, Adapter] = {
    "twilio": twilio.send,
    "vonage": vonage.send,
    "http_json": http_json.send,
    "test": test.send,
}


def new_client(connect_timeout_s: float, read_timeout_s: float) -> httpx.Client:
    """The HTTP client of one delivery worker (kept open between sends, closed with it)."""
    timeout = httpx.Timeout(
        connect=connect_timeout_s, read=read_timeout_s, write=read_timeout_s, pool=connect_timeout_s
    )
    return outbound.http_client(
        timeout=timeout, follow_redirects=False, headers={"User-Agent": "postroom"}
    )


def send(client: httpx.Client, account: ProviderAccount, sms: OutgoingSms) -> SmsResult:
    """Send ``sms`` through ``account``'s provider."""
    adapter = ADAPTERS.get(account.kind)
    if adapter is None:
        return SmsResult.failed(
            CONFIG_ERROR, f"SMS provider {account.name!r} has an unknown kind {account.kind!r}"
        )
    return adapter(client, account, sms)
