"""Circuit breaker state per server and provider, the fallback when Redis is away

Redis holds the live breaker state; this table mirrors each change of state (opened, a probe
failed, closed) for the portal and the metrics, and holds the whole state while Redis is away.

Revision ID: r0011
Revises: r0010
Create Date: 2026-12-01 18:30:00

"""

from alembic import op
import sqlalchemy as sa

# revision identifiers, used by Alembic.
revision = 'r0011'
down_revision = 'r0010'
branch_labels = None
depends_on = None


def upgrade():
    op.create_table(
        'breaker_state',
        sa.Column('channel', sa.String(length=10), nullable=False),
        sa.Column('config_id', sa.Integer(), autoincrement=False, nullable=False),
        sa.Column('down_since', sa.DateTime(timezone=True), nullable=True),
        sa.Column('last_error', sa.Text(), nullable=True),
        sa.Column('next_probe_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('interval_s', sa.Float(), nullable=False),
        sa.Column('probe_record_id', sa.Integer(), nullable=True),
        sa.Column('probe_until', sa.DateTime(timezone=True), nullable=True),
        sa.Column('last_probe_record_id', sa.Integer(), nullable=True),
        sa.Column('streak', sa.JSON(), nullable=False),
        sa.Column('updated_time', sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint('channel', 'config_id', name=op.f('pk_breaker_state')),
    )


def downgrade():
    op.drop_table('breaker_state')
