"""A server's or provider's health is read from its recent attempts

``send_attempt.unavailable``: what the attempt said about the server or provider itself, as
``classify.unavailable`` decided it for the breaker: true when it could not be reached (or
answered "unavailable"), false when it answered (a send, or a refusal of the record's own),
NULL when the attempt says nothing either way (no answer after the request was written, a
swept attempt, and every attempt written before this migration). Nullable with no default,
so adding it rewrites nothing.

``idx_send_attempt_config`` (channel, config_id, finished_at): ``health.states`` reads each
shown server's last answer and the failures since, walking back from the newest attempt, in
one statement per page whatever the table's size. Its cost is one more index entry per
attempt (the attempt row already has one).

Revision ID: r0030
Revises: r0029
Create Date: 2026-12-04 10:00:00

"""
import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision = 'r0030'
down_revision = 'r0029'
branch_labels = None
depends_on = None


def upgrade():
    op.add_column("send_attempt", sa.Column("unavailable", sa.Boolean(), nullable=True))
    op.create_index(
        "idx_send_attempt_config", "send_attempt", ["channel", "config_id", "finished_at"]
    )


def downgrade():
    op.drop_index("idx_send_attempt_config", table_name="send_attempt")
    op.execute("ALTER TABLE send_attempt DROP COLUMN unavailable")  # SQLite 3.35+ too
