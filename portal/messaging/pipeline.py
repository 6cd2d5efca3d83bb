"""One attempt of one claimed record: prepare on the first attempt, send, record the outcome.

Runs in the record's tenant context under the trace id stored at acceptance. Each database
write is its own short transaction; the send itself holds no connection.
"""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass, field

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.messaging import outcomes
from portal.messaging.backoff import BackoffPolicy
from portal.messaging.outcomes import Claimed
from portal.messaging.preparation import PreparationFailed, PreparedMail, prepare_mail
from portal.messaging.transports.smtp import (
    Attachment,
    OutgoingMail,
    Security,
    SmtpConnectionPool,
    SmtpSendError,
    SmtpServer,
)
from portal.metrics import SEND_DURATION
from portal.models import Channel, MailSendRecord, MailSendServerConfig
from portal.models.secretbox import SecretUnavailable
from portal.tenancy import tenant_context

log = logging.getLogger("portal.delivery")


@dataclass
class MailContext:
    """What a mail worker keeps between records: its SMTP connections and the policy."""

    engine: Engine
    settings: Settings
    policy: BackoffPolicy
    pool: SmtpConnectionPool = field(default_factory=SmtpConnectionPool)

    def close(self) -> None:
        """QUIT every open SMTP connection (the worker is stopping)."""
        self.pool.close_all()


def _frozen(record: MailSendRecord) -> PreparedMail:
    """What an earlier attempt prepared; retries replay it as it is."""
    assert record.server_config_id is not None
    assert record.message_id_header is not None
    return PreparedMail(
        subject=record.rendered_subject or "",
        html=record.rendered_html,
        text=record.rendered_text,
        reply_to=record.final_reply_to,
        priority=record.final_priority,
        attachments=record.final_attachments,
        server_id=record.server_config_id,
        server_name="",
        read_receipt=record.read_receipt,
        message_id=record.message_id_header,
    )


def _server(config: MailSendServerConfig, settings: Settings) -> SmtpServer:
    return SmtpServer(
        key=f"{config.id}:{config.config_version}",
        host=config.host,
        port=config.port,
        security=Security(config.security),
        username=config.username,
        password=config.password,
        connect_timeout_s=settings.smtp_connect_timeout_s,
        read_timeout_s=settings.smtp_read_timeout_s,
        verify_tls=config.verify_tls,
    )


def _outgoing(
    record: MailSendRecord, prepared: PreparedMail, config: MailSendServerConfig
) -> OutgoingMail:
    from_addr = config.from_address or config.username or ""
    return OutgoingMail(
        message_id=prepared.message_id,
        from_addr=from_addr,
        from_name=config.from_name,
        to=list(record.to_addrs),
        cc=list(record.cc_addrs or []),
        bcc=list(record.bcc_addrs or []),
        reply_to=prepared.reply_to,
        subject=prepared.subject,
        html=prepared.html,
        text=prepared.text,
        attachments=[
            Attachment(
                a["name"],
                a.get("contentType") or "application/octet-stream",
                base64.b64decode(a["content"]),
            )
            for a in prepared.attachments or []
        ],
        priority=prepared.priority,
        read_receipt_to=from_addr if prepared.read_receipt else None,
        extra_headers={"X-Postroom-Record": str(record.id)},
    )


def process_mail(ctx: MailContext, record: MailSendRecord) -> None:
    """One attempt for a claimed mail record (status Sending, version as claimed)."""
    claimed = Claimed(
        channel=Channel.MAIL,
        id=record.id,
        version=record.version,
        tenant_id=record.tenant_id,
        retry_count=record.retry_count,
    )
    with tenant_context(record.tenant_id, record.trace_id):
        try:
            _attempt(ctx, record, claimed)
        except Exception as exc:  # an unexpected error must not kill the worker
            log.exception("unexpected error while delivering", extra={"record_id": record.id})
            outcomes.handle_failure(
                ctx.engine, claimed, type(exc).__name__, str(exc), policy=ctx.policy
            )


def _attempt(ctx: MailContext, record: MailSendRecord, claimed: Claimed) -> None:
    if record.prepared_at is None:
        try:
            result = prepare_mail(ctx.engine, record, claimed, ctx.settings)
        except PreparationFailed as failure:
            outcomes.handle_failure(
                ctx.engine, claimed, failure.code.value, failure.message, policy=ctx.policy
            )
            return
        if result is None:
            return  # lost a version race: someone else moved the record on
        prepared, claimed = result
    else:
        prepared = _frozen(record)
    with Session(ctx.engine) as session:
        config = session.scalar(
            select(MailSendServerConfig).where(MailSendServerConfig.id == prepared.server_id)
        )
        try:
            server = _server(config, ctx.settings) if config is not None else None
        except SecretUnavailable as exc:
            server = None
            problem = str(exc)
        else:
            problem = "the mail server this record was prepared for no longer exists"
    if config is None or server is None:
        outcomes.handle_failure(
            ctx.engine, claimed, "CONFIG_NOT_RESOLVABLE", problem, policy=ctx.policy
        )
        return
    claimed = Claimed(
        channel=claimed.channel,
        id=claimed.id,
        version=claimed.version,
        tenant_id=claimed.tenant_id,
        retry_count=claimed.retry_count,
        provider=config.name,
    )
    mail = _outgoing(record, prepared, config)
    started = time.perf_counter()
    try:
        sent = ctx.pool.send(server, mail)
    except SmtpSendError as error:
        SEND_DURATION.labels("mail").observe(time.perf_counter() - started)
        outcomes.handle_failure(
            ctx.engine,
            claimed,
            error.code,
            error.message,
            policy=ctx.policy,
            ambiguous=error.after_data,
        )
        return
    SEND_DURATION.labels("mail").observe(time.perf_counter() - started)
    refused = {k: list(v) for k, v in sent.refused.items()} or None
    outcomes.record_sent(ctx.engine, claimed, prepared.message_id, refused=refused)
