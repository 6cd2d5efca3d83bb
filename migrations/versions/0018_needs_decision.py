"""Records that need a decision get a partial index of their own

The "Needs a decision" page and the dashboard's count read Uncertain records and not-sent
ones with an unresolved ambiguous attempt. Walking each status's index and filtering on the
ambiguity flag cost as much as the tenant's plain failures (a million Failed rows: seconds).
This partial index holds only the rows that need a decision, so the status changes of the
delivery loop (Sending, Sent, Retry, Failed without an ambiguous attempt) never touch it.
Built CONCURRENTLY on PostgreSQL, so a live table is not locked against writes.

Revision ID: r0018
Revises: r0017
Create Date: 2026-12-01 20:10:00

"""

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision = 'r0018'
down_revision = 'r0017'
branch_labels = None
depends_on = None

PREFIXES = {"mail_send_record": "mail_send", "sms_send_record": "sms_send"}
NEEDS_DECISION = (
    "status = 'Uncertain' OR (ambiguous_attempt AND resolution IS NULL "
    "AND status IN ('Failed', 'DeadLetter', 'Suppressed'))"
)


def upgrade():
    postgres = op.get_bind().dialect.name == "postgresql"
    for table, prefix in PREFIXES.items():
        name = f"idx_{prefix}_needs_decision"
        if postgres:
            with op.get_context().autocommit_block():
                op.create_index(
                    name,
                    table,
                    ["tenant_id", "id"],
                    postgresql_where=sa.text(NEEDS_DECISION),
                    postgresql_concurrently=True,
                )
        else:
            op.create_index(name, table, ["tenant_id", "id"], sqlite_where=sa.text(NEEDS_DECISION))


def downgrade():
    for table, prefix in PREFIXES.items():
        op.drop_index(f"idx_{prefix}_needs_decision", table_name=table)
