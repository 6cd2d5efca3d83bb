"""Bounce mailbox runs: when the fetch job last ran over a folder, and why it failed

A run that cannot connect, log in or open the folder was only logged; the portal now shows it.

Revision ID: r0005
Revises: r0004
Create Date: 2026-12-01 09:00:00

"""
from alembic import op
import sqlalchemy as sa

# revision identifiers, used by Alembic.
revision = 'r0005'
down_revision = 'r0004'
branch_labels = None
depends_on = None

COLUMNS = [
    ("last_run_at", sa.DateTime(timezone=True)),
    ("last_error", sa.Text()),
    ("last_error_at", sa.DateTime(timezone=True)),
]


def upgrade():
    with op.batch_alter_table('mail_receive_state', schema=None) as batch_op:
        for name, type_ in COLUMNS:
            batch_op.add_column(sa.Column(name, type_, nullable=True))


def downgrade():
    with op.batch_alter_table('mail_receive_state', schema=None) as batch_op:
        for name, _ in reversed(COLUMNS):
            batch_op.drop_column(name)
