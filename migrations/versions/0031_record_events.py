"""A record's events that no attempt row or delivery event holds

``record_event``: a failure before any attempt with its cause, the first deferral of a
stretch, a person's retry, cancel, resolution or resend, the recipient suppressed, an end
without a send, a sweep of an unprepared record; one row each, written by the transaction
that changes the record. ``idx_record_event_record`` (channel, record_id, id): the record
page reads one record's rows along it. A successful send writes no row here.

Revision ID: r0031
Revises: r0030
Create Date: 2026-12-04 12:00:00

"""

import sqlalchemy as sa
from alembic import op

from portal.models.base import now_default

# revision identifiers, used by Alembic.
revision = "r0031"
down_revision = "r0030"
branch_labels = None
depends_on = None


def upgrade():
    bigid = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    op.create_table(
        "record_event",
        sa.Column("id", bigid, nullable=False),
        sa.Column("tenant_id", bigid, nullable=False),
        sa.Column("channel", sa.String(8), nullable=False),
        sa.Column("record_id", bigid, nullable=False),
        sa.Column(
            "at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=now_default(op.get_bind().dialect.name),
        ),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("code", sa.String(100), nullable=True),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("actor", sa.String(400), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_record_event"),
    )
    op.create_index("idx_record_event_record", "record_event", ["channel", "record_id", "id"])


def downgrade():
    op.drop_index("idx_record_event_record", table_name="record_event")
    op.drop_table("record_event")
