"""Providers that honour no idempotency key hold uncertain outcomes (issue 13, part 4)

Reserved in the chain while the issue's parts are built; filled in by that part.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01 18:00:00

"""

# revision identifiers, used by Alembic.
revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade():
    pass


def downgrade():
    pass
