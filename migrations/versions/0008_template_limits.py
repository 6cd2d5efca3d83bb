"""Templates over the new limits

Re-checks every stored template against the limits checked before parsing (size, tags,
expression tokens, path segments, nesting) and lists those now over them, with the tenant,
the code, the part and the limit. Nothing is changed: a listed template keeps sending while
within twice the limits (beyond that it fails at send, before any parse, with
TEMPLATE_NOT_RESOLVABLE), and must be brought within them when it is next saved.

Revision ID: r0008
Revises: r0007
Create Date: 2026-12-01 18:00:00

"""
import logging

import sqlalchemy as sa
from alembic import op

from portal.messaging.templating.rendering import configured_limits, limit_problems

# revision identifiers, used by Alembic.
revision = 'r0008'
down_revision = 'r0007'
branch_labels = None
depends_on = None

log = logging.getLogger("alembic.runtime.migration")

_PARTS = {
    "mail": ("mail_template", ("subject", "html_body", "text_body")),
    "sms": ("sms_template", ("content",)),
}


def over_limits(connection: sa.Connection) -> list[str]:
    """One line per stored template part over the limits."""
    limits = configured_limits()
    lines = []
    for channel, (table, parts) in _PARTS.items():
        columns = ", ".join(f"t.{part}" for part in parts)
        rows = connection.execute(
            sa.text(
                f"SELECT n.slug, t.code, {columns} FROM {table} t "
                "JOIN tenant n ON n.id = t.tenant_id ORDER BY n.slug, t.code"
            )
        )
        for slug, code, *sources in rows:
            for part, source in zip(parts, sources, strict=True):
                for problem in limit_problems(source, limits=limits) if source else ():
                    where = f"{channel} template {code!r} of tenant {slug!r}, {part}"
                    lines.append(f"{where}: {problem}")
    return lines


def upgrade():
    lines = over_limits(op.get_bind())
    for line in lines:
        log.warning("over the template limits (fix at its next save): %s", line)
    if lines:
        log.warning("%d template part(s) over the limits", len(lines))


def downgrade():
    pass
