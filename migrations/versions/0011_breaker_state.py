"""Circuit breaker state per server and provider, the fallback when Redis is away (issue 13, part 1)

Reserved in the chain while the issue's parts are built; filled in by that part.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01 18:30:00

"""

# revision identifiers, used by Alembic.
revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade():
    pass


def downgrade():
    pass
