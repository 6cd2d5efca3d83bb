"""Every attempt that reached the transport is a row

``send_attempt``: one row per attempt of a mail or SMS record (number, started and finished
times, duration, worker, server or provider, outcome, ambiguity, the reply's code and text,
the provider message id), written by the statement that writes the attempt's outcome.
``attempt_count`` and ``deferral_count`` on both record tables: constant defaults, so no
table rewrite; no index on either (a status change touches no more indexes than before).

Revision ID: r0023
Revises: r0022
Create Date: 2026-12-01 23:05:00

"""
import sqlalchemy as sa
from alembic import op

from portal.models.base import now_default

# revision identifiers, used by Alembic.
revision = 'r0023'
down_revision = 'r0022'
branch_labels = None
depends_on = None

RECORDS = ("mail_send_record", "sms_send_record")


def upgrade():
    bigid = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    now = now_default(op.get_bind().dialect.name)
    op.create_table(
        "send_attempt",
        sa.Column("id", bigid, nullable=False),
        sa.Column("tenant_id", bigid, nullable=False),
        sa.Column("channel", sa.String(8), nullable=False),
        sa.Column("record_id", bigid, nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.Column("duration_ms", sa.Integer(), nullable=True),
        sa.Column("worker", sa.String(200), nullable=True),
        sa.Column("config_id", bigid, nullable=True),
        sa.Column("config_name", sa.String(200), nullable=True),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("ambiguous", sa.Boolean(), nullable=False),
        sa.Column("code", sa.String(100), nullable=True),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("provider_message_id", sa.String(200), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_send_attempt"),
    )
    op.create_index(
        "idx_send_attempt_record", "send_attempt", ["channel", "record_id", "number"]
    )
    # Plain ALTER TABLE ADD COLUMN on both dialects: a batch operation would make SQLite copy
    # the tables, losing their AUTOINCREMENT and callback triggers (migration 0017).
    for table in RECORDS:
        for column in ("attempt_count", "deferral_count"):
            op.add_column(
                table, sa.Column(column, sa.Integer(), nullable=False, server_default=sa.text("0"))
            )


def downgrade():
    for table in RECORDS:
        for column in ("deferral_count", "attempt_count"):
            op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")  # SQLite 3.35+ too
    op.drop_index("idx_send_attempt_record", table_name="send_attempt")
    op.drop_table("send_attempt")
