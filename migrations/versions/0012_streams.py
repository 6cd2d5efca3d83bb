"""Message streams: transactional and broadcast

Every send record and template gets a ``stream`` (``transactional`` unless said otherwise; a
column with a constant default is only a catalogue change on PostgreSQL, the rows are not
rewritten). The fair claim walks two partial indexes: Pending per stream, tenant and age
(``idx_*_send_pending_fair``) and Retry per stream and due time (``idx_*_send_retry_due``).
A record leaving Pending or Retry adds no entry to either, so the status changes of the
delivery loop (Sending, Sent, Failed) touch no more indexes than before.

Revision ID: r0012
Revises: r0011
Create Date: 2026-12-01 18:30:00

"""
import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision = 'r0012'
down_revision = 'r0011'
branch_labels = None
depends_on = None

RECORDS = {"mail_send_record": "mail_send", "sms_send_record": "sms_send"}
TEMPLATES = ("mail_template", "sms_template")


def _stream() -> sa.Column:
    return sa.Column(
        "stream", sa.String(16), nullable=False, server_default=sa.text("'transactional'")
    )


def upgrade():
    for table in (*RECORDS, *TEMPLATES):
        with op.batch_alter_table(table) as batch:
            batch.add_column(_stream())
    for table, prefix in RECORDS.items():
        for name, columns, status in (
            (f"idx_{prefix}_pending_fair", ["stream", "tenant_id", "updated_time"], "Pending"),
            (f"idx_{prefix}_retry_due", ["stream", "next_retry_at"], "Retry"),
        ):
            where = sa.text(f"status = '{status}'")
            op.create_index(name, table, columns, postgresql_where=where, sqlite_where=where)


def downgrade():
    for table, prefix in RECORDS.items():
        op.drop_index(f"idx_{prefix}_retry_due", table_name=table)
        op.drop_index(f"idx_{prefix}_pending_fair", table_name=table)
    for table in (*RECORDS, *TEMPLATES):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("stream")
