"""Records as JSON for the API (secrets and frozen bodies stay out of list views)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.messaging.records import diagnosis
from portal.models import (
    Channel,
    MailSendRecord,
    Scope,
    SendAttempt,
    SmsSendRecord,
)
from portal.models.by_channel import PARTS
from portal.tenancy import PLATFORM_TENANT_ID, names_config

# What a tenant sees instead of a platform-tier server's or provider's name.
PLATFORM_ROUTE = {"mail": "platform mail service", "sms": "platform SMS service"}


def config_tiers(session: Session, channel: str, ids: Iterable[int | None]) -> dict[int, int]:
    """The tier (owning tenant id) of each mail server or SMS provider of ``ids`` that exists."""
    wanted = {i for i in ids if i is not None}
    if not wanted:
        return {}
    config = PARTS[Channel(channel)].config
    rows = session.execute(select(config.id, config.tenant_id).where(config.id.in_(wanted)))
    return {config_id: tenant_id for config_id, tenant_id in rows}


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


def _platform_template(record: MailSendRecord | SmsSendRecord, caller_tenant: int) -> bool:
    """A record of the platform scope was rendered from the platform tier's template, whose
    id a tenant never sees (it is null for it)."""
    return record.scope == Scope.PLATFORM.value and caller_tenant != PLATFORM_TENANT_ID


def record_tiers(
    session: Session, channel: str, records: Iterable[MailSendRecord | SmsSendRecord]
) -> dict[int, int]:
    """``config_tiers`` of the servers or providers ``records`` name, in one query."""
    ids: list[int | None] = []
    for record in records:
        if isinstance(record, MailSendRecord):
            ids += [record.server_config_id, record.server_id]
        else:
            ids.append(record.provider_config_id)
    return config_tiers(session, channel, ids)


def _config_id(config_id: int | None, tiers: dict[int, int], caller_tenant: int) -> int | None:
    if config_id is None:
        return None
    shown = names_config(tiers.get(config_id), caller_tenant == PLATFORM_TENANT_ID)
    return config_id if shown else None


def attempt_route(attempt: SendAttempt, tiers: dict[int, int], operator: bool) -> str | None:
    """The name of the server or provider an attempt went through, as the viewer may see it
    (``names_config``); ``tiers``: ``config_tiers`` of at least this attempt's config."""
    if attempt.config_name is None:
        return None
    tier = tiers.get(attempt.config_id) if attempt.config_id is not None else None
    return attempt.config_name if names_config(tier, operator) else PLATFORM_ROUTE[attempt.channel]


def mail_record_json(
    record: MailSendRecord, caller_tenant: int, tiers: dict[int, int]
) -> dict[str, Any]:
    """``tiers``: ``record_tiers`` of at least this record."""
    template_hidden = _platform_template(record, caller_tenant)
    server = record.server_config_id or record.server_id
    return _common(record) | {
        "to": record.to_addrs,
        "cc": record.cc_addrs or [],
        "bcc": record.bcc_addrs or [],
        "subject": record.rendered_subject or record.subject,
        "templateId": None if template_hidden else record.template_id,
        "serverId": _config_id(server, tiers, caller_tenant),
    }


def sms_record_json(
    record: SmsSendRecord, caller_tenant: int, tiers: dict[int, int]
) -> dict[str, Any]:
    """``tiers``: ``record_tiers`` of at least this record."""
    return _common(record) | {
        "phoneNumber": record.phone_number,
        "countryCode": record.country_code,
        "content": record.rendered_content or record.content,
        "providerId": _config_id(record.provider_config_id, tiers, caller_tenant),
    }


def attempts_json(
    session: Session, attempts: list[SendAttempt], caller_tenant: int
) -> list[dict[str, Any]]:
    """A record's attempts, oldest first: when, how it ended, the reply's code and
    text, and the server or provider by name (a platform-tier one as "platform mail
    service" for a tenant, ``names_config``); the worker process only for platform
    operators."""
    operator = caller_tenant == PLATFORM_TENANT_ID
    channel = attempts[0].channel if attempts else "mail"
    tiers = config_tiers(session, channel, [a.config_id for a in attempts])
    out = []
    for attempt in attempts:
        route = attempt_route(attempt, tiers, operator)
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


def diagnosis_json(
    session: Session,
    record: MailSendRecord | SmsSendRecord,
    settings: Settings,
    caller_tenant: int,
) -> dict[str, Any]:
    """``diagnosis`` of one record for its GET: ``{cause, wouldFailAgain: {value, reason,
    why}, action, who}``, the record page's own answer (``messaging.records.diagnosis``), with
    the platform's servers named only to platform callers (``names_config``)."""
    channel = Channel.MAIL if isinstance(record, MailSendRecord) else Channel.SMS
    found = diagnosis.diagnose(
        session, channel, record, settings, operator=caller_tenant == PLATFORM_TENANT_ID
    )
    return {"diagnosis": diagnosis.as_json(found)}
