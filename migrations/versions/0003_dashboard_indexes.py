"""Dashboard indexes: per-tenant status counts and the last 24 hours, without table scans

Revision ID: r0003
Revises: r0002
Create Date: 2026-11-30 10:30:00

"""
from alembic import op

# revision identifiers, used by Alembic.
revision = 'r0003'
down_revision = 'r0002'
branch_labels = None
depends_on = None

INDEXES = [
    ("mail_send_record", "idx_mail_send_tenant_status", ["tenant_id", "status", "id"]),
    ("mail_send_record", "idx_mail_send_created", ["created_time"]),
    ("sms_send_record", "idx_sms_send_tenant_status", ["tenant_id", "status", "id"]),
    ("sms_send_record", "idx_sms_send_created", ["created_time"]),
]


def upgrade():
    for table, name, columns in INDEXES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.create_index(name, columns, unique=False)


def downgrade():
    for table, name, _ in reversed(INDEXES):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_index(name)
