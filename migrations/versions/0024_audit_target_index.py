"""A record's timeline reads the audit rows that name it

``idx_audit_event_target (target_type, target_id)``: the record page finds the retries,
cancels, resolutions and dead-letter triage of one record without reading its tenant's whole
audit log. Built CONCURRENTLY on PostgreSQL.

Revision ID: r0024
Revises: r0023
Create Date: 2026-12-01 23:30:00

"""
from alembic import op

# revision identifiers, used by Alembic.
revision = 'r0024'
down_revision = 'r0023'
branch_labels = None
depends_on = None


def upgrade():
    if op.get_bind().dialect.name == "postgresql":
        with op.get_context().autocommit_block():
            op.create_index(
                "idx_audit_event_target",
                "audit_event",
                ["target_type", "target_id"],
                postgresql_concurrently=True,
            )
    else:
        op.create_index("idx_audit_event_target", "audit_event", ["target_type", "target_id"])


def downgrade():
    op.drop_index("idx_audit_event_target", table_name="audit_event")
