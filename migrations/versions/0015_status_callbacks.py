"""Status callbacks: endpoints, deliveries, the triggers that write them, request metadata

``callback_delivery`` rows are written by the database in the statement that changes a
record's status: an AFTER trigger per record table inserts one row per enabled endpoint of
the record's tenant subscribed to the event, and nothing when there is none. Every status
write (acceptance, claim outcomes, cancel, resolve, retry, sweep, delivery events, bounces,
read receipts) is covered without touching its code, and an event is written in the
transaction of the change that causes it, exactly once.

The UPDATE trigger's WHEN clause lets the delivery loop's own transitions (to Sending and to
Retry) through without calling the function at all. On PostgreSQL acceptance's INSERT is a
statement trigger over the transition table: one call per batch, not per row.

Event names: ``<channel>.<new status>`` (Pending is ``queued``) or, when a delivery outcome
changes, ``<channel>.<outcome>`` alone (a bounce that turns Sent into Failed is ``bounced``);
``mail.read`` when a read receipt first sets ``read_at``.

Revision ID: r0015
Revises: r0014
Create Date: 2026-12-01 19:30:00

"""
import sqlalchemy as sa
from alembic import op

from portal.models.base import now_default

# revision identifiers, used by Alembic.
revision = 'r0015'
down_revision = 'r0014'
branch_labels = None
depends_on = None

RECORDS = {"mail": "mail_send_record", "sms": "sms_send_record"}
STATUS_EVENT = (
    "CASE {s} WHEN 'Pending' THEN 'queued' WHEN 'Sent' THEN 'sent' WHEN 'Failed' THEN 'failed' "
    "WHEN 'DeadLetter' THEN 'dead_letter' WHEN 'Uncertain' THEN 'uncertain' "
    "WHEN 'Suppressed' THEN 'suppressed' WHEN 'Cancelled' THEN 'cancelled' END"
)
COLUMNS = (
    "tenant_id, endpoint_id, channel, record_id, event_type, sequence, payload, occurred_at, "
    "status, attempts, next_attempt_at, created_time"
)


def _pg_payload(row: str, seq: str) -> str:
    return (
        f"json_build_object('id', {row}.id, 'channel', ch, 'status', {row}.status, "
        f"'businessKey', {row}.business_key, 'errorCode', {row}.error_code, "
        f"'errorMessage', {row}.error_message, 'providerMessageId', {row}.provider_message_id, "
        f"'metadata', {row}.metadata, 'occurredAt', to_char(statement_timestamp() AT TIME ZONE "
        f"'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), 'sequence', {seq})"
    )


PG_FUNCTIONS = f"""
CREATE FUNCTION callback_enqueue_change() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  ch text := TG_ARGV[0];
  ev text;
  seq integer;
BEGIN
  IF NEW.delivery_outcome IS DISTINCT FROM OLD.delivery_outcome
     AND NEW.delivery_outcome IS NOT NULL THEN
    ev := NEW.delivery_outcome;
  ELSIF NEW.status IS DISTINCT FROM OLD.status THEN
    ev := {STATUS_EVENT.format(s="NEW.status")};
  ELSIF ch = 'mail' THEN
    IF OLD.read_at IS NULL AND NEW.read_at IS NOT NULL THEN
      ev := 'read';
    END IF;
  END IF;
  IF ev IS NULL THEN
    RETURN NULL;
  END IF;
  ev := ch || '.' || ev;
  PERFORM 1 FROM callback_endpoint e
    WHERE e.tenant_id = NEW.tenant_id AND e.enabled AND strpos(e.events, ',' || ev || ',') > 0;
  IF NOT FOUND THEN
    RETURN NULL;
  END IF;
  SELECT coalesce(max(d.sequence), 0) + 1 INTO seq FROM callback_delivery d
    WHERE d.channel = ch AND d.record_id = NEW.id;
  INSERT INTO callback_delivery ({COLUMNS})
  SELECT NEW.tenant_id, e.id, ch, NEW.id, ev, seq, {_pg_payload("NEW", "seq")},
         statement_timestamp(), 'pending', 0, statement_timestamp(), statement_timestamp()
    FROM callback_endpoint e
    WHERE e.tenant_id = NEW.tenant_id AND e.enabled AND strpos(e.events, ',' || ev || ',') > 0;
  RETURN NULL;
END
$$;

CREATE FUNCTION callback_enqueue_insert() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  ch text := TG_ARGV[0];
BEGIN
  INSERT INTO callback_delivery ({COLUMNS})
  SELECT n.tenant_id, e.id, ch, n.id, ev.name, 1, {_pg_payload("n", "1")},
         statement_timestamp(), 'pending', 0, statement_timestamp(), statement_timestamp()
    FROM new_rows n
    CROSS JOIN LATERAL (SELECT ch || '.' || {STATUS_EVENT.format(s="n.status")} AS name) ev
    JOIN callback_endpoint e
      ON e.tenant_id = n.tenant_id AND e.enabled AND strpos(e.events, ',' || ev.name || ',') > 0
    WHERE ev.name IS NOT NULL;
  RETURN NULL;
END
$$;
"""


def _changed(channel: str, distinct: str) -> str:
    """The UPDATE trigger's WHEN: a change that is an event (not to Sending or Retry)."""
    parts = [
        f"(OLD.status {distinct} NEW.status AND NEW.status NOT IN ('Sending', 'Retry'))",
        f"(OLD.delivery_outcome {distinct} NEW.delivery_outcome "
        "AND NEW.delivery_outcome IS NOT NULL)",
    ]
    if channel == "mail":
        parts.append("(OLD.read_at IS NULL AND NEW.read_at IS NOT NULL)")
    return " OR ".join(parts)


def _watched(channel: str) -> str:
    return "status, delivery_outcome" + (", read_at" if channel == "mail" else "")


def _pg_triggers(channel: str, table: str) -> list[str]:
    return [
        f"CREATE TRIGGER {table}_callback_change AFTER UPDATE OF {_watched(channel)} ON {table} "
        f"FOR EACH ROW WHEN ({_changed(channel, 'IS DISTINCT FROM')}) "
        f"EXECUTE FUNCTION callback_enqueue_change('{channel}')",
        f"CREATE TRIGGER {table}_callback_insert AFTER INSERT ON {table} "
        "REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT "
        f"EXECUTE FUNCTION callback_enqueue_insert('{channel}')",
    ]


SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"


def _sqlite_select(channel: str, event: str, seq: str) -> str:
    payload = (
        f"json_object('id', NEW.id, 'channel', '{channel}', 'status', NEW.status, "
        "'businessKey', NEW.business_key, 'errorCode', NEW.error_code, "
        "'errorMessage', NEW.error_message, 'providerMessageId', NEW.provider_message_id, "
        "'metadata', json(NEW.metadata), "
        f"'occurredAt', strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), 'sequence', {seq})"
    )
    return (
        f"INSERT INTO callback_delivery ({COLUMNS}) "
        f"SELECT NEW.tenant_id, e.id, '{channel}', NEW.id, ev.name, {seq}, {payload}, "
        f"{SQLITE_NOW}, 'pending', 0, {SQLITE_NOW}, {SQLITE_NOW} "
        f"FROM (SELECT '{channel}.' || ({event}) AS name) ev "
        "JOIN callback_endpoint e ON e.tenant_id = NEW.tenant_id AND e.enabled "
        "AND instr(e.events, ',' || ev.name || ',') > 0 "
        "WHERE ev.name IS NOT NULL;"
    )


def _sqlite_triggers(channel: str, table: str) -> list[str]:
    change_event = (
        "CASE WHEN OLD.delivery_outcome IS NOT NEW.delivery_outcome "
        "AND NEW.delivery_outcome IS NOT NULL THEN NEW.delivery_outcome "
        f"WHEN OLD.status IS NOT NEW.status THEN {STATUS_EVENT.format(s='NEW.status')} "
        + ("ELSE 'read' " if channel == "mail" else "")
        + "END"
    )
    seq = (
        f"(SELECT coalesce(max(d.sequence), 0) + 1 FROM callback_delivery d "
        f"WHERE d.channel = '{channel}' AND d.record_id = NEW.id)"
    )
    return [
        f"CREATE TRIGGER {table}_callback_change AFTER UPDATE OF {_watched(channel)} ON {table} "
        f"FOR EACH ROW WHEN {_changed(channel, 'IS NOT')} BEGIN "
        f"{_sqlite_select(channel, change_event, seq)} END",
        f"CREATE TRIGGER {table}_callback_insert AFTER INSERT ON {table} FOR EACH ROW BEGIN "
        f"{_sqlite_select(channel, STATUS_EVENT.format(s='NEW.status'), '1')} END",
    ]


def upgrade():
    now = now_default(op.get_bind().dialect.name)
    for table in RECORDS.values():
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("metadata", sa.JSON(), nullable=True))
    op.create_table(
        "callback_endpoint",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("tenant_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("events", sa.Text(), nullable=False),
        sa.Column("enabled", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column("secret_encrypted", sa.Text(), nullable=False),
        sa.Column("previous_secret_encrypted", sa.Text(), nullable=True),
        sa.Column("previous_secret_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("consecutive_failures", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("paused_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_time", sa.DateTime(timezone=True), server_default=now, nullable=False),
        sa.Column("updated_time", sa.DateTime(timezone=True), server_default=now, nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_callback_endpoint_tenant_id_tenant")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_callback_endpoint")),
        sa.UniqueConstraint("tenant_id", "name", name=op.f("uq_callback_endpoint_tenant_id_name")),
    )
    op.create_table(
        "callback_delivery",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("tenant_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("endpoint_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("channel", sa.String(length=8), nullable=True),
        sa.Column("record_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("event_type", sa.String(length=32), nullable=False),
        sa.Column("sequence", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("occurred_at", sa.DateTime(timezone=True), server_default=now, nullable=False),
        sa.Column("status", sa.String(length=16), server_default=sa.text("'pending'"), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), server_default=now, nullable=False),
        sa.Column("retry_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_attempt_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("last_duration_ms", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_time", sa.DateTime(timezone=True), server_default=now, nullable=False),
        sa.ForeignKeyConstraint(
            ["endpoint_id"],
            ["callback_endpoint.id"],
            name=op.f("fk_callback_delivery_endpoint_id_callback_endpoint"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_callback_delivery")),
        sqlite_autoincrement=True,
    )
    where = sa.text("status IN ('pending', 'sending')")
    op.create_index(
        "idx_callback_delivery_due",
        "callback_delivery",
        ["next_attempt_at"],
        postgresql_where=where,
        sqlite_where=where,
    )
    op.create_index(
        "idx_callback_delivery_record", "callback_delivery", ["channel", "record_id", "id"]
    )
    op.create_index("idx_callback_delivery_endpoint", "callback_delivery", ["endpoint_id", "id"])
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        op.execute(PG_FUNCTIONS)
        for channel, table in RECORDS.items():
            for sql in _pg_triggers(channel, table):
                op.execute(sql)
    else:
        for channel, table in RECORDS.items():
            for sql in _sqlite_triggers(channel, table):
                op.execute(sql)


def downgrade():
    bind = op.get_bind()
    for table in RECORDS.values():
        for suffix in ("change", "insert"):
            if bind.dialect.name == "postgresql":
                op.execute(f"DROP TRIGGER IF EXISTS {table}_callback_{suffix} ON {table}")
            else:
                op.execute(f"DROP TRIGGER IF EXISTS {table}_callback_{suffix}")
    if bind.dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS callback_enqueue_change()")
        op.execute("DROP FUNCTION IF EXISTS callback_enqueue_insert()")
    op.drop_index("idx_callback_delivery_endpoint", table_name="callback_delivery")
    op.drop_index("idx_callback_delivery_record", table_name="callback_delivery")
    op.drop_index("idx_callback_delivery_due", table_name="callback_delivery")
    op.drop_table("callback_delivery")
    op.drop_table("callback_endpoint")
    for table in RECORDS.values():
        with op.batch_alter_table(table) as batch:
            batch.drop_column("metadata")
