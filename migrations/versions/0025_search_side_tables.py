"""Search that finds what people type: side tables and trigram indexes

- ``tenant.country`` (ISO 3166 alpha-2, nullable: the platform's DEFAULT_COUNTRY then): how a
  national phone number typed in the search box is read.
- ``mail_send_subject``: one insert-only row per subject a mail has (the caller's at
  acceptance, the rendered one at preparation), written by triggers on mail_send_record in
  the statement that writes the subject, so acceptance's fast paths need no change. The record
  tables get no new index: every status change rewrites each of theirs.
- ``recipient_token``: what a recipient page's opaque token (an HMAC) stands for.
- PostgreSQL: ``pg_trgm`` and GIN trigram indexes on mail_send_subject.subject and
  mail_send_recipient.address (a subject word, ``carol``, ``carol@``, ``@example.com``), and a
  btree on send_attempt.provider_message_id (insert-only too). SQLite falls back to LIKE.

Columns are added with plain ALTER TABLE: a batch operation would make SQLite copy the
record tables, losing AUTOINCREMENT and the callback triggers.

Revision ID: r0025
Revises: r0024
Create Date: 2026-12-01 23:40:00

"""
import sqlalchemy as sa
from alembic import op

from portal.models.base import now_default

# revision identifiers, used by Alembic.
revision = 'r0025'
down_revision = 'r0024'
branch_labels = None
depends_on = None

# A subject row per distinct subject: the caller's at insert, the rendered one when
# preparation writes it (and it differs from the caller's).
PG_FUNCTION = """
CREATE OR REPLACE FUNCTION mail_subject_index() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    IF NEW.subject IS NOT NULL AND NEW.subject <> '' THEN
      INSERT INTO mail_send_subject (record_id, tenant_id, subject)
      VALUES (NEW.id, NEW.tenant_id, NEW.subject);
    END IF;
  ELSIF NEW.rendered_subject IS NOT NULL AND NEW.rendered_subject <> ''
        AND NEW.rendered_subject IS DISTINCT FROM OLD.rendered_subject
        AND NEW.rendered_subject IS DISTINCT FROM NEW.subject THEN
    INSERT INTO mail_send_subject (record_id, tenant_id, subject)
    VALUES (NEW.id, NEW.tenant_id, NEW.rendered_subject);
  END IF;
  RETURN NULL;
END
$$;
"""
PG_TRIGGERS = [
    "CREATE TRIGGER mail_send_record_subject_insert AFTER INSERT ON mail_send_record "
    "FOR EACH ROW WHEN (NEW.subject IS NOT NULL) EXECUTE FUNCTION mail_subject_index()",
    "CREATE TRIGGER mail_send_record_subject_render AFTER UPDATE OF rendered_subject "
    "ON mail_send_record FOR EACH ROW "
    "WHEN (NEW.rendered_subject IS DISTINCT FROM OLD.rendered_subject) "
    "EXECUTE FUNCTION mail_subject_index()",
]
SQLITE_TRIGGERS = [
    "CREATE TRIGGER mail_send_record_subject_insert AFTER INSERT ON mail_send_record "
    "WHEN NEW.subject IS NOT NULL AND NEW.subject <> '' BEGIN "
    "INSERT INTO mail_send_subject (record_id, tenant_id, subject) "
    "VALUES (NEW.id, NEW.tenant_id, NEW.subject); END",
    "CREATE TRIGGER mail_send_record_subject_render AFTER UPDATE OF rendered_subject "
    "ON mail_send_record WHEN NEW.rendered_subject IS NOT NULL AND NEW.rendered_subject <> '' "
    "AND NEW.rendered_subject IS NOT OLD.rendered_subject "
    "AND NEW.rendered_subject IS NOT NEW.subject BEGIN "
    "INSERT INTO mail_send_subject (record_id, tenant_id, subject) "
    "VALUES (NEW.id, NEW.tenant_id, NEW.rendered_subject); END",
]
BACKFILL = [
    "INSERT INTO mail_send_subject (record_id, tenant_id, subject) "
    "SELECT id, tenant_id, subject FROM mail_send_record "
    "WHERE subject IS NOT NULL AND subject <> ''",
    "INSERT INTO mail_send_subject (record_id, tenant_id, subject) "
    "SELECT id, tenant_id, rendered_subject FROM mail_send_record "
    "WHERE rendered_subject IS NOT NULL AND rendered_subject <> '' "
    "AND (subject IS NULL OR rendered_subject <> subject)",
]


def upgrade():
    bind = op.get_bind()
    postgres = bind.dialect.name == "postgresql"
    bigid = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    now = now_default(bind.dialect.name)
    op.add_column("tenant", sa.Column("country", sa.String(2), nullable=True))
    op.create_table(
        "mail_send_subject",
        sa.Column("id", bigid, nullable=False),
        sa.Column("record_id", bigid, nullable=False),
        sa.Column("tenant_id", bigid, nullable=False),
        sa.Column("subject", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["record_id"],
            ["mail_send_record.id"],
            name="fk_mail_send_subject_record_id_mail_send_record",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_mail_send_subject"),
        sqlite_autoincrement=True,
    )
    op.create_index("idx_mail_subject_record", "mail_send_subject", ["record_id"])
    op.create_table(
        "recipient_token",
        sa.Column("token", sa.String(64), nullable=False),
        sa.Column("tenant_id", bigid, nullable=False),
        sa.Column("channel", sa.String(8), nullable=False),
        sa.Column("address", sa.String(320), nullable=False),
        sa.Column("created_time", sa.DateTime(timezone=True), nullable=False, server_default=now),
        sa.PrimaryKeyConstraint("token", name="pk_recipient_token"),
    )
    op.create_index(
        "idx_send_attempt_provider_message", "send_attempt", ["provider_message_id"]
    )
    for statement in BACKFILL:
        op.execute(statement)
    if postgres:
        op.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
        op.execute(PG_FUNCTION)
        for statement in PG_TRIGGERS:
            op.execute(statement)
        op.execute(
            "CREATE INDEX idx_mail_subject_trgm ON mail_send_subject "
            "USING gin (subject gin_trgm_ops)"
        )
        op.execute(
            "CREATE INDEX idx_mail_recipient_trgm ON mail_send_recipient "
            "USING gin (address gin_trgm_ops)"
        )
    else:
        for statement in SQLITE_TRIGGERS:
            op.execute(statement)
        # No trigrams on SQLite: plain indexes of the same names keep one model for both.
        op.create_index("idx_mail_subject_trgm", "mail_send_subject", ["subject"])
        op.create_index("idx_mail_recipient_trgm", "mail_send_recipient", ["address"])


def downgrade():
    postgres = op.get_bind().dialect.name == "postgresql"
    op.execute("DROP TRIGGER IF EXISTS mail_send_record_subject_insert"
               + (" ON mail_send_record" if postgres else ""))
    op.execute("DROP TRIGGER IF EXISTS mail_send_record_subject_render"
               + (" ON mail_send_record" if postgres else ""))
    if postgres:
        op.execute("DROP FUNCTION IF EXISTS mail_subject_index()")
    op.drop_index("idx_mail_recipient_trgm", table_name="mail_send_recipient")
    op.drop_index("idx_send_attempt_provider_message", table_name="send_attempt")
    op.drop_table("recipient_token")
    op.drop_table("mail_send_subject")
    op.drop_column("tenant", "country")
