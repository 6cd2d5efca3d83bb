"""The audit log: who did what, to which row, written in the transaction of the action."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlalchemy import ForeignKey, Index, String, Text
from sqlalchemy.orm import Mapped, Session, mapped_column

from portal.models.base import Base, BigId, UTCDateTime, db_now


class AuditAction(StrEnum):
    """Every action the audit log records (stored as these strings)."""

    SIGN_IN = "sign_in"
    SIGN_IN_FAILED = "sign_in_failed"
    SIGN_OUT = "sign_out"
    KEY_CREATE = "key_create"
    KEY_REVOKE = "key_revoke"
    USER_INVITE = "user_invite"
    USER_ROLE_CHANGE = "user_role_change"
    USER_DEACTIVATE = "user_deactivate"
    USER_ACTIVATE = "user_activate"
    PASSWORD_CHANGE = "password_change"
    PASSWORD_SET = "password_set"
    CONFIG_CREATE = "config_create"
    CONFIG_UPDATE = "config_update"
    CONFIG_DELETE = "config_delete"
    TEMPLATE_SAVE = "template_save"
    RETRY = "retry"
    BULK_RETRY = "bulk_retry"
    CANCEL = "cancel"
    BULK_CANCEL = "bulk_cancel"
    RESOLVE = "resolve"
    DEAD_LETTER_TRIAGE = "dead_letter_triage"
    QUOTA_CHANGE = "quota_change"
    RETENTION_CHANGE = "retention_change"
    RECIPIENT_FORGET = "recipient_forget"


AUDIT_ACTION_TEXT: dict[AuditAction, str] = {
    AuditAction.SIGN_IN: "Signed in",
    AuditAction.SIGN_IN_FAILED: "Failed sign-in",
    AuditAction.SIGN_OUT: "Signed out",
    AuditAction.KEY_CREATE: "API key created",
    AuditAction.KEY_REVOKE: "API key revoked",
    AuditAction.USER_INVITE: "User invited",
    AuditAction.USER_ROLE_CHANGE: "User's role changed",
    AuditAction.USER_DEACTIVATE: "User deactivated",
    AuditAction.USER_ACTIVATE: "User reactivated",
    AuditAction.PASSWORD_CHANGE: "Password changed",
    AuditAction.PASSWORD_SET: "Password set from an invitation",
    AuditAction.CONFIG_CREATE: "Configuration created",
    AuditAction.CONFIG_UPDATE: "Configuration changed",
    AuditAction.CONFIG_DELETE: "Configuration deleted",
    AuditAction.TEMPLATE_SAVE: "Template saved",
    AuditAction.RETRY: "Record retried",
    AuditAction.BULK_RETRY: "Records retried in bulk",
    AuditAction.CANCEL: "Record cancelled",
    AuditAction.BULK_CANCEL: "Records cancelled in bulk",
    AuditAction.RESOLVE: "Uncertain record resolved",
    AuditAction.DEAD_LETTER_TRIAGE: "Dead letter triaged",
    AuditAction.QUOTA_CHANGE: "Quota changed",
    AuditAction.RETENTION_CHANGE: "Retention changed",
    AuditAction.RECIPIENT_FORGET: "Recipient forgotten (erasure)",
}


class AuditEvent(Base):
    """One audited action. ``tenant_id`` is the tenant whose data it touched (-1: the platform
    tier; NULL: none, as for a failed sign-in with an unknown address)."""

    __tablename__ = "audit_event"
    __table_args__ = (
        Index("idx_audit_event_tenant_time", "tenant_id", "created_time"),
        Index("idx_audit_event_time", "created_time"),
        # A record's timeline: the rows that name it (or its dead letter) as their target.
        Index("idx_audit_event_target", "target_type", "target_id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int | None] = mapped_column(BigId)
    actor_user_id: Mapped[int | None] = mapped_column(
        ForeignKey("app_user.id", ondelete="SET NULL")
    )
    actor_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_key.id", ondelete="SET NULL"))
    # The actor as shown (an email address, "API key 'name'"), kept if the row goes.
    actor_label: Mapped[str] = mapped_column(String(400), default="")
    action: Mapped[str] = mapped_column(String(64))
    target_type: Mapped[str | None] = mapped_column(String(64))
    target_id: Mapped[str | None] = mapped_column(String(64))
    remark: Mapped[str] = mapped_column(Text, default="")
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())


def add_audit(
    session: Session,
    action: AuditAction,
    *,
    tenant_id: int | None,
    actor_user_id: int | None = None,
    actor_key_id: int | None = None,
    actor_label: str = "",
    target_type: str | None = None,
    target_id: object = None,
    remark: str = "",
) -> AuditEvent:
    """Add an audit row to ``session``: it commits (or rolls back) with the action."""
    event = AuditEvent(
        tenant_id=tenant_id,
        actor_user_id=actor_user_id,
        actor_key_id=actor_key_id,
        actor_label=actor_label[:400],
        action=str(action),
        target_type=target_type,
        target_id=None if target_id is None else str(target_id)[:64],
        remark=remark[:4000],
    )
    session.add(event)
    return event


class LoginThrottle(Base):
    """Sign-in attempts per key (address, or address and client) in the current window; the
    database's count when Redis cannot be reached."""

    __tablename__ = "login_throttle"

    key: Mapped[str] = mapped_column(String(400), primary_key=True)
    attempts: Mapped[int] = mapped_column(default=0)
    window_start: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
