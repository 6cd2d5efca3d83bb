"""Who gets in and who did what: session generations, invitations, API key scopes, the audit
log and the database's sign-in throttle

- ``app_user.session_generation``: a session ends when it differs from the one it signed in
  with (sign-out, a password, role, tenant or active change).
- ``app_user.password_token_hash`` / ``password_token_expires_at``: a one-time set-password
  link (invitations).
- ``api_key.scopes``: ``send`` and ``read``; existing keys get both.
- ``audit_event``: one row per audited action, in the action's transaction.
- ``login_throttle``: sign-in attempts per window when Redis cannot be reached.

Revision ID: r0007
Revises: r0006
Create Date: 2026-12-01 17:00:00

"""
from alembic import op
import sqlalchemy as sa

from portal.models.base import now_default

# revision identifiers, used by Alembic.
revision = 'r0007'
down_revision = 'r0006'
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade():
    now = now_default(op.get_bind().dialect.name)
    with op.batch_alter_table('app_user', schema=None) as batch_op:
        batch_op.add_column(
            sa.Column('session_generation', sa.Integer(), nullable=False, server_default=sa.text('0'))
        )
        batch_op.add_column(sa.Column('password_token_hash', sa.String(length=64), nullable=True))
        batch_op.add_column(
            sa.Column('password_token_expires_at', sa.DateTime(timezone=True), nullable=True)
        )
        batch_op.create_unique_constraint(
            batch_op.f('uq_app_user_password_token_hash'), ['password_token_hash']
        )
    with op.batch_alter_table('api_key', schema=None) as batch_op:
        batch_op.add_column(
            sa.Column('scopes', sa.String(length=64), nullable=False, server_default='send read')
        )

    op.create_table(
        'audit_event',
        sa.Column('id', BigId, nullable=False),
        sa.Column('tenant_id', BigId, nullable=True),
        sa.Column('actor_user_id', BigId, nullable=True),
        sa.Column('actor_key_id', BigId, nullable=True),
        sa.Column('actor_label', sa.String(length=400), nullable=False),
        sa.Column('action', sa.String(length=64), nullable=False),
        sa.Column('target_type', sa.String(length=64), nullable=True),
        sa.Column('target_id', sa.String(length=64), nullable=True),
        sa.Column('remark', sa.Text(), nullable=False),
        sa.Column(
            'created_time', sa.DateTime(timezone=True), server_default=now, nullable=False
        ),
        sa.ForeignKeyConstraint(
            ['actor_user_id'], ['app_user.id'],
            name=op.f('fk_audit_event_actor_user_id_app_user'), ondelete='SET NULL',
        ),
        sa.ForeignKeyConstraint(
            ['actor_key_id'], ['api_key.id'],
            name=op.f('fk_audit_event_actor_key_id_api_key'), ondelete='SET NULL',
        ),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_audit_event')),
    )
    op.create_index('idx_audit_event_tenant_time', 'audit_event', ['tenant_id', 'created_time'])
    op.create_index('idx_audit_event_time', 'audit_event', ['created_time'])

    op.create_table(
        'login_throttle',
        sa.Column('key', sa.String(length=400), nullable=False),
        sa.Column('attempts', sa.Integer(), nullable=False),
        sa.Column(
            'window_start', sa.DateTime(timezone=True), server_default=now, nullable=False
        ),
        sa.PrimaryKeyConstraint('key', name=op.f('pk_login_throttle')),
    )


def downgrade():
    op.drop_table('login_throttle')
    op.drop_index('idx_audit_event_time', table_name='audit_event')
    op.drop_index('idx_audit_event_tenant_time', table_name='audit_event')
    op.drop_table('audit_event')
    with op.batch_alter_table('api_key', schema=None) as batch_op:
        batch_op.drop_column('scopes')
    with op.batch_alter_table('app_user', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('uq_app_user_password_token_hash'), type_='unique')
        batch_op.drop_column('password_token_expires_at')
        batch_op.drop_column('password_token_hash')
        batch_op.drop_column('session_generation')
