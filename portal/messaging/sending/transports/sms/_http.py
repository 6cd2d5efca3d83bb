"""What every HTTP adapter shares: one POST with its failures turned into results, Retry-After,
and the status rules (408, 425, 429, 5xx retryable; 401/403 AUTH; other 4xx by the provider's
code). Whether a failure says the provider itself is unavailable (its breaker counts it) is
decided for every adapter by ``classify.unavailable``, from how far the request got."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from portal.messaging.sending import outbound
from portal.messaging.sending.classify import Reach, unavailable
from portal.messaging.sending.transports.sms.result import (
    CONFIG_ERROR,
    NETWORK_ERROR,
    TIMEOUT,
    SmsResult,
)

# Statuses whose meaning does not depend on the provider's code: the code goes in the message.
_STATUS_DECIDES = frozenset({401, 403, 408, 425, 429}) | frozenset(range(500, 600))
# A provider's own message (beside its error code) is kept to this many characters; a body
# in no provider's format is never shown (the target may not be a provider at all).
_MESSAGE_CHARS = 200


# How hosts are looked up (one lookup a request); tests without a network set their own.
RESOLVER: outbound.Resolver = outbound.system_resolver


def post(
    client: httpx.Client,
    url: str,
    *,
    provider: str,
    allow_private: bool,
    method: str = "POST",
    auth: tuple[str, str] | None = None,
    **kwargs: Any,
) -> httpx.Response | SmsResult:
    """POST (or ``method``) to the checked address of ``url``'s host (the outbound policy), or
    the failed result that says how far the request got.

    A failure before the request was completely written cannot have been acted on; one after it
    (no answer in time, connection dropped) may have been: that attempt is ambiguous.
    """
    try:
        request = outbound.pinned_request(
            client, method, url, allow_private=allow_private, resolver=RESOLVER, **kwargs
        )
    except outbound.Unresolved as exc:
        return _unanswered(Reach.CONNECT, NETWORK_ERROR, f"{provider}: cannot connect ({exc})")
    except outbound.Refused as exc:
        return _unanswered(Reach.LOCAL, CONFIG_ERROR, f"{provider}: the base URL is refused: {exc}")
    try:
        return client.send(request, auth=auth, follow_redirects=False)
    except httpx.ConnectTimeout as exc:
        return _unanswered(
            Reach.CONNECT, TIMEOUT, f"{provider}: connect timed out ({exc or 'no detail'})"
        )
    except httpx.ConnectError as exc:  # refused, reset, unknown host, TLS
        return _unanswered(Reach.CONNECT, NETWORK_ERROR, f"{provider}: cannot connect ({exc})")
    except httpx.WriteTimeout as exc:
        return _unanswered(
            Reach.REQUEST,
            TIMEOUT,
            f"{provider}: timed out before the request was sent ({exc or 'no detail'})",
        )
    except httpx.PoolTimeout as exc:  # waiting for a connection of our own client
        return _unanswered(
            Reach.LOCAL,
            TIMEOUT,
            f"{provider}: timed out before the request was sent ({exc or 'no detail'})",
        )
    except httpx.WriteError as exc:
        return _unanswered(
            Reach.REQUEST,
            NETWORK_ERROR,
            f"{provider}: connection lost while sending the request ({exc})",
        )
    except httpx.ReadTimeout as exc:
        return _unanswered(
            Reach.SENT,
            TIMEOUT,
            f"{provider}: request sent, no answer in time ({exc or 'read timeout'}); "
            "the provider may have accepted it",
        )
    except (httpx.ReadError, httpx.RemoteProtocolError, httpx.CloseError) as exc:
        return _unanswered(
            Reach.SENT,
            NETWORK_ERROR,
            f"{provider}: request sent, connection lost before the answer ({exc}); "
            "the provider may have accepted it",
        )
    except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
        return _unanswered(
            Reach.LOCAL, CONFIG_ERROR, f"{provider}: the base URL {url!r} is unusable: {exc}"
        )
    except (httpx.ProxyError, httpx.LocalProtocolError) as exc:
        return _unanswered(Reach.LOCAL, NETWORK_ERROR, f"{provider}: {type(exc).__name__}: {exc}")
    except httpx.TransportError as exc:
        # Not one we know: we cannot tell how far the request got, so do not assume it failed.
        return _unanswered(Reach.SENT, NETWORK_ERROR, f"{provider}: {type(exc).__name__}: {exc}")


def _unanswered(reach: Reach, code: str, message: str) -> SmsResult:
    """A request that got no HTTP answer: ambiguous once it was completely sent."""
    return SmsResult.failed(
        code, message, ambiguous=reach is Reach.SENT, connection=unavailable(reach)
    )


def retry_after_s(response: httpx.Response, now: datetime | None = None) -> float | None:
    """The Retry-After header in seconds (delta-seconds or an HTTP date); None when absent."""
    raw = response.headers.get("Retry-After", "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        try:
            when = parsedate_to_datetime(raw)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        value = (when - (now or datetime.now(UTC))).total_seconds()
    if not math.isfinite(value):
        return None
    return max(value, 0.0)


def json_body(response: httpx.Response) -> dict[str, Any] | None:
    """The body as a JSON object, or None when it is not one."""
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        return None
    return body if isinstance(body, dict) else None


NOT_UNDERSTOOD = "an answer in no format we read (not shown)"


@dataclass(frozen=True)
class Refusals:
    """How a provider of ``kind`` says no in its JSON body: its own code under ``code_key``, its
    message under the first of ``message_keys`` that holds one. ``codes`` maps its codes to
    ours (``SmsErrorCode``); one we do not know is kept as it is, after ``own_code_prefix``
    ("TWILIO_21999")."""

    kind: str
    codes: Mapping[str, str]
    own_code_prefix: str = ""
    code_key: str = "code"
    message_keys: tuple[str, ...] = ("message",)

    def result(
        self, response: httpx.Response, body: dict[str, Any] | None, provider: str
    ) -> SmsResult:
        """The result of a refused request (not 2xx), ``body`` its ``json_body``.

        The status decides for 401/403 (AUTH), 408/425/5xx (TRANSIENT) and 429 (QUOTA): the
        code is ``HTTP_<status>``. Any other status is decided by the provider's code through
        ``codes``, and a body we do not understand gives ``HTTP_<status>``.
        """
        code = said = None
        if body:
            code = body.get(self.code_key)
            for key in self.message_keys:
                said = body.get(key)
                if said:
                    break
        status = response.status_code
        wait = retry_after_s(response)
        if code is None:
            # Without the provider's code the body may be anything the URL answers: never echoed.
            text = NOT_UNDERSTOOD
            return SmsResult.failed(
                f"HTTP_{status}",
                f"{provider} answered HTTP {status}: {text}",
                retry_after_s=wait,
                connection=unavailable(Reach.ANSWERED, kind=self.kind, status=status),
                reply=str(status),
            )
        provider_code = str(code)
        shown = ((str(said) if said is not None else "") or "(no message)")[:_MESSAGE_CHARS]
        message = f"{provider} {provider_code[:40]}: {shown} (HTTP {status})"
        own = self.codes.get(provider_code) or f"{self.own_code_prefix}{provider_code}"
        return SmsResult.failed(
            f"HTTP_{status}" if status in _STATUS_DECIDES else own,
            message,
            retry_after_s=wait,
            connection=unavailable(
                Reach.ANSWERED, kind=self.kind, status=status, provider_code=provider_code, code=own
            ),
            reply=f"{status} {provider_code}"[:100],
        )
