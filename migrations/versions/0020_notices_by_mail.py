"""Inbox notices by mail too, per user

``app_user.notices_by_mail``: the user also gets each new notice of their tier by mail, sent
through our own delivery path on the platform tier. A constant default: no table rewrite.

Revision ID: r0020
Revises: r0019
Create Date: 2026-12-01 20:50:00

"""
import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision = 'r0020'
down_revision = 'r0019'
branch_labels = None
depends_on = None


def upgrade():
    with op.batch_alter_table("app_user") as batch:
        batch.add_column(
            sa.Column(
                "notices_by_mail", sa.Boolean(), server_default=sa.text("false"), nullable=False
            )
        )


def downgrade():
    with op.batch_alter_table("app_user") as batch:
        batch.drop_column("notices_by_mail")
