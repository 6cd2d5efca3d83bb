"""The inbox: notices for tenant admins and platform operators.

A notice belongs to a tier (tenant id, or -1 for platform operators) and carries a
``dedup_key`` unique within it: each occurrence (a quota threshold in a month, a server's
outage that began at a time, an hour's new dead letters) is written once however often it is
seen. ``scan`` looks for the conditions that live in tables (quota, failing servers and
providers as ``health`` reads them, dead letters, records needing a decision, bounce
mailboxes) and runs as a chore, so a send's write never looks for a notice; a callback
endpoint's pause or a dead delivery is told by the callback pool as it happens
(``callback_trouble``).

A notice never causes a notice: nothing here sends mail or writes a record.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Engine, func, or_, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from portal.config import Settings
from portal.messaging.sending import health
from portal.models import (
    CallbackEndpoint,
    DeadLetterMessage,
    MailReceiveConfig,
    MailReceiveState,
    MailSendRecord,
    Notification,
    SmsSendRecord,
    Tenant,
    TenantMessageQuota,
    TenantMessageUsage,
    TriageStatus,
    db_now,
)
from portal.models.by_channel import PARTS
from portal.models.record import NEEDS_DECISION
from portal.tenancy import PLATFORM_TENANT_ID, tenant_context

log = logging.getLogger("portal.notices")

THRESHOLDS = (80, 90, 100)
MAILBOX_FAILING_S = 15 * 60
SCAN_INTERVAL_S = 60


@dataclass(frozen=True)
class Notice:
    tenant_id: int
    kind: str
    key: str
    title: str
    body: str | None = None
    link: str | None = None


def notify(session: Session, notice: Notice) -> bool:
    """Write ``notice`` unless its key is there already, and mail it to the tier's users who
    asked for notices by mail; True when it was new."""
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    result = session.execute(
        insert(Notification)
        .values(
            tenant_id=notice.tenant_id,
            kind=notice.kind,
            dedup_key=notice.key[:200],
            title=notice.title,
            body=notice.body,
            link=notice.link,
        )
        .on_conflict_do_nothing(index_elements=["tenant_id", "dedup_key"])
        .returning(Notification.id)
    )
    notification_id = result.scalar()
    if notification_id is None:
        return False
    _mail(session, notification_id, notice)
    return True


NOTICE_KEY = "notice:"  # the business key prefix of a notice's mails
# Acceptance's limits (body size and the like) for a notice mail: the product's defaults.
_LIMITS = Settings(database_url="", redis_url=None, secret_key="")


def _mail(session: Session, notification_id: int, notice: Notice) -> None:
    """The notice by mail to each user of its tier who asked, as platform-tier sends (so a
    tenant's own server or quota is never used). Their business keys start NOTICE_KEY: the
    scans below never count them, so a notice mail never causes a notice."""
    from portal.messaging.records import acceptance, validation
    from portal.models import AppUser, Role

    roles = (
        [Role.PLATFORM_OPERATOR.value]
        if notice.tenant_id == PLATFORM_TENANT_ID
        else [Role.TENANT_ADMIN.value]
    )
    users = session.execute(
        select(AppUser.id, AppUser.email).where(
            AppUser.tenant_id == notice.tenant_id,
            AppUser.role.in_(roles),
            AppUser.is_active.is_(True),
            AppUser.notices_by_mail.is_(True),
        )
    ).all()
    for user_id, email in users:
        text_body = (notice.body or notice.title) + (
            f"\n\nSee {notice.link} in the portal." if notice.link else ""
        )
        with tenant_context(PLATFORM_TENANT_ID):
            try:
                acceptance.send_mail(
                    session,
                    {
                        "to": [email],
                        "subject": f"Postroom: {notice.title}"[:200],
                        "text": text_body,
                        "scope": "PLATFORM",
                        "businessKey": f"{NOTICE_KEY}{notification_id}:{user_id}",
                    },
                    settings=_LIMITS,
                )
            except validation.AcceptanceError as exc:  # an address we cannot mail: inbox only
                log.warning("notice not mailed: %s", exc.message, extra={"user_id": user_id})


# --- what the scan finds ---------------------------------------------------------------------


def _quota(session: Session, month: str) -> list[Notice]:
    out = []
    rows = session.execute(
        select(
            TenantMessageQuota.tenant_id,
            TenantMessageQuota.mail_monthly_limit,
            TenantMessageQuota.sms_monthly_limit,
            TenantMessageUsage.mail_count,
            TenantMessageUsage.sms_count,
        ).join(
            TenantMessageUsage,
            (TenantMessageUsage.tenant_id == TenantMessageQuota.tenant_id)
            & (TenantMessageUsage.month == month),
        )
    ).all()
    for tenant_id, mail_limit, sms_limit, mail_used, sms_used in rows:
        for channel, limit, used in (("mail", mail_limit, mail_used), ("sms", sms_limit, sms_used)):
            if not limit:
                continue
            share = used * 100 / limit
            for threshold in THRESHOLDS:
                if share >= threshold:
                    out.append(
                        Notice(
                            tenant_id,
                            "quota",
                            f"quota:{channel}:{month}:{threshold}",
                            f"{channel.upper()} quota {threshold} % used this month",
                            f"{used:,} of {limit:,} {channel} messages in {month}."
                            + (" Further sends wait until next month." if threshold == 100 else ""),
                            "/quotas/",
                        )
                    )
    return out


def _incidents(session: Session, window_s: float) -> list[Notice]:
    """A server or provider failing (``health``: its sends cannot reach it, before or after
    its breaker opens), once per incident: keyed on the incident's first failure, which
    stays the same until it answers again. And back up: a notice whose server no longer
    fails."""
    out = []
    tenants = list(session.scalars(select(Tenant.id).where(Tenant.id > 0, Tenant.is_active)))
    failing = health.failing(session, None, window_s=window_s)
    for channel, config, state in failing:
        since = state.since
        if since is None:
            continue
        stamp = since.strftime("%Y%m%dT%H%M%S")
        parts = PARTS[channel]
        noun, link = parts.config_noun, parts.config_pages
        key = f"down:{channel.value}:{config.id}:{stamp}"
        title = f"{noun.capitalize()} {config.name} is failing"
        out.append(Notice(config.tenant_id, "server_down", key, title, state.text, link))
        if config.tenant_id == PLATFORM_TENANT_ID:  # tenants hear of the platform's, unnamed
            service = parts.noun
            for tenant_id in tenants:
                out.append(
                    Notice(
                        tenant_id,
                        "server_down",
                        key,
                        f"The platform's {service} service is degraded",
                        "Sends through it are retried and go out when it answers again.",
                        "/dashboard/",
                    )
                )
    down = {(channel.value, config.id) for channel, config, _state in failing}
    # Back up: every incident's notice whose server no longer fails.
    for tenant_id, key, title in session.execute(
        select(Notification.tenant_id, Notification.dedup_key, Notification.title).where(
            Notification.kind == "server_down"
        )
    ):
        _, kind, config_id, _stamp = key.split(":", 3)
        if (kind, int(config_id)) in down:
            continue
        up_title = (
            title.replace("is failing", "is back up")
            .replace("is down", "is back up")
            .replace("is degraded", "is back to normal")
        )
        out.append(Notice(tenant_id, "server_up", "up" + key[4:], up_title, None, None))
    return out


def _hour(now: datetime) -> tuple[datetime, str]:
    start = now.replace(minute=0, second=0, microsecond=0)
    return start, start.strftime("%Y%m%dT%H")


def _dead_letters(session: Session, now: datetime) -> list[Notice]:
    start, hour = _hour(now)
    out = []
    rows = session.execute(
        select(DeadLetterMessage.tenant_id, DeadLetterMessage.channel, DeadLetterMessage.event_id)
        .where(
            DeadLetterMessage.created_time >= start,
            DeadLetterMessage.status == TriageStatus.PENDING.value,
        )
        .limit(10_000)
    ).all()
    # A notice's own mail giving up never causes a notice: those are platform-tier mails
    # whose business key starts NOTICE_KEY.
    platform_mail = [
        int(e)
        for t, c, e in rows
        if t == PLATFORM_TENANT_ID and c == "mail" and e is not None and e.isdigit()
    ]
    notice_mails = (
        {
            str(i)
            for i in session.scalars(
                select(MailSendRecord.id).where(
                    MailSendRecord.id.in_(platform_mail),
                    MailSendRecord.business_key.startswith(NOTICE_KEY),
                )
            )
        }
        if platform_mail
        else set()
    )
    tiers = sorted(
        {
            t
            for t, c, e in rows
            if not (t == PLATFORM_TENANT_ID and c == "mail" and e in notice_mails)
        }
    )
    for tenant_id in tiers:
        out.append(
            Notice(
                tenant_id,
                "dead_letters",
                f"dead-letters:{hour}",
                "New dead letters this hour",
                f"Records used up their retries since {start:%H:%M} UTC; triage them.",
                "/dead-letters/",
            )
        )
    if tiers and PLATFORM_TENANT_ID not in tiers:
        out.append(
            Notice(
                PLATFORM_TENANT_ID,
                "dead_letters",
                f"dead-letters:{hour}",
                "New dead letters this hour",
                f"Dead letters in {len(tiers)} tier(s) since {start:%H:%M} UTC.",
                "/dead-letters/",
            )
        )
    return out


def _decisions(session: Session, now: datetime) -> list[Notice]:
    start, hour = _hour(now)
    out = []
    seen: set[int] = set()
    for model in (MailSendRecord, SmsSendRecord):
        for (tenant_id,) in session.execute(
            select(model.tenant_id)
            # The partial index of records needing a decision (migration 0018) holds exactly
            # these rows: the scan never reads the plain history.
            .where(
                text(f"({NEEDS_DECISION})"),
                model.updated_time >= start,
                # A notice's own mail never causes a notice.
                or_(model.business_key.is_(None), ~model.business_key.startswith(NOTICE_KEY)),
            )
            .distinct()
        ):
            seen.add(tenant_id)
    for tenant_id in sorted(seen):
        out.append(
            Notice(
                tenant_id,
                "decision",
                f"decisions:{hour}",
                "Records need a decision",
                "An attempt may or may not have gone out: say whether to send again.",
                "/decisions/",
            )
        )
    return out


def _mailboxes(session: Session, now: datetime) -> list[Notice]:
    out = []
    rows = session.execute(
        select(
            MailReceiveConfig.tenant_id,
            MailReceiveConfig.id,
            MailReceiveConfig.name,
            MailReceiveState.last_error_at,
            MailReceiveState.last_error,
        )
        .join(MailReceiveState, MailReceiveState.config_id == MailReceiveConfig.id)
        .where(
            MailReceiveConfig.enabled.is_(True),
            MailReceiveState.last_error.is_not(None),
            MailReceiveState.last_error_at < now - timedelta(seconds=MAILBOX_FAILING_S),
        )
    ).all()
    for tenant_id, config_id, name, since, error in rows:
        out.append(
            Notice(
                tenant_id,
                "mailbox",
                f"mailbox:{config_id}:{since:%Y%m%dT%H%M%S}",
                f"Bounce mailbox {name} cannot be read",
                f"Failing since {since:%Y-%m-%d %H:%M} UTC: {error}"[:1000],
                "/mail-receivers/",
            )
        )
    return out


def scan(engine: Engine, window_s: float = health.HEALTH_WINDOW_S) -> int:
    """Write every notice due now; the number of new ones (``window_s``: what a server's
    health calls recent, ``health_window_s``)."""
    new = 0
    with Session(engine) as session, session.begin():
        now = session.scalar(select(db_now()))
        assert now is not None
        found = [
            *_quota(session, now.strftime("%Y-%m")),
            *_incidents(session, window_s),
            *_dead_letters(session, now),
            *_decisions(session, now),
            *_mailboxes(session, now),
        ]
        for notice in found:
            new += notify(session, notice)
    if new:
        log.info("notices written", extra={"new": new})
    return new


def callback_trouble(
    engine: Engine, endpoint_id: int, delivery_id: int | None, paused: bool
) -> None:
    """A callback endpoint paused, or one of its deliveries dead (grouped per hour)."""
    with Session(engine) as session, session.begin():
        endpoint = session.get(CallbackEndpoint, endpoint_id)
        if endpoint is None:
            return
        now = session.scalar(select(db_now()))
        assert now is not None
        link = f"/callbacks/{endpoint.id}"
        if paused:
            notice = Notice(
                endpoint.tenant_id,
                "callback_paused",
                f"callback-paused:{endpoint.id}:{now:%Y%m%dT%H%M%S}",
                f"Callback endpoint {endpoint.name} paused",
                "20 deliveries in a row failed; it is tried again in 5 minutes.",
                link,
            )
        else:
            _, hour = _hour(now)
            notice = Notice(
                endpoint.tenant_id,
                "callback_dead",
                f"callback-dead:{endpoint.id}:{hour}",
                f"Callbacks to {endpoint.name} given up",
                "Deliveries were retried for 24 hours without a 2xx answer; resend them "
                "from the delivery log once the endpoint works.",
                link,
            )
        notify(session, notice)


# --- reading ----------------------------------------------------------------------------------


def unread_count(session: Session, tenant_id: int, user_id: int) -> int:
    from portal.models import NotificationRead

    return int(
        session.scalar(
            select(func.count())
            .select_from(Notification)
            .where(
                Notification.tenant_id == tenant_id,
                ~select(NotificationRead.notification_id)
                .where(
                    NotificationRead.notification_id == Notification.id,
                    NotificationRead.user_id == user_id,
                )
                .exists(),
            )
        )
        or 0
    )
