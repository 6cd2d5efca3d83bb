"""After the send: suppression list, delivery events, bounce mailboxes, uncertain and cancelled records

Revision ID: r0002
Revises: r0001
Create Date: 2026-11-30 09:44:46.638484

"""
from alembic import op
import sqlalchemy as sa

from portal.models.base import now_default


# revision identifiers, used by Alembic.
revision = 'r0002'
down_revision = 'r0001'
branch_labels = None
depends_on = None


def upgrade():
    now = now_default(op.get_bind().dialect.name)
    op.create_table('delivery_event',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('channel', sa.String(length=8), nullable=False),
    sa.Column('config_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('provider', sa.String(length=32), nullable=False),
    sa.Column('dedup_key', sa.String(length=200), nullable=False),
    sa.Column('provider_message_id', sa.String(length=200), nullable=True),
    sa.Column('recipient', sa.String(length=320), nullable=True),
    sa.Column('event_type', sa.String(length=16), nullable=False),
    sa.Column('detail', sa.JSON(), nullable=True),
    sa.Column('occurred_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('received_at', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.Column('record_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('applied_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_delivery_event')),
    sa.UniqueConstraint('channel', 'config_id', 'dedup_key', name='uq_delivery_event_dedup')
    )
    with op.batch_alter_table('delivery_event', schema=None) as batch_op:
        batch_op.create_index('idx_delivery_event_match', ['channel', 'config_id', 'provider_message_id'], unique=False)
        batch_op.create_index('idx_delivery_event_record', ['channel', 'record_id', 'id'], unique=False)

    op.create_table('received_mail',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('config_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('folder', sa.String(length=200), nullable=False),
    sa.Column('uid', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('dedup_key', sa.String(length=300), nullable=False),
    sa.Column('message_id', sa.String(length=300), nullable=True),
    sa.Column('from_addr', sa.String(length=320), nullable=True),
    sa.Column('subject', sa.Text(), nullable=True),
    sa.Column('size', sa.Integer(), nullable=False),
    sa.Column('raw', sa.Text(), nullable=True),
    sa.Column('truncated', sa.Boolean(), server_default=sa.text('false'), nullable=False),
    sa.Column('truncation_reason', sa.Text(), nullable=True),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('bounce_status', sa.String(length=16), nullable=True),
    sa.Column('bounce_code', sa.String(length=64), nullable=True),
    sa.Column('record_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('fetched_at', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.Column('processed_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_received_mail')),
    sa.UniqueConstraint('config_id', 'dedup_key', name='uq_received_mail_dedup')
    )
    op.create_table('mail_receive_config',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('host', sa.String(length=255), nullable=False),
    sa.Column('port', sa.Integer(), nullable=False),
    sa.Column('security', sa.String(length=16), nullable=False),
    sa.Column('verify_tls', sa.Boolean(), server_default=sa.text('true'), nullable=False),
    sa.Column('username', sa.String(length=320), nullable=False),
    sa.Column('secret_encrypted', sa.Text(), nullable=True),
    sa.Column('folder', sa.String(length=200), nullable=False),
    sa.Column('enabled', sa.Boolean(), server_default=sa.text('true'), nullable=False),
    sa.Column('config_version', sa.Integer(), server_default=sa.text('1'), nullable=False),
    sa.Column('created_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.Column('updated_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenant.id'], name=op.f('fk_mail_receive_config_tenant_id_tenant')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_mail_receive_config')),
    sa.UniqueConstraint('tenant_id', 'name', name=op.f('uq_mail_receive_config_tenant_id_name'))
    )
    with op.batch_alter_table('mail_receive_config', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_mail_receive_config_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('suppression',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('channel', sa.String(length=8), nullable=False),
    sa.Column('address', sa.String(length=320), nullable=False),
    sa.Column('reason', sa.String(length=16), nullable=False),
    sa.Column('detail', sa.Text(), nullable=True),
    sa.Column('source_record_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('created_by', sa.String(length=320), nullable=True),
    sa.Column('created_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.Column('removed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('removed_by', sa.String(length=320), nullable=True),
    sa.Column('removal_reason', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenant.id'], name=op.f('fk_suppression_tenant_id_tenant')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_suppression'))
    )
    with op.batch_alter_table('suppression', schema=None) as batch_op:
        batch_op.create_index('idx_suppression_lookup', ['tenant_id', 'channel', 'address', 'removed_at'], unique=False)

    op.create_table('mail_receive_state',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('config_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('folder', sa.String(length=200), nullable=False),
    sa.Column('uidvalidity', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('last_uid', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), server_default=sa.text('0'), nullable=False),
    sa.Column('updated_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.ForeignKeyConstraint(['config_id'], ['mail_receive_config.id'], name=op.f('fk_mail_receive_state_config_id_mail_receive_config'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_mail_receive_state')),
    sa.UniqueConstraint('config_id', 'folder', name=op.f('uq_mail_receive_state_config_id_folder'))
    )
    with op.batch_alter_table('mail_send_record', schema=None) as batch_op:
        batch_op.add_column(sa.Column('resolution', sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column('resolution_reason', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('resolved_by', sa.String(length=320), nullable=True))
        batch_op.add_column(sa.Column('resolved_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('cancelled_at', sa.DateTime(timezone=True), nullable=True))

    with op.batch_alter_table('sms_send_record', schema=None) as batch_op:
        batch_op.add_column(sa.Column('resolution', sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column('resolution_reason', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('resolved_by', sa.String(length=320), nullable=True))
        batch_op.add_column(sa.Column('resolved_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('cancelled_at', sa.DateTime(timezone=True), nullable=True))



def downgrade():
    # ### commands auto generated by Alembic - please adjust! ###
    with op.batch_alter_table('sms_send_record', schema=None) as batch_op:
        batch_op.drop_column('cancelled_at')
        batch_op.drop_column('resolved_at')
        batch_op.drop_column('resolved_by')
        batch_op.drop_column('resolution_reason')
        batch_op.drop_column('resolution')

    with op.batch_alter_table('mail_send_record', schema=None) as batch_op:
        batch_op.drop_column('cancelled_at')
        batch_op.drop_column('resolved_at')
        batch_op.drop_column('resolved_by')
        batch_op.drop_column('resolution_reason')
        batch_op.drop_column('resolution')

    op.drop_table('mail_receive_state')
    with op.batch_alter_table('suppression', schema=None) as batch_op:
        batch_op.drop_index('idx_suppression_lookup')

    op.drop_table('suppression')
    with op.batch_alter_table('mail_receive_config', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_mail_receive_config_tenant_id'))

    op.drop_table('mail_receive_config')
    op.drop_table('received_mail')
    with op.batch_alter_table('delivery_event', schema=None) as batch_op:
        batch_op.drop_index('idx_delivery_event_record')
        batch_op.drop_index('idx_delivery_event_match')

    op.drop_table('delivery_event')
