"""Records waiting for an open breaker wait on the breaker, not on a time

A record held back because its server's or provider's breaker is open
(``SERVER_UNAVAILABLE``) was deferred to the next probe and, at every probe, claimed and
deferred again: two writes per waiting record per probe (12,696 writes for 1,000 records in a
200 s outage), and records gated just before a probe succeeded waited one more interval.

``waiting_config_id`` on both record tables names the server or provider the record waits
for. It is written once, with the record due at its own deadline (its expiry or the end of its
resend window: the claim then ends it); the breaker makes one of them due when a probe is due,
and all of them when it closes (``breaker.release``). Nullable with no default, so adding it
rewrites nothing; no index: the releases read the Retry rows through the status index, once
per probe and once per close. The claim is unchanged.

Revision ID: r0029
Revises: r0028
Create Date: 2026-12-03 09:00:00

"""
import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision = 'r0029'
down_revision = 'r0028'
branch_labels = None
depends_on = None

RECORDS = ("mail_send_record", "sms_send_record")


def upgrade():
    bigid = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    # Plain ALTER TABLE ADD COLUMN on both dialects: a batch operation would make SQLite copy
    # the tables, losing their AUTOINCREMENT and callback triggers (migration 0017).
    for table in RECORDS:
        op.add_column(table, sa.Column("waiting_config_id", bigid, nullable=True))


def downgrade():
    for table in RECORDS:
        op.execute(f"ALTER TABLE {table} DROP COLUMN waiting_config_id")  # SQLite 3.35+ too
