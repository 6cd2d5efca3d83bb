"""Message streams: transactional and broadcast (issue 13, part 2)

Reserved in the chain while the issue's parts are built; filled in by that part.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01 18:30:00

"""

# revision identifiers, used by Alembic.
revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade():
    pass


def downgrade():
    pass
