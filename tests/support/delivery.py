"""Helpers for delivery tests: a mail setup on a scripted SMTP server, and a synchronous
drain that claims and processes due records in the test thread (the same code the worker
threads run), so tests need no sleeping beyond the short settings' due times."""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from flask import Flask
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.delivery.pool import ChannelPool
from portal.extensions import db
from portal.messaging.records import acceptance
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.claim import claim_due
from portal.messaging.sending.pipeline import MailContext, process_mail
from portal.models import (
    MailSendRecord,
    MailSendServerConfig,
    SendStatus,
    SmsProviderConfig,
    Tenant,
)
from portal.tenancy import tenant_context
from tests.support.smtp_server import ScriptedSmtpServer


def mail_server(
    tenant_id: int, smtp: ScriptedSmtpServer, name: str = "smtp", **fields: Any
) -> MailSendServerConfig:
    values: dict[str, Any] = {
        "tenant_id": tenant_id,
        "name": name,
        "host": smtp.host,
        "port": smtp.port,
        "security": "plain",
        "from_address": f"sender@{name}.test",
        "from_name": "Sender",
        "is_default": True,
    } | fields
    server = MailSendServerConfig(**values)
    db.session.add(server)
    db.session.flush()
    return server


def tenant(slug: str) -> Tenant:
    row = Tenant(slug=slug, name=slug.title())
    db.session.add(row)
    db.session.flush()
    return row


def accept_mail(app: Flask, tenant_id: int | None, **body: Any) -> int:
    request = {"to": ["ann@example.com"], "subject": "Hello", "text": "Hi Ann"} | body
    with tenant_context(tenant_id):
        result = acceptance.send_mail(db.session, request, settings=app.config["SETTINGS"])
    db.session.commit()
    return result.id


def drain(
    app: Flask,
    *,
    until: Callable[[], bool] | None = None,
    timeout_s: float = 10.0,
    policy: BackoffPolicy | None = None,
    stop_when: Callable[[], bool] | None = None,
) -> int:
    """Claim and process due mail in this thread until nothing is due (or, once idle,
    ``until`` holds); ``stop_when`` is checked before every claim, for an exact stop."""
    settings: Settings = app.config["SETTINGS"]
    ctx = MailContext(
        engine=db.engine,
        settings=settings,
        policy=policy or BackoffPolicy.from_settings(settings),
    )
    processed = 0
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            # Before every claim: with millisecond back-offs a record is due again at once,
            # and one claim too many would overshoot the state the test waits for.
            if stop_when is not None and stop_when():
                return processed
            claimed = claim_due(db.engine, MailSendRecord, 1)  # what a pool worker runs
            if claimed:
                process_mail(ctx, claimed[0])
                processed += 1
                continue
            if until is None:
                if not _waiting_retry():
                    return processed
            elif until():
                return processed
            time.sleep(0.02)
    finally:
        ctx.pool.close_all()
    raise AssertionError(f"drain timed out after {timeout_s}s ({processed} processed)")


def _waiting_retry() -> bool:
    with Session(db.engine) as session:
        return (
            session.scalar(
                select(MailSendRecord.id)
                .where(MailSendRecord.status == SendStatus.RETRY.value)
                .limit(1)
            )
            is not None
        )


def record(record_id: int) -> MailSendRecord:
    db.session.expire_all()
    row = db.session.get(MailSendRecord, record_id)
    assert row is not None
    return row


def sendable(tenant_id: int) -> None:
    """A default mail server and a default SMS provider in the tier (nothing listens on them),
    so that its records can be prepared: a retry's diagnosis runs preparation's own choice
    and names a tier without either (NO_ROUTE)."""
    db.session.add(
        MailSendServerConfig(
            tenant_id=tenant_id,
            name="default",
            host="127.0.0.1",
            port=25,
            security="plain",
            from_address="sender@default.test",
            is_default=True,
        )
    )
    db.session.add(
        SmsProviderConfig(tenant_id=tenant_id, name="default", provider="twilio", is_default=True)
    )
    db.session.commit()


def waiting_on_a_lock(like: str = "%", unlike: str | None = None) -> list[int]:
    """The backends of the test database whose statement (``like``, an SQL LIKE pattern; not
    containing ``unlike``) waits for a lock (PostgreSQL)."""
    with db.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT pid, query FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database() AND query LIKE :like "
                "AND pid <> pg_backend_pid()"
            ),
            {"like": like},
        ).all()
    return [pid for pid, query in rows if unlike is None or unlike not in query]


def unfinished(pool: ChannelPool, timeout_s: float) -> str:
    """Wait up to ``timeout_s`` for a stopped pool's threads: "" once all have ended, else
    where each live thread was halfway through the wait and at its end (their stacks), and
    the engine's connection pool, for the failure's message."""
    seen = ""
    for part in ("halfway", "at the end"):
        if pool.join(time.monotonic() + timeout_s / 2):
            return ""
        frames = sys._current_frames()
        seen += "".join(
            f"--- {thread.name} still running {part}:\n"
            + "".join(traceback.format_stack(frames[thread.ident]))
            for thread in pool._threads
            if thread.is_alive() and thread.ident in frames
        )
    return f"{seen}--- connections: {pool.engine.pool.status()}"
