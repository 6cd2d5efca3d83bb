"""Records as JSON for the API (secrets and frozen bodies stay out of list views)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from portal.models import MailSendRecord, SmsSendRecord


def _time(value: datetime | None) -> str | None:
    return value.isoformat().replace("+00:00", "Z") if value else None


def _common(record: MailSendRecord | SmsSendRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "status": record.status,
        "scope": record.scope,
        "retryCount": record.retry_count,
        "nextRetryAt": _time(record.next_retry_at),
        "errorCode": record.error_code,
        "errorMessage": record.error_message,
        "traceId": record.trace_id,
        "businessKey": record.business_key,
        "templateCode": record.template_code,
        "providerMessageId": record.provider_message_id,
        "preparedAt": _time(record.prepared_at),
        "sentAt": _time(record.sent_at),
        "expiresAt": _time(record.expires_at),
        "createdTime": _time(record.created_time),
        "updatedTime": _time(record.updated_time),
    }


def mail_record_json(record: MailSendRecord) -> dict[str, Any]:
    return _common(record) | {
        "to": record.to_addrs,
        "cc": record.cc_addrs or [],
        "bcc": record.bcc_addrs or [],
        "subject": record.rendered_subject or record.subject,
        "templateId": record.template_id,
        "serverId": record.server_config_id or record.server_id,
    }


def sms_record_json(record: SmsSendRecord) -> dict[str, Any]:
    return _common(record) | {
        "phoneNumber": record.phone_number,
        "countryCode": record.country_code,
        "content": record.rendered_content or record.content,
        "providerId": record.provider_config_id,
    }
