"""A test send renders the template version its editor previewed

``pinned_template_version`` on both record tables: set only on a test send from the editor, to
the version the preview rendered; preparation renders that version's content even when a later
one was saved in between. Null for every other record (nullable, no default: no table rewrite).

Revision ID: r0021
Revises: r0020
Create Date: 2026-12-01 22:40:00

"""
import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision = 'r0021'
down_revision = 'r0020'
branch_labels = None
depends_on = None

RECORDS = ("mail_send_record", "sms_send_record")


def upgrade():
    # Plain ALTER TABLE on both dialects: a batch operation may make SQLite copy the tables,
    # losing their AUTOINCREMENT and callback triggers (migration 0017).
    for table in RECORDS:
        op.add_column(table, sa.Column("pinned_template_version", sa.Integer(), nullable=True))


def downgrade():
    for table in RECORDS:
        op.execute(f"ALTER TABLE {table} DROP COLUMN pinned_template_version")  # SQLite 3.35+
