"""Recipient tokens go with their recipient's last record, so retention removes them

``recipient_token`` holds a recipient's address in clear. Retention deleted the records and
left the token rows behind; now each purge batch deletes the tokens of the addresses it took
the last record of (portal.messaging.records.retention). It finds them by address:
``idx_recipient_token_address (tenant_id, channel, address)`` on the token table (insert-only;
the record tables get nothing). Built CONCURRENTLY on PostgreSQL.

The tokens already left behind by earlier purges (an address of a tenant with no record of that
channel any more) are deleted here once.

Revision ID: r0026
Revises: r0025
Create Date: 2026-12-02 05:20:00

"""
from alembic import op

# revision identifiers, used by Alembic.
revision = 'r0026'
down_revision = 'r0025'
branch_labels = None
depends_on = None

COLUMNS = ["tenant_id", "channel", "address"]

ORPHANS = """
DELETE FROM recipient_token
WHERE (channel = 'mail' AND NOT EXISTS (
          SELECT 1 FROM mail_send_recipient r
          WHERE r.tenant_id = recipient_token.tenant_id
            AND r.address = recipient_token.address))
   OR (channel = 'sms' AND NOT EXISTS (
          SELECT 1 FROM sms_send_record s
          WHERE s.tenant_id = recipient_token.tenant_id
            AND s.phone_number = recipient_token.address))
"""


def upgrade():
    op.execute(ORPHANS)
    if op.get_bind().dialect.name == "postgresql":
        with op.get_context().autocommit_block():
            op.create_index(
                "idx_recipient_token_address",
                "recipient_token",
                COLUMNS,
                postgresql_concurrently=True,
            )
    else:
        op.create_index("idx_recipient_token_address", "recipient_token", COLUMNS)


def downgrade():
    op.drop_index("idx_recipient_token_address", table_name="recipient_token")
