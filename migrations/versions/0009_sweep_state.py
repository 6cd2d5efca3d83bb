"""The sweep's last run kept in the database

The stuck-send sweep's last run is written to ``chore_run`` as well as being scheduled in
Redis, so a delivery worker can see from the database alone that the sweep is overdue (Redis
down) and run it itself.

Revision ID: r0009
Revises: r0008
Create Date: 2026-12-01 18:00:00

"""

from alembic import op
import sqlalchemy as sa

# revision identifiers, used by Alembic.
revision = 'r0009'
down_revision = 'r0008'
branch_labels = None
depends_on = None


def upgrade():
    op.create_table(
        'chore_run',
        sa.Column('name', sa.String(length=100), nullable=False),
        sa.Column('last_run_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('name', name=op.f('pk_chore_run')),
    )


def downgrade():
    op.drop_table('chore_run')
