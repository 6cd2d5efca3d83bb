"""The suppression lookup rides on the claim

Every attempt looked its recipients up in the tenant's suppression list in a statement of its
own, the configuration epoch riding on it (``preparation.suppressed_recipients``): one round
trip per record, a tenth of a mail's time at one worker (bench/smtp.py). The claim now returns
the same two things beside the record it claims, computed from that record's columns in its
RETURNING list:

- ``postroom_mail_suppression_hits(tenant, to, cc, bcc)`` /
  ``postroom_sms_suppression_hits(tenant, phone)``: the active suppressions of the record's
  recipients, as the lookup reads them (the address and its ``sha256:`` form, for a forgotten
  recipient's), as JSON text ``[[address, reason, "YYYY-MM-DD HH:MI" UTC, created_by, detail],
  ...]`` in id order, or NULL when there are none (the common case: nothing to parse).
- the epoch, a scalar subquery of its own in the claim.

A mail address is looked up lower-cased as ASCII (``lower(... COLLATE "C")``): the worker uses
the answer only when every recipient is written so that this is its normal form (ASCII, no
surrounding blanks or angle brackets: ``suppression.normalise`` then only lower-cases it), and
looks the rest up as before. One index probe of ``idx_suppression_lookup`` per key.

Revision ID: r0028
Revises: r0027
Create Date: 2026-12-02 08:45:00

"""
from alembic import op

# revision identifiers, used by Alembic.
revision = 'r0028'
down_revision = 'r0027'
branch_labels = None
depends_on = None

FUNCTIONS = """
CREATE OR REPLACE FUNCTION postroom_suppression_hits(
  p_tenant bigint, p_channel text, p_keys text[])
RETURNS text LANGUAGE plpgsql STABLE AS $$
BEGIN
  RETURN (
    SELECT json_agg(json_build_array(
             s.address, s.reason, to_char(s.created_time AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI'),
             s.created_by, s.detail) ORDER BY s.id)::text
    FROM suppression s
    WHERE s.tenant_id = p_tenant AND s.channel = p_channel AND s.removed_at IS NULL
      AND s.address = ANY (p_keys || ARRAY(
        SELECT 'sha256:' || encode(sha256(convert_to(k, 'UTF8')), 'hex') FROM unnest(p_keys) k)));
END $$;

CREATE OR REPLACE FUNCTION postroom_mail_suppression_hits(
  p_tenant bigint, p_to json, p_cc json, p_bcc json)
RETURNS text LANGUAGE plpgsql STABLE AS $$
DECLARE
  keys text[];
BEGIN
  SELECT array_agg(DISTINCT lower(e COLLATE "C")) INTO keys
    FROM unnest(ARRAY[p_to, p_cc, p_bcc]) a,
         json_array_elements_text(CASE WHEN json_typeof(a) = 'array' THEN a ELSE '[]'::json END) e;
  RETURN postroom_suppression_hits(p_tenant, 'mail', keys);
END $$;

CREATE OR REPLACE FUNCTION postroom_sms_suppression_hits(p_tenant bigint, p_phone text)
RETURNS text LANGUAGE plpgsql STABLE AS $$
BEGIN
  IF p_phone IS NULL THEN
    RETURN NULL;
  END IF;
  RETURN postroom_suppression_hits(p_tenant, 'sms', ARRAY[p_phone]);
END $$;
"""


def upgrade():
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite: the worker looks its recipients up in a statement of their own
    op.execute(FUNCTIONS)


def downgrade():
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP FUNCTION IF EXISTS postroom_sms_suppression_hits(bigint, text)")
    op.execute("DROP FUNCTION IF EXISTS postroom_mail_suppression_hits(bigint, json, json, json)")
    op.execute("DROP FUNCTION IF EXISTS postroom_suppression_hits(bigint, text, text[])")
