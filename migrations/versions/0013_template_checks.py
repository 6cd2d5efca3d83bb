"""Template checks at acceptance

Mail and SMS templates get ``strict_variables``: a strict template refuses at acceptance a
send that lacks a variable it needs (422 ``missing_variables``). Templates that exist when
this migration runs keep today's behaviour (off: a missing value renders blank), so their
live callers keep working; templates created from now on are strict (the model's default).
They also get ``sample_variables`` (the editor's samples, kept with the template). A
column with a constant default is only a catalogue change on PostgreSQL.

Revision ID: r0013
Revises: r0012
Create Date: 2026-12-01 19:30:00

"""
import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision = 'r0013'
down_revision = 'r0012'
branch_labels = None
depends_on = None

TEMPLATES = ("mail_template", "sms_template")


def upgrade():
    for table in TEMPLATES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(
                sa.Column(
                    "strict_variables",
                    sa.Boolean(),
                    nullable=False,
                    server_default=sa.text("false"),
                )
            )
            batch.add_column(sa.Column("sample_variables", sa.JSON(), nullable=True))


def downgrade():
    for table in TEMPLATES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("sample_variables")
            batch.drop_column("strict_variables")
