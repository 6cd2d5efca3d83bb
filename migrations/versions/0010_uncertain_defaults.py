"""Providers that honour no idempotency key hold uncertain outcomes

Twilio's Messages API and Vonage's SMS API honour no idempotency key, so a resend after an
ambiguous attempt may deliver twice: their existing provider configs switch to
uncertain_policy 'hold' (Uncertain, never resent, a person decides). Keyed providers and mail
servers keep theirs. The downgrade cannot tell which rows were 'retry' before, so it leaves
them as they are.

Revision ID: r0010
Revises: r0009
Create Date: 2026-12-01 18:00:00

"""

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision = 'r0010'
down_revision = 'r0009'
branch_labels = None
depends_on = None


def upgrade():
    op.execute(
        sa.text(
            "UPDATE sms_provider_config SET uncertain_policy = 'hold', "
            "config_version = config_version + 1 "
            "WHERE provider IN ('twilio', 'vonage') AND uncertain_policy <> 'hold'"
        )
    )


def downgrade():
    pass
