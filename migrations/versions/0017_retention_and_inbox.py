"""Retention per tenant, record ids never reused on SQLite, and the notifications inbox

- ``tenant.mail_retention_days`` / ``sms_retention_days``: NULL keeps records forever (the
  platform default RETENTION_DAYS_DEFAULT applies then); at least 2 days.
- SQLite hands out max(id)+1 without AUTOINCREMENT, so after a purge of the newest records an
  id would come back; Message-IDs and idempotency keys are built from ids. The record tables
  (and their recipients) are rebuilt with AUTOINCREMENT, the sequence starting past today's
  largest id; the callback triggers of 0015 go with the old table and are made again.
  PostgreSQL's sequences never go back: nothing to do there.
- ``idx_received_mail_record``: retention deletes a record's bounce mails with it.
- ``notification`` (one row per occurrence, deduplicated by key within a tier) and
  ``notification_read`` (who has read it).

Revision ID: r0017
Revises: r0016
Create Date: 2026-12-01 20:00:00

"""
import importlib.util
from pathlib import Path

import sqlalchemy as sa
from alembic import op

from portal.models.base import now_default

# revision identifiers, used by Alembic.
revision = 'r0017'
down_revision = 'r0016'
branch_labels = None
depends_on = None

RECORD_TABLES = ("mail_send_record", "sms_send_record")
BIG = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _callbacks_migration():
    path = Path(__file__).with_name("0015_status_callbacks.py")
    spec = importlib.util.spec_from_file_location("migration_0015", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sqlite_autoincrement(on: bool) -> None:
    callbacks = _callbacks_migration()
    for table in RECORD_TABLES:
        op.execute(f"DROP TRIGGER IF EXISTS {table}_callback_change")
        op.execute(f"DROP TRIGGER IF EXISTS {table}_callback_insert")
    for table in (*RECORD_TABLES, "mail_send_recipient"):
        with op.batch_alter_table(
            table, recreate="always", table_kwargs={"sqlite_autoincrement": on}
        ):
            pass
    for channel, table in callbacks.RECORDS.items():
        for sql in callbacks._sqlite_triggers(channel, table):
            op.execute(sql)


def upgrade():
    bind = op.get_bind()
    now = now_default(bind.dialect.name)
    with op.batch_alter_table("tenant") as batch:
        batch.add_column(sa.Column("mail_retention_days", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("sms_retention_days", sa.Integer(), nullable=True))
    op.create_table(
        "notification",
        sa.Column("id", BIG, nullable=False),
        sa.Column("tenant_id", BIG, nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("dedup_key", sa.String(length=200), nullable=False),
        sa.Column("title", sa.Text(), nullable=False),
        sa.Column("body", sa.Text(), nullable=True),
        sa.Column("link", sa.Text(), nullable=True),
        sa.Column("created_time", sa.DateTime(timezone=True), server_default=now, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_notification")),
        sa.UniqueConstraint("tenant_id", "dedup_key", name="uq_notification_key"),
    )
    op.create_index("idx_notification_tenant", "notification", ["tenant_id", "id"])
    # Retention deletes a record's bounce mails with it: find them by index.
    op.create_index("idx_received_mail_record", "received_mail", ["record_id"])
    op.create_table(
        "notification_read",
        sa.Column("notification_id", BIG, nullable=False),
        sa.Column("user_id", BIG, nullable=False),
        sa.Column("read_at", sa.DateTime(timezone=True), server_default=now, nullable=False),
        sa.ForeignKeyConstraint(
            ["notification_id"],
            ["notification.id"],
            name=op.f("fk_notification_read_notification_id_notification"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["user_id"],
            ["app_user.id"],
            name=op.f("fk_notification_read_user_id_app_user"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("notification_id", "user_id", name=op.f("pk_notification_read")),
    )
    if bind.dialect.name == "sqlite":
        _sqlite_autoincrement(True)


def downgrade():
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        _sqlite_autoincrement(False)
    op.drop_index("idx_received_mail_record", table_name="received_mail")
    op.drop_table("notification_read")
    op.drop_index("idx_notification_tenant", table_name="notification")
    op.drop_table("notification")
    with op.batch_alter_table("tenant") as batch:
        batch.drop_column("sms_retention_days")
        batch.drop_column("mail_retention_days")
