"""Records as JSON for the API (secrets and frozen bodies stay out of list views)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from portal.models import MailSendRecord, Scope, SendAttempt, SmsSendRecord
from portal.tenancy import PLATFORM_TENANT_ID

# What a tenant sees instead of a platform-tier server's or provider's name.
PLATFORM_ROUTE = {"mail": "platform mail service", "sms": "platform SMS service"}


def _time(value: datetime | None) -> str | None:
    return value.isoformat().replace("+00:00", "Z") if value else None


def _common(record: MailSendRecord | SmsSendRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "status": record.status,
        "scope": record.scope,
        "stream": record.stream,
        "retryCount": record.retry_count,
        "nextRetryAt": _time(record.next_retry_at),
        "errorCode": record.error_code,
        "errorMessage": record.error_message,
        "traceId": record.trace_id,
        "businessKey": record.business_key,
        "templateCode": record.template_code,
        "templateVersion": record.template_version,
        "test": bool(record.is_test),
        "providerMessageId": record.provider_message_id,
        "preparedAt": _time(record.prepared_at),
        "sentAt": _time(record.sent_at),
        "expiresAt": _time(record.expires_at),
        "metadata": record.request_metadata,
        # Seed 002: an ambiguous attempt is never erased, whatever the status says now.
        "ambiguous": bool(record.ambiguous_attempt),
        "createdTime": _time(record.created_time),
        "updatedTime": _time(record.updated_time),
    }


def _platform_hidden(record: MailSendRecord | SmsSendRecord, caller_tenant: int) -> bool:
    """A record of the platform scope was prepared with the platform tier's template and
    server or provider, whose ids a tenant never sees (they are null for it)."""
    return record.scope == Scope.PLATFORM.value and caller_tenant != PLATFORM_TENANT_ID


def mail_record_json(record: MailSendRecord, caller_tenant: int) -> dict[str, Any]:
    hidden = _platform_hidden(record, caller_tenant)
    return _common(record) | {
        "to": record.to_addrs,
        "cc": record.cc_addrs or [],
        "bcc": record.bcc_addrs or [],
        "subject": record.rendered_subject or record.subject,
        "templateId": None if hidden else record.template_id,
        "serverId": None if hidden else (record.server_config_id or record.server_id),
    }


def sms_record_json(record: SmsSendRecord, caller_tenant: int) -> dict[str, Any]:
    hidden = _platform_hidden(record, caller_tenant)
    return _common(record) | {
        "phoneNumber": record.phone_number,
        "countryCode": record.country_code,
        "content": record.rendered_content or record.content,
        "providerId": None if hidden else record.provider_config_id,
    }


def attempts_json(
    record: MailSendRecord | SmsSendRecord, attempts: list[SendAttempt], caller_tenant: int
) -> list[dict[str, Any]]:
    """A record's attempts, oldest first: when, how it ended, the reply's code and
    text, and the server or provider by name (a platform-tier one as "platform mail
    service" for a tenant); the worker process only for platform operators."""
    operator = caller_tenant == PLATFORM_TENANT_ID
    hidden = _platform_hidden(record, caller_tenant)
    out = []
    for attempt in attempts:
        channel = attempt.channel
        route = PLATFORM_ROUTE[channel] if hidden else attempt.config_name
        item: dict[str, Any] = {
            "number": attempt.number,
            "startedAt": _time(attempt.started_at),
            "finishedAt": _time(attempt.finished_at),
            "durationMs": attempt.duration_ms,
            "outcome": attempt.outcome,
            "ambiguous": bool(attempt.ambiguous),
            "code": attempt.code,
            "message": attempt.message,
            "server" if channel == "mail" else "provider": route,
            "providerMessageId": attempt.provider_message_id,
        }
        if operator:
            item["worker"] = attempt.worker
        out.append(item)
    return out
