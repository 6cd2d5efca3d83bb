"""The sweep's last run kept in the database (issue 13, part 5)

Reserved in the chain while the issue's parts are built; filled in by that part.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 18:00:00

"""

# revision identifiers, used by Alembic.
revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade():
    pass


def downgrade():
    pass
