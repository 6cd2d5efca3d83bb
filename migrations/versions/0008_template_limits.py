"""Templates over the new limits (issue 13, part 3)

Reserved in the chain while the issue's parts are built; filled in by that part.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 18:00:00

"""

# revision identifiers, used by Alembic.
revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade():
    pass


def downgrade():
    pass
