"""Initial schema: tenants, users, keys, configs, templates, send records, quotas, dead letters

Revision ID: r0001
Revises: 
Create Date: 2026-11-30 08:43:03.104377

"""
from alembic import op
import sqlalchemy as sa

from portal.models.base import now_default


# revision identifiers, used by Alembic.
revision = 'r0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade():
    now = now_default(op.get_bind().dialect.name)
    op.create_table('dead_letter_message',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('source', sa.String(length=32), nullable=False),
    sa.Column('event_id', sa.String(length=64), nullable=True),
    sa.Column('channel', sa.String(length=8), nullable=True),
    sa.Column('provider', sa.String(length=200), nullable=True),
    sa.Column('error_code', sa.String(length=100), nullable=True),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('attempts', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('payload', sa.JSON(), nullable=True),
    sa.Column('status', sa.String(length=16), server_default=sa.text("'Pending'"), nullable=False),
    sa.Column('remark', sa.Text(), nullable=True),
    sa.Column('handled_by', sa.String(length=320), nullable=True),
    sa.Column('handled_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_dead_letter_message'))
    )
    with op.batch_alter_table('dead_letter_message', schema=None) as batch_op:
        batch_op.create_index('idx_dead_letter_event', ['channel', 'event_id'], unique=False)
        batch_op.create_index('idx_dead_letter_tenant_status', ['tenant_id', 'status', 'id'], unique=False)

    op.create_table('mail_send_record',
    sa.Column('to_addrs', sa.JSON(), nullable=False),
    sa.Column('cc_addrs', sa.JSON(), nullable=True),
    sa.Column('bcc_addrs', sa.JSON(), nullable=True),
    sa.Column('reply_to', sa.String(length=320), nullable=True),
    sa.Column('subject', sa.Text(), nullable=True),
    sa.Column('html_body', sa.Text(), nullable=True),
    sa.Column('text_body', sa.Text(), nullable=True),
    sa.Column('server_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('priority', sa.Integer(), nullable=True),
    sa.Column('attachments', sa.JSON(), nullable=True),
    sa.Column('rendered_subject', sa.Text(), nullable=True),
    sa.Column('rendered_html', sa.Text(), nullable=True),
    sa.Column('rendered_text', sa.Text(), nullable=True),
    sa.Column('final_reply_to', sa.String(length=320), nullable=True),
    sa.Column('final_priority', sa.Integer(), nullable=True),
    sa.Column('final_attachments', sa.JSON(), nullable=True),
    sa.Column('server_config_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('read_receipt', sa.Boolean(), server_default=sa.text('false'), nullable=False),
    sa.Column('message_id_header', sa.String(length=255), nullable=True),
    sa.Column('refused_recipients', sa.JSON(), nullable=True),
    sa.Column('bounce_code', sa.String(length=64), nullable=True),
    sa.Column('read_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('scope', sa.String(length=16), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('version', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('retry_count', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('next_retry_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('error_code', sa.String(length=100), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('trace_id', sa.String(length=64), nullable=True),
    sa.Column('business_key', sa.String(length=200), nullable=True),
    sa.Column('request_hash', sa.String(length=64), nullable=True),
    sa.Column('template_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('template_code', sa.String(length=100), nullable=True),
    sa.Column('variables', sa.JSON(), nullable=True),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('prepared_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('first_claimed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('sent_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('provider_message_id', sa.String(length=200), nullable=True),
    sa.Column('ambiguous_attempt', sa.Boolean(), server_default=sa.text('false'), nullable=False),
    sa.Column('ambiguous_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('ambiguous_reason', sa.Text(), nullable=True),
    sa.Column('delivery_outcome', sa.String(length=16), nullable=True),
    sa.Column('delivery_outcome_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.Column('updated_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_mail_send_record')),
    sa.UniqueConstraint('tenant_id', 'business_key', name='uq_mail_send_business_key'),
    postgresql_with={'autovacuum_vacuum_scale_factor': 0.01}
    )
    with op.batch_alter_table('mail_send_record', schema=None) as batch_op:
        batch_op.create_index('idx_mail_send_status_retry', ['status', 'next_retry_at'], unique=False)
        batch_op.create_index('idx_mail_send_status_updated', ['status', 'updated_time'], unique=False)
        batch_op.create_index('idx_mail_send_tenant_created', ['tenant_id', 'id'], unique=False)

    op.create_table('sms_send_record',
    sa.Column('phone_number', sa.String(length=20), nullable=False),
    sa.Column('country_code', sa.String(length=2), nullable=True),
    sa.Column('content', sa.Text(), nullable=True),
    sa.Column('rendered_content', sa.Text(), nullable=True),
    sa.Column('provider_config_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('provider_kind', sa.String(length=32), nullable=True),
    sa.Column('external_template_id', sa.String(length=200), nullable=True),
    sa.Column('signature', sa.String(length=200), nullable=True),
    sa.Column('frozen_variables', sa.JSON(), nullable=True),
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('scope', sa.String(length=16), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('version', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('retry_count', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('next_retry_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('error_code', sa.String(length=100), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('trace_id', sa.String(length=64), nullable=True),
    sa.Column('business_key', sa.String(length=200), nullable=True),
    sa.Column('request_hash', sa.String(length=64), nullable=True),
    sa.Column('template_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('template_code', sa.String(length=100), nullable=True),
    sa.Column('variables', sa.JSON(), nullable=True),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('prepared_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('first_claimed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('sent_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('provider_message_id', sa.String(length=200), nullable=True),
    sa.Column('ambiguous_attempt', sa.Boolean(), server_default=sa.text('false'), nullable=False),
    sa.Column('ambiguous_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('ambiguous_reason', sa.Text(), nullable=True),
    sa.Column('delivery_outcome', sa.String(length=16), nullable=True),
    sa.Column('delivery_outcome_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.Column('updated_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sms_send_record')),
    sa.UniqueConstraint('tenant_id', 'business_key', name='uq_sms_send_business_key'),
    postgresql_with={'autovacuum_vacuum_scale_factor': 0.01}
    )
    with op.batch_alter_table('sms_send_record', schema=None) as batch_op:
        batch_op.create_index('idx_sms_send_recipient', ['tenant_id', 'phone_number', 'id'], unique=False)
        batch_op.create_index('idx_sms_send_status_retry', ['status', 'next_retry_at'], unique=False)
        batch_op.create_index('idx_sms_send_status_updated', ['status', 'updated_time'], unique=False)
        batch_op.create_index('idx_sms_send_tenant_created', ['tenant_id', 'id'], unique=False)

    op.create_table('tenant',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('slug', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('is_active', sa.Boolean(), server_default=sa.text('true'), nullable=False),
    sa.Column('created_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.Column('updated_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.CheckConstraint('id = -1 OR id >= 1', name=op.f('ck_tenant_tenant_id_range')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tenant')),
    sa.UniqueConstraint('slug', name=op.f('uq_tenant_slug')),
    sqlite_autoincrement=True,
    )
    # The platform tier is a row like any tenant, so foreign keys hold for its configuration.
    op.execute("INSERT INTO tenant (id, slug, name, is_active) VALUES (-1, 'platform', 'Platform', true)")
    if op.get_bind().dialect.name == "sqlite":
        op.execute("UPDATE sqlite_sequence SET seq = 0 WHERE name = 'tenant'")
    op.create_table('api_key',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('created_by', sa.String(length=320), nullable=True),
    sa.Column('created_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.Column('last_used_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenant.id'], name=op.f('fk_api_key_tenant_id_tenant')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_key')),
    sa.UniqueConstraint('token_hash', name=op.f('uq_api_key_token_hash'))
    )
    with op.batch_alter_table('api_key', schema=None) as batch_op:
        batch_op.create_index('idx_api_key_tenant', ['tenant_id'], unique=False)

    op.create_table('app_user',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('email', sa.String(length=320), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('password_hash', sa.String(length=200), nullable=False),
    sa.Column('role', sa.String(length=32), nullable=False),
    sa.Column('is_active', sa.Boolean(), server_default=sa.text('true'), nullable=False),
    sa.Column('last_login_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.Column('updated_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.CheckConstraint("role IN ('platform_operator', 'tenant_admin', 'support')", name=op.f('ck_app_user_app_user_role')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenant.id'], name=op.f('fk_app_user_tenant_id_tenant')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_app_user')),
    sa.UniqueConstraint('email', name=op.f('uq_app_user_email'))
    )
    with op.batch_alter_table('app_user', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_app_user_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('mail_send_recipient',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('record_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('address', sa.String(length=320), nullable=False),
    sa.Column('kind', sa.String(length=3), nullable=False),
    sa.ForeignKeyConstraint(['record_id'], ['mail_send_record.id'], name=op.f('fk_mail_send_recipient_record_id_mail_send_record'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_mail_send_recipient'))
    )
    with op.batch_alter_table('mail_send_recipient', schema=None) as batch_op:
        batch_op.create_index('idx_mail_recipient_search', ['tenant_id', 'address', 'record_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_mail_send_recipient_record_id'), ['record_id'], unique=False)

    op.create_table('mail_send_server_config',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('host', sa.String(length=255), nullable=False),
    sa.Column('port', sa.Integer(), nullable=False),
    sa.Column('security', sa.String(length=16), nullable=False),
    sa.Column('verify_tls', sa.Boolean(), server_default=sa.text('true'), nullable=False),
    sa.Column('username', sa.String(length=320), nullable=True),
    sa.Column('password_encrypted', sa.Text(), nullable=True),
    sa.Column('from_address', sa.String(length=320), nullable=True),
    sa.Column('from_name', sa.String(length=200), nullable=True),
    sa.Column('reply_to', sa.String(length=320), nullable=True),
    sa.Column('read_receipt', sa.Boolean(), server_default=sa.text('false'), nullable=False),
    sa.Column('is_default', sa.Boolean(), server_default=sa.text('false'), nullable=False),
    sa.Column('enabled', sa.Boolean(), server_default=sa.text('true'), nullable=False),
    sa.Column('daily_send_limit', sa.Integer(), nullable=True),
    sa.Column('rate_limit_per_minute', sa.Integer(), nullable=True),
    sa.Column('uncertain_policy', sa.String(length=16), server_default=sa.text("'retry'"), nullable=False),
    sa.Column('config_version', sa.Integer(), server_default=sa.text('1'), nullable=False),
    sa.Column('created_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.Column('updated_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenant.id'], name=op.f('fk_mail_send_server_config_tenant_id_tenant')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_mail_send_server_config')),
    sa.UniqueConstraint('tenant_id', 'name', name=op.f('uq_mail_send_server_config_tenant_id_name'))
    )
    with op.batch_alter_table('mail_send_server_config', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_mail_send_server_config_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('sms_provider_config',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('provider', sa.String(length=32), nullable=False),
    sa.Column('base_url', sa.String(length=500), nullable=True),
    sa.Column('account_id', sa.String(length=200), nullable=True),
    sa.Column('secret_encrypted', sa.Text(), nullable=True),
    sa.Column('webhook_secret_encrypted', sa.Text(), nullable=True),
    sa.Column('sender_id', sa.String(length=64), nullable=True),
    sa.Column('is_default', sa.Boolean(), server_default=sa.text('false'), nullable=False),
    sa.Column('enabled', sa.Boolean(), server_default=sa.text('true'), nullable=False),
    sa.Column('daily_send_limit', sa.Integer(), nullable=True),
    sa.Column('rate_limit_per_minute', sa.Integer(), nullable=True),
    sa.Column('retry_window_s', sa.Float(), nullable=True),
    sa.Column('uncertain_policy', sa.String(length=16), server_default=sa.text("'retry'"), nullable=False),
    sa.Column('settings', sa.JSON(), nullable=True),
    sa.Column('config_version', sa.Integer(), server_default=sa.text('1'), nullable=False),
    sa.Column('created_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.Column('updated_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenant.id'], name=op.f('fk_sms_provider_config_tenant_id_tenant')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sms_provider_config')),
    sa.UniqueConstraint('tenant_id', 'name', name=op.f('uq_sms_provider_config_tenant_id_name'))
    )
    with op.batch_alter_table('sms_provider_config', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_sms_provider_config_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('sms_template',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('code', sa.String(length=100), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('content', sa.Text(), nullable=False),
    sa.Column('enabled', sa.Boolean(), server_default=sa.text('true'), nullable=False),
    sa.Column('version', sa.Integer(), server_default=sa.text('1'), nullable=False),
    sa.Column('created_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.Column('updated_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenant.id'], name=op.f('fk_sms_template_tenant_id_tenant')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sms_template')),
    sa.UniqueConstraint('tenant_id', 'code', name=op.f('uq_sms_template_tenant_id_code'))
    )
    op.create_table('tenant_message_quota',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('mail_monthly_limit', sa.Integer(), nullable=True),
    sa.Column('sms_monthly_limit', sa.Integer(), nullable=True),
    sa.Column('updated_by', sa.String(length=320), nullable=True),
    sa.Column('created_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.Column('updated_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenant.id'], name=op.f('fk_tenant_message_quota_tenant_id_tenant')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tenant_message_quota')),
    sa.UniqueConstraint('tenant_id', name=op.f('uq_tenant_message_quota_tenant_id'))
    )
    op.create_table('tenant_message_usage',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('month', sa.String(length=7), nullable=False),
    sa.Column('mail_count', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('sms_count', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('version', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('updated_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenant.id'], name=op.f('fk_tenant_message_usage_tenant_id_tenant')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tenant_message_usage')),
    sa.UniqueConstraint('tenant_id', 'month', name=op.f('uq_tenant_message_usage_tenant_id_month'))
    )
    op.create_table('mail_template',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('code', sa.String(length=100), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('subject', sa.Text(), nullable=False),
    sa.Column('html_body', sa.Text(), nullable=True),
    sa.Column('text_body', sa.Text(), nullable=True),
    sa.Column('enabled', sa.Boolean(), server_default=sa.text('true'), nullable=False),
    sa.Column('priority', sa.Integer(), nullable=True),
    sa.Column('reply_to', sa.String(length=320), nullable=True),
    sa.Column('preferred_server_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('attachments', sa.JSON(), nullable=True),
    sa.Column('version', sa.Integer(), server_default=sa.text('1'), nullable=False),
    sa.Column('created_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.Column('updated_time', sa.DateTime(timezone=True), server_default=now, nullable=False),
    sa.ForeignKeyConstraint(['preferred_server_id'], ['mail_send_server_config.id'], name=op.f('fk_mail_template_preferred_server_id_mail_send_server_config'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenant.id'], name=op.f('fk_mail_template_tenant_id_tenant')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_mail_template')),
    sa.UniqueConstraint('tenant_id', 'code', name=op.f('uq_mail_template_tenant_id_code'))
    )
    op.create_table('sms_provider_region',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('provider_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('country_code', sa.String(length=2), nullable=False),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['provider_id'], ['sms_provider_config.id'], name=op.f('fk_sms_provider_region_provider_id_sms_provider_config'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenant.id'], name=op.f('fk_sms_provider_region_tenant_id_tenant')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sms_provider_region')),
    sa.UniqueConstraint('provider_id', 'country_code', name=op.f('uq_sms_provider_region_provider_id_country_code'))
    )
    with op.batch_alter_table('sms_provider_region', schema=None) as batch_op:
        batch_op.create_index('idx_sms_region_tenant_country', ['tenant_id', 'country_code', 'priority'], unique=False)

    op.create_table('sms_template_provider_binding',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('tenant_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('template_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('provider_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('country_code', sa.String(length=2), nullable=True),
    sa.Column('external_template_id', sa.String(length=200), nullable=True),
    sa.Column('signature', sa.String(length=200), nullable=True),
    sa.ForeignKeyConstraint(['provider_id'], ['sms_provider_config.id'], name=op.f('fk_sms_template_provider_binding_provider_id_sms_provider_config'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['template_id'], ['sms_template.id'], name=op.f('fk_sms_template_provider_binding_template_id_sms_template'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenant.id'], name=op.f('fk_sms_template_provider_binding_tenant_id_tenant')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sms_template_provider_binding')),
    sa.UniqueConstraint('template_id', 'provider_id', 'country_code', name=op.f('uq_sms_template_provider_binding_template_id_provider_id_country_code'))
    )
    with op.batch_alter_table('sms_template_provider_binding', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_sms_template_provider_binding_template_id'), ['template_id'], unique=False)



def downgrade():
    # ### commands auto generated by Alembic - please adjust! ###
    with op.batch_alter_table('sms_template_provider_binding', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sms_template_provider_binding_template_id'))

    op.drop_table('sms_template_provider_binding')
    with op.batch_alter_table('sms_provider_region', schema=None) as batch_op:
        batch_op.drop_index('idx_sms_region_tenant_country')

    op.drop_table('sms_provider_region')
    op.drop_table('mail_template')
    op.drop_table('tenant_message_usage')
    op.drop_table('tenant_message_quota')
    op.drop_table('sms_template')
    with op.batch_alter_table('sms_provider_config', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sms_provider_config_tenant_id'))

    op.drop_table('sms_provider_config')
    with op.batch_alter_table('mail_send_server_config', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_mail_send_server_config_tenant_id'))

    op.drop_table('mail_send_server_config')
    with op.batch_alter_table('mail_send_recipient', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_mail_send_recipient_record_id'))
        batch_op.drop_index('idx_mail_recipient_search')

    op.drop_table('mail_send_recipient')
    with op.batch_alter_table('app_user', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_app_user_tenant_id'))

    op.drop_table('app_user')
    with op.batch_alter_table('api_key', schema=None) as batch_op:
        batch_op.drop_index('idx_api_key_tenant')

    op.drop_table('api_key')
    op.drop_table('tenant')
    with op.batch_alter_table('sms_send_record', schema=None) as batch_op:
        batch_op.drop_index('idx_sms_send_tenant_created')
        batch_op.drop_index('idx_sms_send_status_updated')
        batch_op.drop_index('idx_sms_send_status_retry')
        batch_op.drop_index('idx_sms_send_recipient')

    op.drop_table('sms_send_record')
    with op.batch_alter_table('mail_send_record', schema=None) as batch_op:
        batch_op.drop_index('idx_mail_send_tenant_created')
        batch_op.drop_index('idx_mail_send_status_updated')
        batch_op.drop_index('idx_mail_send_status_retry')

    op.drop_table('mail_send_record')
    with op.batch_alter_table('dead_letter_message', schema=None) as batch_op:
        batch_op.drop_index('idx_dead_letter_tenant_status')
        batch_op.drop_index('idx_dead_letter_event')

    op.drop_table('dead_letter_message')
