"""What every send record has, whatever its channel: the queue columns and the outcome."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, ClassVar

from sqlalchemy import JSON, Boolean, Index, Integer, String, Text, text
from sqlalchemy.orm import Mapped, mapped_column

from portal.models.base import BigId, UTCDateTime, db_now
from portal.models.enums import Channel, Scope, SendStatus


class Stream(StrEnum):
    """A record's message stream: transactional work is claimed first, and
    broadcast never takes every worker of a pool while transactional work is due."""

    TRANSACTIONAL = "transactional"
    BROADCAST = "broadcast"


STREAM_DEFAULT = "'transactional'"  # the server default of every ``stream`` column

# Vacuum the queue tables after a fixed number of changes, whatever their size, cleaning the
# indexes each time: the Pending scan then stays flat after heavy churn (migration 0004).
SCAN_TABLE_STORAGE = {
    "vacuum_index_cleanup": "on",
    "autovacuum_vacuum_scale_factor": 0,
    "autovacuum_vacuum_threshold": 5000,
    "autovacuum_vacuum_insert_scale_factor": 0,
    "autovacuum_vacuum_insert_threshold": 20000,
    "autovacuum_analyze_scale_factor": 0,
    "autovacuum_analyze_threshold": 20000,
    "autovacuum_vacuum_cost_delay": 0,
}


# The fair claim's indexes (migration 0012). Partial, so a status change out of Pending or
# Retry adds no entry to either (only acceptance and a move to Retry do), and each stays as
# small as its backlog. Pending per stream and tenant: the claim walks the tenants with due
# work and takes each one's oldest. Retry per stream by due time (a partial index, so a
# claim of one stream never reads through the other's due retries).
# Records a person must decide about (the "Needs a decision" page and the dashboard count):
# Uncertain, or not sent with an unresolved ambiguous attempt. Partial, so only those rows
# have entries: the delivery loop's status changes of every other record never touch it, and
# the list and count read only the rows they show, however many plain failures a tenant has.
NEEDS_DECISION = (
    "status = 'Uncertain' OR (ambiguous_attempt AND resolution IS NULL "
    "AND status IN ('Failed', 'DeadLetter', 'Suppressed'))"
)


def decision_index(prefix: str) -> Index:
    """``idx_<prefix>_needs_decision`` (partial, ``NEEDS_DECISION``)."""
    return Index(
        f"idx_{prefix}_needs_decision",
        "tenant_id",
        "id",
        postgresql_where=text(NEEDS_DECISION),
        sqlite_where=text(NEEDS_DECISION),
    )


def fair_indexes(prefix: str) -> tuple[Index, Index, Index]:
    """``idx_<prefix>_pending_fair``, ``idx_<prefix>_retry_due`` and
    ``idx_<prefix>_retry_fair`` (all partial)."""
    return (
        Index(
            f"idx_{prefix}_pending_fair",
            "stream",
            "tenant_id",
            "updated_time",
            postgresql_where=text("status = 'Pending'"),
            sqlite_where=text("status = 'Pending'"),
        ),
        Index(
            f"idx_{prefix}_retry_due",
            "stream",
            "next_retry_at",
            postgresql_where=text("status = 'Retry'"),
            sqlite_where=text("status = 'Retry'"),
        ),
        # Retry per stream, tenant and due time: the one-record claim walks the tenants with
        # retries in turn, reading each one's earliest (migration 0019).
        Index(
            f"idx_{prefix}_retry_fair",
            "stream",
            "tenant_id",
            "next_retry_at",
            postgresql_where=text("status = 'Retry'"),
            sqlite_where=text("status = 'Retry'"),
        ),
    )


class SendRecordMixin:
    """Columns shared by mail_send_record and sms_send_record.

    The record is the queue: ``status``/``version``/``next_retry_at`` are what the delivery loop
    scans and claims by; the rest is the caller's request, what preparation froze, and what
    happened after. Each channel's record declares its ``channel``.
    """

    channel: ClassVar[Channel]

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(BigId)
    scope: Mapped[str] = mapped_column(String(16), default=Scope.TENANT.value)
    status: Mapped[str] = mapped_column(String(16), default=SendStatus.PENDING.value)
    stream: Mapped[str] = mapped_column(
        String(16), default=Stream.TRANSACTIONAL.value, server_default=text(STREAM_DEFAULT)
    )
    version: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    retry_count: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    # Attempts that reached the transport (each a ``send_attempt`` row) and deferrals that
    # did not (a rate limit, an open breaker, a full route: no row).
    attempt_count: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    deferral_count: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    next_retry_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The server or provider whose open breaker the record waits for (SERVER_UNAVAILABLE), set
    # when it starts waiting: its close makes the record due (breaker.release; migration 0029).
    waiting_config_id: Mapped[int | None] = mapped_column(BigId)
    error_code: Mapped[str | None] = mapped_column(String(100))
    error_message: Mapped[str | None] = mapped_column(Text)
    trace_id: Mapped[str | None] = mapped_column(String(64))
    business_key: Mapped[str | None] = mapped_column(String(200))
    request_hash: Mapped[str | None] = mapped_column(String(64))
    # The caller's request.
    template_id: Mapped[int | None] = mapped_column(BigId)
    template_code: Mapped[str | None] = mapped_column(String(100))
    variables: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # The caller's own key/values (acceptance ``metadata``), returned on GET and in callbacks.
    request_metadata: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    # A test send from the template editor: charged like any send, shown apart.
    is_test: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    # A test send renders the version its editor previewed, even if a later one was saved since.
    pinned_template_version: Mapped[int | None] = mapped_column(Integer)
    # Preparation and delivery. ``template_version``: the template version it was prepared with.
    template_version: Mapped[int | None] = mapped_column(Integer)
    prepared_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    first_claimed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    sent_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    provider_message_id: Mapped[str | None] = mapped_column(String(200))
    # After the send: ambiguity (seed 002) and delivery outcome from receipts and events.
    ambiguous_attempt: Mapped[bool] = mapped_column(
        Boolean, default=False, server_default=text("false")
    )
    ambiguous_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    ambiguous_reason: Mapped[str | None] = mapped_column(Text)
    delivery_outcome: Mapped[str | None] = mapped_column(String(16))
    delivery_outcome_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # An operator's resolution of an Uncertain record (seed 002): accepted | failed.
    resolution: Mapped[str | None] = mapped_column(String(16))
    resolution_reason: Mapped[str | None] = mapped_column(Text)
    resolved_by: Mapped[str | None] = mapped_column(String(320))
    resolved_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    created_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
    updated_time: Mapped[datetime] = mapped_column(UTCDateTime, server_default=db_now())
