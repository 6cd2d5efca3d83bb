"""The single-record claim as a PL/pgSQL function

Every busy worker's next claim (in the Sent write, and ``claim_due`` with k = 1) picks the next
record in the fair order: the stream first (transactional, then broadcast), within it the
tenants' turn after the last claim's tenant, Pending and due Retry merged by that turn. As one
SQL statement that pick had about 60 plan nodes (both streams' Pending turn, the Retry turn
walk, the oldest due Retry, the merge), and PostgreSQL sets up every node of a plan at every
run, used or not: 0.17 ms a record, 30 % of the bare loop's statement (bench/claim.py). The
function runs only the probes a claim needs, each a small plan cached once per connection:
0.02 ms over the oldest-first pick.

``postroom_claim_one_<table>(cur, with_broadcast)`` returns the id it locked (FOR UPDATE SKIP
LOCKED, so the caller's UPDATE of it never waits) or NULL. ``cur``: the tenant the turn goes
on from. Per stream, in order, until one is found:

- Pending in the tenants' turn: the first tenant after ``cur`` with a Pending record of the
  stream it can lock, its oldest (``idx_*_pending_fair``); wrapping round to the lowest
  tenant up to ``cur`` when there is none after it.
- Due Retry, only when one is due (one probe of ``idx_*_retry_due``): the tenants with Retry
  records after ``cur`` are walked along ``idx_*_retry_fair``, one probe per tenant reading
  its earliest retry, until one is due (looking past at most 8 tenants whose retries are all
  still to come); that tenant's oldest due one; when none is found that way, the oldest due
  retry of any tenant.
- Between the two: the one whose tenant comes first in the turn after ``cur``, then the one
  due longer. The other stays locked until the caller's transaction ends (a moment).

Revision ID: r0022
Revises: r0021
Create Date: 2026-12-01 22:55:00

"""
from alembic import op

# revision identifiers, used by Alembic.
revision = 'r0022'
down_revision = 'r0021'
branch_labels = None
depends_on = None

TABLES = ("mail_send_record", "sms_send_record")
RETRY_TURN_PROBES = 8

STREAM = """
  -- {stream}: Pending in the tenants' turn, after cur, else from the lowest tenant up to cur.
  SELECT r.id, r.tenant_id, r.updated_time INTO p_id, p_tid, p_due FROM {table} r
   WHERE r.status = 'Pending' AND r.stream = '{stream}' AND r.tenant_id > cur
   ORDER BY r.tenant_id, r.updated_time LIMIT 1 FOR UPDATE SKIP LOCKED;
  IF p_id IS NULL THEN
    SELECT r.id, r.tenant_id, r.updated_time INTO p_id, p_tid, p_due FROM {table} r
     WHERE r.status = 'Pending' AND r.stream = '{stream}' AND r.tenant_id <= cur
     ORDER BY r.tenant_id, r.updated_time LIMIT 1 FOR UPDATE SKIP LOCKED;
  END IF;
  r_id := NULL;
  IF EXISTS (SELECT 1 FROM {table} r WHERE r.status = 'Retry' AND r.stream = '{stream}'
             AND r.next_retry_at <= now()) THEN
    -- Due Retry in the tenants' turn: the first tenant after cur whose earliest retry is due.
    w_tid := cur;
    FOR probe IN 1..{probes} LOOP
      SELECT r.tenant_id, r.next_retry_at INTO w_tid, w_due FROM {table} r
       WHERE r.status = 'Retry' AND r.stream = '{stream}' AND r.tenant_id > w_tid
       ORDER BY r.tenant_id, r.next_retry_at LIMIT 1;
      EXIT WHEN NOT FOUND OR w_due <= now();
    END LOOP;
    IF w_due <= now() THEN  -- NULL when the walk ran out of tenants
      SELECT r.id, r.tenant_id, r.next_retry_at INTO r_id, r_tid, r_due FROM {table} r
       WHERE r.status = 'Retry' AND r.stream = '{stream}' AND r.tenant_id = w_tid
         AND r.next_retry_at <= now()
       ORDER BY r.next_retry_at LIMIT 1 FOR UPDATE SKIP LOCKED;
    END IF;
    IF r_id IS NULL THEN
      SELECT r.id, r.tenant_id, r.next_retry_at INTO r_id, r_tid, r_due FROM {table} r
       WHERE r.status = 'Retry' AND r.stream = '{stream}' AND r.next_retry_at <= now()
       ORDER BY r.next_retry_at LIMIT 1 FOR UPDATE SKIP LOCKED;
    END IF;
  END IF;
  IF p_id IS NOT NULL AND r_id IS NOT NULL THEN
    -- The tenant whose turn comes first after cur, then the one due longer.
    IF (r_tid <= cur, r_tid, r_due) < (p_tid <= cur, p_tid, p_due) THEN
      RETURN r_id;
    END IF;
    RETURN p_id;
  END IF;
  IF coalesce(p_id, r_id) IS NOT NULL THEN
    RETURN coalesce(p_id, r_id);
  END IF;
"""

FUNCTION = """
CREATE OR REPLACE FUNCTION postroom_claim_one_{table}(cur bigint, with_broadcast boolean)
RETURNS bigint LANGUAGE plpgsql VOLATILE AS $claim$
DECLARE
  p_id bigint; p_tid bigint; p_due timestamptz;
  r_id bigint; r_tid bigint; r_due timestamptz;
  w_tid bigint; w_due timestamptz;
BEGIN
{transactional}
  IF NOT with_broadcast THEN
    RETURN NULL;
  END IF;
{broadcast}
  RETURN NULL;
END
$claim$;
"""


def function_sql(table: str) -> str:
    def stream(name: str) -> str:
        return STREAM.format(table=table, stream=name, probes=RETRY_TURN_PROBES)

    return FUNCTION.format(
        table=table, transactional=stream("transactional"), broadcast=stream("broadcast")
    )


def upgrade():
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite: one writer at a time, and its claim is plain SQL (portal.messaging.sending.claim)
    for table in TABLES:
        op.execute(function_sql(table))


def downgrade():
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TABLES:
        op.execute(f"DROP FUNCTION IF EXISTS postroom_claim_one_{table}(bigint, boolean)")
