"""The configuration epoch: workers cache the configs they read at every send

One row, ``config_epoch`` (id 1), whose ``epoch`` changes in the same transaction as any
change to the mail servers, SMS providers, their country routes or the SMS templates'
provider bindings (PostgreSQL statement triggers, whoever writes: the portal, import-config,
the CLI, plain SQL). A worker reads the epoch in a statement it runs anyway (the suppression
lookup) and keeps the server and provider rows, their decrypted secrets and the SMS routing it
derived from them while the epoch stays the same: two round trips fewer per SMS, one per mail
retry. The new value comes from a sequence, so an epoch never repeats, not even when the row
is deleted and written again (the trigger upserts it). SQLite (the embedded single-machine
default) has no triggers here: its workers read the configs at every send, as before.

Revision ID: r0016
Revises: r0015
Create Date: 2026-12-01 19:30:00

"""

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision = 'r0016'
down_revision = 'r0015'
branch_labels = None
depends_on = None

TABLES = (
    "mail_send_server_config",
    "sms_provider_config",
    "sms_provider_region",
    "sms_template_provider_binding",
)


def upgrade():
    op.create_table(
        'config_epoch',
        sa.Column('id', sa.Integer(), autoincrement=False, nullable=False),
        sa.Column('epoch', sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_config_epoch')),
    )
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("CREATE SEQUENCE config_epoch_seq")
    op.execute("INSERT INTO config_epoch (id, epoch) VALUES (1, nextval('config_epoch_seq'))")
    op.execute(
        """
        CREATE FUNCTION postroom_bump_config_epoch() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          INSERT INTO config_epoch (id, epoch) VALUES (1, nextval('config_epoch_seq'))
          ON CONFLICT (id) DO UPDATE SET epoch = excluded.epoch;
          RETURN NULL;
        END $$
        """
    )
    for table in TABLES:
        op.execute(
            f"CREATE TRIGGER {table}_config_epoch AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE "
            f"ON {table} FOR EACH STATEMENT EXECUTE FUNCTION postroom_bump_config_epoch()"
        )


def downgrade():
    if op.get_bind().dialect.name == "postgresql":
        for table in TABLES:
            op.execute(f"DROP TRIGGER IF EXISTS {table}_config_epoch ON {table}")
        op.execute("DROP FUNCTION IF EXISTS postroom_bump_config_epoch()")
        op.execute("DROP SEQUENCE IF EXISTS config_epoch_seq")
    op.drop_table('config_epoch')
