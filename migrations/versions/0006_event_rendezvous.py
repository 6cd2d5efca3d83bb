"""Delivery events and Sent writes meet under one lock (PostgreSQL)

The Sent write used to look for events that arrived before the provider id was written in a
second statement after its commit (one more round trip per send). Now the Sent statement asks
``postroom_waiting_events`` in its RETURNING: it takes the transaction-level advisory lock of
(channel, route, provider id), which a webhook takes too before it stores an event for that id,
and only then looks, with a fresh snapshot (a VOLATILE function's statements each take one).
Either the webhook stored and committed first (the look sees its event) or the Sent write
holds the lock until it commits (the webhook waits, then finds the record by its provider id).
The Sent write takes the lock in its WHERE, before its row lock: a webhook holding the lock
may update the same record (a resend under the same Message-ID), and the other order could
deadlock. SQLite needs neither: its writes never overlap.

Revision ID: r0006
Revises: r0005
Create Date: 2026-12-02 09:00:00

"""
from alembic import op

# revision identifiers, used by Alembic.
revision = 'r0006'
down_revision = 'r0005'
branch_labels = None
depends_on = None


def upgrade():
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        """
        CREATE OR REPLACE FUNCTION postroom_event_lock(p_channel text, p_route bigint, p_pmid text)
        RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
        BEGIN
            IF p_pmid IS NOT NULL THEN
                PERFORM pg_advisory_xact_lock(hashtextextended(
                    'postroom-event:' || p_channel || ':' || coalesce(p_route, 0) || ':' || p_pmid,
                    0));
            END IF;
            RETURN true;
        END
        $$
        """
    )
    op.execute(
        """
        CREATE OR REPLACE FUNCTION postroom_waiting_events(
            p_channel text, p_route bigint, p_pmid text
        ) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
        BEGIN
            -- The caller holds the event lock already (the Sent write's WHERE takes it), so
            -- this look, with its own fresh snapshot, cannot overlap a webhook's store.
            IF p_pmid IS NULL OR p_route IS NULL THEN
                RETURN false;
            END IF;
            RETURN EXISTS (
                SELECT 1 FROM delivery_event
                WHERE channel = p_channel AND config_id = p_route
                  AND provider_message_id = p_pmid AND record_id IS NULL
            );
        END
        $$
        """
    )


def downgrade():
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP FUNCTION IF EXISTS postroom_waiting_events(text, bigint, text)")
    op.execute("DROP FUNCTION IF EXISTS postroom_event_lock(text, bigint, text)")
