"""Template versions

``template_version``: every save of a template is an immutable row (both channels, the whole
content as JSON); ``template_blob``: attachment bytes stored once by SHA-256. Each existing
template gets one version, numbered with its current ``version``, holding what it is now
(its attachments moved to blobs by hash). Send records get ``template_version`` (the
version they were prepared with; null before preparation) and ``is_test`` (a test send from
the editor). Both record columns are catalogue-only changes on PostgreSQL.

Revision ID: r0014
Revises: r0013
Create Date: 2026-12-01 19:35:00

"""
import base64
import hashlib
import json

import sqlalchemy as sa
from alembic import op

from portal.models.base import now_default

# revision identifiers, used by Alembic.
revision = 'r0014'
down_revision = 'r0013'
branch_labels = None
depends_on = None

RECORDS = ("mail_send_record", "sms_send_record")


def upgrade():
    big = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    now = now_default(op.get_bind().dialect.name)
    op.create_table(
        "template_version",
        sa.Column("id", big, primary_key=True, autoincrement=True),
        sa.Column("tenant_id", big, sa.ForeignKey("tenant.id"), nullable=False),
        sa.Column("channel", sa.String(8), nullable=False),
        sa.Column("template_id", big, nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("author", sa.String(320), nullable=True),
        sa.Column("remark", sa.Text(), nullable=True),
        sa.Column("content", sa.JSON(), nullable=False),
        sa.Column(
            "created_time",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=now,
        ),
        sa.UniqueConstraint("channel", "template_id", "number", name="uq_template_version_number"),
    )
    op.create_index(
        "idx_template_version_tenant", "template_version", ["tenant_id", "channel", "template_id"]
    )
    op.create_table(
        "template_blob",
        sa.Column("sha256", sa.String(64), primary_key=True),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column(
            "created_time",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=now,
        ),
    )
    for table in RECORDS:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("template_version", sa.Integer(), nullable=True))
            batch.add_column(
                sa.Column("is_test", sa.Boolean(), nullable=False, server_default=sa.text("false"))
            )
    _first_versions()


def _first_versions():
    """One version per existing template: what it holds now, under its current number."""
    bind = op.get_bind()
    blobs = {}
    versions = []
    mail = bind.execute(
        sa.text(
            "SELECT id, tenant_id, version, subject, html_body, text_body, reply_to, priority, "
            "preferred_server_id, stream, strict_variables, attachments FROM mail_template"
        )
    ).mappings()
    for row in mail:
        attachments = row["attachments"]
        if isinstance(attachments, str):
            attachments = json.loads(attachments)
        files = []
        for item in attachments or []:
            content = str(item.get("content") or "")
            raw = base64.b64decode(content) if content else b""
            digest = hashlib.sha256(raw).hexdigest()
            blobs[digest] = (content, len(raw))
            files.append(
                {"name": item.get("name"), "contentType": item.get("contentType"), "sha256": digest}
            )
        content = {
            "subject": row["subject"],
            "html_body": row["html_body"],
            "text_body": row["text_body"],
            "reply_to": row["reply_to"],
            "priority": row["priority"],
            "preferred_server_id": row["preferred_server_id"],
            "stream": row["stream"],
            "strict_variables": bool(row["strict_variables"]),
            "attachments": files,
        }
        versions.append(("mail", row, content))
    sms = bind.execute(
        sa.text(
            "SELECT id, tenant_id, version, content, stream, strict_variables FROM sms_template"
        )
    ).mappings()
    for row in sms:
        content = {
            "content": row["content"],
            "stream": row["stream"],
            "strict_variables": bool(row["strict_variables"]),
        }
        versions.append(("sms", row, content))
    for digest, (content, size) in blobs.items():
        bind.execute(
            sa.text("INSERT INTO template_blob (sha256, content, size) VALUES (:h, :c, :s)"),
            {"h": digest, "c": content, "s": size},
        )
    for channel, row, content in versions:
        bind.execute(
            sa.text(
                "INSERT INTO template_version (tenant_id, channel, template_id, number, author, "
                "remark, content) VALUES (:t, :ch, :id, :n, NULL, :r, :c)"
            ),
            {
                "t": row["tenant_id"],
                "ch": channel,
                "id": row["id"],
                "n": row["version"],
                "r": "as it was when versions began",
                "c": json.dumps(content),
            },
        )


def downgrade():
    for table in RECORDS:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("is_test")
            batch.drop_column("template_version")
    op.drop_table("template_blob")
    op.drop_index("idx_template_version_tenant", table_name="template_version")
    op.drop_table("template_version")
