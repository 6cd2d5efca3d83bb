"""An address prefix typed in the search box walks the recipient btree

``carol@`` was looked up in the trigram index of mail_send_recipient.address, whose trigrams
("car", "aro", ... and above all the "use", "ser" of every ``user...@`` address) are shared by
most rows: bench/pages.py read 1,139 index pages for one prefix at 1M records, ten times the
work of 100k. ``idx_mail_recipient_search (tenant_id, address, record_id)`` is rebuilt with
``varchar_pattern_ops`` on the address: it still serves every ``address = ...`` lookup (the
operator class has equality), and now also ``address LIKE 'carol@%'`` as a range of the index
whatever the database's collation. Same table (insert-only), same number of indexes; built
CONCURRENTLY under a new name, then swapped. SQLite has no operator classes: nothing to do.

Revision ID: r0027
Revises: r0026
Create Date: 2026-12-02 05:40:00

"""
from alembic import op

# revision identifiers, used by Alembic.
revision = 'r0027'
down_revision = 'r0026'
branch_labels = None
depends_on = None

NAME = "idx_mail_recipient_search"
COLUMNS = ["tenant_id", "address", "record_id"]


def _rebuild(ops: dict[str, str]) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    with op.get_context().autocommit_block():
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {NAME}_new")
        op.create_index(
            f"{NAME}_new",
            "mail_send_recipient",
            COLUMNS,
            postgresql_ops=ops,
            postgresql_concurrently=True,
        )
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {NAME}")
        op.execute(f"ALTER INDEX {NAME}_new RENAME TO {NAME}")


def upgrade():
    _rebuild({"address": "varchar_pattern_ops"})


def downgrade():
    _rebuild({})
