"""Due Retry records take the tenants' turn too

The one-record claim (every busy worker's next one) walks the tenants with Retry records after
the last claim's tenant along this partial index, one probe per tenant reading its earliest
retry, and takes the first tenant's oldest due one, so one tenant's old retry backlog (a server
back after an outage) no longer keeps another tenant's retries waiting behind it. Partial: a
record gets an entry only when it moves to Retry, as with idx_*_retry_due. Built CONCURRENTLY
on PostgreSQL.

Revision ID: r0019
Revises: r0018
Create Date: 2026-12-01 20:40:00

"""

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision = 'r0019'
down_revision = 'r0018'
branch_labels = None
depends_on = None

PREFIXES = {"mail_send_record": "mail_send", "sms_send_record": "sms_send"}
COLUMNS = ["stream", "tenant_id", "next_retry_at"]
WHERE = "status = 'Retry'"


def upgrade():
    postgres = op.get_bind().dialect.name == "postgresql"
    for table, prefix in PREFIXES.items():
        name = f"idx_{prefix}_retry_fair"
        if postgres:
            with op.get_context().autocommit_block():
                op.create_index(
                    name,
                    table,
                    COLUMNS,
                    postgresql_where=sa.text(WHERE),
                    postgresql_concurrently=True,
                )
        else:
            op.create_index(name, table, COLUMNS, sqlite_where=sa.text(WHERE))


def downgrade():
    for table, prefix in PREFIXES.items():
        op.drop_index(f"idx_{prefix}_retry_fair", table_name=table)
