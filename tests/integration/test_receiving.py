"""Seed 001's "Receiving" test points, against a real IMAP server (our own Dovecot), real
PostgreSQL and mail records sent through the real pipeline: a bounce turns the matching Sent
record into Failed with its code and suppresses the address; a read receipt records the read
time; the same mail fetched twice is stored once. Plus the mailbox rules: read-only,
a UID watermark with UIDVALIDITY resets, 100 messages a run, a broken message never blocking
the rest, size limits, tenant isolation, and the fetch chore's schedule."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import pytest
import redis
from flask import Flask
from rq_scheduler import Scheduler
from sqlalchemy import func, select

from portal.delivery.chores import PREFIX, QUEUE, ensure_schedules
from portal.extensions import db
from portal.messaging.after_send import suppression
from portal.messaging.after_send.receiving.fetch import (
    MAX_MESSAGE_BYTES,
    UNREADABLE_PASSWORD,
    FetchLimits,
    FetchReport,
    fetch_all,
    record_run,
)
from portal.models import (
    Channel,
    MailReceiveConfig,
    MailReceiveState,
    ReceivedMail,
    Suppression,
)
from portal.tenancy import PLATFORM_TENANT_ID
from tests.conftest import TEST_DATABASE_URL, TEST_REDIS_URL, settings_for_tests
from tests.support.delivery import accept_mail, drain, mail_server, record, tenant
from tests.support.imap_server import DovecotServer, ImapUser
from tests.support.smtp_server import ScriptedSmtpServer
from tests.support.workers import ROOT, worker_env

DATA = Path(__file__).resolve().parent.parent / "data"
PLACEHOLDER = b"<mail-1234@acme-smtp.test>"  # the original's Message-ID in the samples


# --- fixtures and helpers --------------------------------------------------------------------


@pytest.fixture(scope="module")
def dovecot() -> Iterator[DovecotServer]:
    with DovecotServer() as server:
        yield server


@pytest.fixture
def mailbox(dovecot: DovecotServer) -> ImapUser:
    return dovecot.add_user()


@pytest.fixture
def acme(app: Flask, smtp: ScriptedSmtpServer) -> int:
    row = tenant("acme")
    mail_server(row.id, smtp, name="acme-smtp")
    db.session.commit()
    return row.id


def receive_config(
    tenant_id: int,
    user: ImapUser,
    *,
    name: str = "bounces",
    security: str = "plain",
    folder: str = "INBOX",
    verify_tls: bool = False,
    enabled: bool = True,
) -> int:
    port = user.server.imaps_port if security == "ssl" else user.server.imap_port
    config = MailReceiveConfig(
        tenant_id=tenant_id,
        name=name,
        host="127.0.0.1",
        port=port,
        security=security,
        verify_tls=verify_tls,
        username=user.name,
        folder=folder,
        enabled=enabled,
    )
    config.secret = user.password
    db.session.add(config)
    db.session.commit()
    return config.id


@dataclass(frozen=True)
class SentMail:
    """A record as it was once Sent (the ORM row itself is refreshed by later reads)."""

    id: int
    version: int
    message_id_header: str


def sent(app: Flask, tenant_id: int, to: str = "ann@example.com") -> SentMail:
    """A mail accepted and sent through the real pipeline: its Message-ID is the real one."""
    rid = accept_mail(app, tenant_id, to=[to])
    drain(app)
    row = record(rid)
    assert row.status == "Sent", (row.status, row.error_code, row.error_message)
    assert row.message_id_header is not None
    return SentMail(row.id, row.version, row.message_id_header)


def sample(name: str, about: SentMail | None = None, **replace: str) -> bytes:
    raw = (DATA / name).read_bytes()
    if about is not None:
        raw = raw.replace(PLACEHOLDER, about.message_id_header.encode())
    for old, new in replace.items():
        raw = raw.replace(old.encode(), new.encode())
    return raw


def fetch(**limits: Any) -> FetchReport:
    db.session.rollback()  # the test's reads end here: on SQLite an open one holds the lock
    limits.setdefault("settings", settings_for_tests(TEST_DATABASE_URL))  # tenants may reach 127.*
    report = fetch_all(db.engine, FetchLimits(**limits))
    db.session.expire_all()
    return report


def received(config_id: int) -> list[ReceivedMail]:
    db.session.expire_all()
    return list(
        db.session.scalars(
            select(ReceivedMail)
            .where(ReceivedMail.config_id == config_id)
            .order_by(ReceivedMail.id)
        )
    )


def watermark(config_id: int) -> tuple[int | None, int]:
    state = db.session.scalars(
        select(MailReceiveState).where(MailReceiveState.config_id == config_id)
    ).one()
    db.session.refresh(state)
    return state.uidvalidity, state.last_uid


def suppressions(tenant_id: int | None = None) -> list[tuple[int, str, str, str]]:
    query = select(Suppression).order_by(Suppression.id)
    if tenant_id is not None:
        query = query.where(Suppression.tenant_id == tenant_id)
    return [(s.tenant_id, s.channel, s.address, s.reason) for s in db.session.scalars(query)]


def auto_message(i: int) -> bytes:
    return (
        f"From: Auto <auto@example.net>\r\nTo: bounces@acme-smtp.test\r\n"
        f"Message-ID: <auto-{i}@example.net>\r\nSubject: Auto {i}\r\n\r\nhello {i}\r\n"
    ).encode()


# --- bounces ---------------------------------------------------------------------------------


def test_a_permanent_bounce_fails_the_sent_record_with_its_code_and_suppresses_the_address(
    app: Flask, acme: int, mailbox: ImapUser
) -> None:
    config = receive_config(acme, mailbox)
    mail = sent(app, acme)
    uid = mailbox.append(sample("postfix_5_1_1.eml", mail))

    report = fetch()

    assert (report.total("stored"), report.total("bounces_failed")) == (1, 1)
    row = record(mail.id)
    assert (row.status, row.bounce_code, row.error_code) == ("Failed", "550 5.1.1", "550 5.1.1")
    assert row.error_message == (
        "550 5.1.1 <ann@example.com>: Recipient address rejected: "
        "User unknown in virtual mailbox table"
    )
    assert (row.delivery_outcome, row.version) == ("bounced", mail.version + 1)
    assert row.delivery_outcome_at is not None
    (got,) = received(config)
    assert (got.kind, got.bounce_status, got.bounce_code) == ("bounce", "permanent", "550 5.1.1")
    assert (got.record_id, got.tenant_id, got.uid, got.error) == (mail.id, acme, uid, None)
    assert got.dedup_key == "mid:<20241014102107.3F1C2A0012@mx.acme-smtp.test>"
    assert got.subject == "Undelivered Mail Returned to Sender"
    assert got.from_addr == "mailer-daemon@mx.acme-smtp.test"
    assert got.processed_at is not None
    assert not got.truncated
    assert suppressions() == [(acme, "mail", "ann@example.com", "hard_bounce")]
    entry = suppression.active(db.session, acme, Channel.MAIL, "Ann@Example.com")
    assert entry is not None
    assert entry.source_record_id == mail.id
    assert entry.created_by == "bounce mailbox bounces"
    assert entry.detail is not None
    assert entry.detail.startswith("550 5.1.1 ")
    # Read-only: the message is still unread in the operator's mailbox.
    assert "\\Seen" not in mailbox.flags()[uid]
    assert watermark(config)[1] == uid


def test_a_temporary_bounce_is_recorded_only(app: Flask, acme: int, mailbox: ImapUser) -> None:
    config = receive_config(acme, mailbox)
    mail = sent(app, acme, to="bob@example.org")
    mailbox.append(sample("postfix_delayed_4_4_1.eml", mail))

    fetch()

    row = record(mail.id)
    assert (row.status, row.version, row.bounce_code, row.error_code) == (
        "Sent",
        mail.version,
        None,
        None,
    )
    assert row.delivery_outcome is None
    (got,) = received(config)
    assert (got.kind, got.bounce_status, got.bounce_code, got.record_id) == (
        "bounce",
        "temporary",
        "4.4.1",
        mail.id,
    )
    assert suppressions() == []


def test_a_bounce_without_a_delivery_report_is_recognised_by_flufl_bounce(
    app: Flask, acme: int, mailbox: ImapUser
) -> None:
    """Exim's plain-text bounce: X-Failed-Recipients, the reply quoted, the original as text."""
    receive_config(acme, mailbox)
    mail = sent(app, acme, to="carol@example.net")
    mailbox.append(sample("exim_failed.eml", mail))

    fetch()

    row = record(mail.id)
    assert (row.status, row.bounce_code, row.delivery_outcome) == ("Failed", "550 5.1.1", "bounced")
    assert row.error_message is not None
    assert "The email account that you tried to reach does not exist" in row.error_message
    assert suppressions() == [(acme, "mail", "carol@example.net", "hard_bounce")]


def test_a_bounce_for_a_record_that_is_not_sent_is_recorded_and_the_address_suppressed(
    app: Flask, acme: int, mailbox: ImapUser
) -> None:
    """Two bounces of one mail: the first fails it, the second finds it Failed already."""
    config = receive_config(acme, mailbox)
    mail = sent(app, acme)
    mailbox.append(sample("postfix_5_1_1.eml", mail))
    mailbox.append(
        sample("postfix_5_1_1.eml", mail, **{"3F1C2A0012": "3F1C2A0099", "5.1.1": "5.1.10"})
    )

    report = fetch()

    assert (report.total("stored"), report.total("bounces_failed")) == (2, 1)
    row = record(mail.id)
    assert (row.status, row.bounce_code, row.version) == ("Failed", "550 5.1.1", mail.version + 1)
    assert [r.record_id for r in received(config)] == [mail.id, mail.id]
    assert suppressions() == [(acme, "mail", "ann@example.com", "hard_bounce")]  # still one


# --- read receipts ---------------------------------------------------------------------------


def test_a_read_receipt_records_the_read_time_once(
    app: Flask, acme: int, mailbox: ImapUser
) -> None:
    config = receive_config(acme, mailbox)
    mail = sent(app, acme)
    later = sent(app, acme, to="erin@example.com")
    read_when = (datetime.now(UTC) + timedelta(seconds=2)).replace(microsecond=0)
    # The sample's own date (2024) is before the send: the time we read the receipt is used.
    mailbox.append(sample("mdn_displayed.eml", mail))
    # A receipt dated after the send: that date is the read time.
    mailbox.append(
        sample(
            "mdn_displayed.eml",
            later,
            **{
                "Mon, 14 Oct 2024 12:30:15 +0200": format_datetime(read_when),
                "7b2f0c91": "11111111",
            },
        )
    )
    # A second receipt for the first mail (read again on another device): the first counts.
    mailbox.append(sample("mdn_displayed.eml", mail, **{"7b2f0c91": "22222222"}))
    before = datetime.now(UTC)

    report = fetch()

    assert (report.total("stored"), report.total("receipts_read")) == (3, 2)
    first = record(mail.id)
    assert first.read_at is not None
    assert before - timedelta(seconds=5) <= first.read_at <= datetime.now(UTC)
    assert (first.status, first.version) == ("Sent", mail.version)  # a receipt is no transition
    assert record(later.id).read_at == read_when
    kinds = [(r.kind, r.record_id) for r in received(config)]
    assert kinds == [
        ("read_receipt", mail.id),
        ("read_receipt", later.id),
        ("read_receipt", mail.id),
    ]
    read_at = first.read_at

    mailbox.append(sample("mdn_displayed.eml", mail, **{"7b2f0c91": "33333333"}))
    fetch()
    assert record(mail.id).read_at == read_at


# --- stored once -----------------------------------------------------------------------------


def test_the_same_mail_fetched_twice_is_stored_once(
    app: Flask, acme: int, mailbox: ImapUser
) -> None:
    config = receive_config(acme, mailbox)
    mail = sent(app, acme)
    bounce = sample("postfix_5_1_1.eml", mail)
    anonymous = sample("no_message_id.eml", mail)
    mailbox.append_many([bounce, anonymous, bounce, anonymous])  # each filed twice

    report = fetch()
    again = fetch()

    assert (report.total("stored"), report.total("duplicates")) == (2, 2)
    assert (again.total("stored"), again.total("duplicates")) == (0, 0)
    rows = received(config)
    assert [r.dedup_key[:7] for r in rows] == ["mid:<20", "sha256:"]
    assert [r.kind for r in rows] == ["bounce", "other"]
    assert rows[1].record_id == mail.id  # a reply, linked by In-Reply-To
    assert record(mail.id).version == mail.version + 1  # applied once
    assert watermark(config)[1] == 4


def test_a_recreated_folder_is_read_again_without_storing_twice(
    app: Flask, acme: int, mailbox: ImapUser
) -> None:
    """UIDVALIDITY changes when the folder is recreated: the watermark starts again at 0."""
    mailbox.create("Bounces")
    config = receive_config(acme, mailbox, folder="Bounces")
    mail = sent(app, acme)
    first = [sample("postfix_5_1_1.eml", mail), auto_message(1)]
    mailbox.append_many(first, "Bounces")
    fetch()
    validity, last = watermark(config)
    assert (validity, last) == (mailbox.uidvalidity("Bounces"), 2)

    mailbox.delete("Bounces")
    mailbox.create("Bounces")
    mailbox.append_many([*first, auto_message(2)], "Bounces")  # UIDs 1, 2, 3 again
    report = fetch()

    (run,) = report.mailboxes
    assert run.uidvalidity_reset
    assert (run.stored, run.duplicates) == (1, 2)
    assert watermark(config) == (mailbox.uidvalidity("Bounces"), 3)
    assert watermark(config)[0] != validity
    assert [r.message_id for r in received(config)] == [
        "<20241014102107.3F1C2A0012@mx.acme-smtp.test>",
        "<auto-1@example.net>",
        "<auto-2@example.net>",
    ]
    assert record(mail.id).version == mail.version + 1  # the bounce applied once


def test_at_most_100_messages_are_read_a_run(app: Flask, acme: int, mailbox: ImapUser) -> None:
    config = receive_config(acme, mailbox)
    mailbox.append_many([auto_message(i) for i in range(105)])

    first = fetch()
    assert first.total("stored") == 100
    assert watermark(config)[1] == 100
    second = fetch()
    assert second.total("stored") == 5
    assert watermark(config)[1] == 105
    assert len(received(config)) == 105
    assert fetch().total("stored") == 0


def test_one_broken_message_does_not_block_the_rest(
    app: Flask, acme: int, mailbox: ImapUser
) -> None:
    """A message the server cannot read (Dovecot drops the connection over it) is stored with
    its error, and the messages after it are read and applied."""
    config = receive_config(acme, mailbox)
    ann = sent(app, acme)
    carol = sent(app, acme, to="carol@example.net")
    broken = auto_message(7).replace(b"hello 7", b"BROKEN-MARKER")
    mailbox.append_many(
        [sample("postfix_5_1_1.eml", ann), broken, sample("exim_failed.eml", carol)]
    )
    mailbox.file_of(b"BROKEN-MARKER").chmod(0)  # unreadable for Dovecot's mail process

    report = fetch()

    (run,) = report.mailboxes
    assert (run.stored, run.broken, run.bounces_failed, run.error) == (3, 1, 2, None)
    assert record(ann.id).status == "Failed"
    assert record(carol.id).status == "Failed"
    rows = received(config)
    assert [r.uid for r in rows] == [1, 2, 3]
    assert rows[1].error is not None
    assert "FETCH" in rows[1].error
    assert rows[1].processed_at is not None
    assert rows[1].raw is None
    assert [r.error for r in (rows[0], rows[2])] == [None, None]
    assert watermark(config)[1] == 3
    assert fetch().total("stored") == 0  # passed for good


def test_an_oversized_message_is_truncated_with_a_reason_and_still_applied(
    app: Flask, acme: int, mailbox: ImapUser
) -> None:
    config = receive_config(acme, mailbox)
    mail = sent(app, acme, to="dan@example.com")
    raw = sample("oversized_5_2_2.eml", mail)
    assert len(raw) > MAX_MESSAGE_BYTES
    mailbox.append(raw)

    fetch()

    (got,) = received(config)
    assert got.truncated
    assert got.size > MAX_MESSAGE_BYTES
    assert got.raw is not None
    assert len(got.raw.encode()) == MAX_MESSAGE_BYTES
    assert got.truncation_reason == (
        f"the message is {got.size} bytes; the first {MAX_MESSAGE_BYTES} were read and kept "
        f"(limit {MAX_MESSAGE_BYTES} bytes a message)"
    )
    row = record(mail.id)
    assert (row.status, row.bounce_code) == ("Failed", "552 5.2.2")  # the report comes first
    assert suppressions() == [(acme, "mail", "dan@example.com", "hard_bounce")]


def test_bounces_and_receipts_on_each_database(
    any_app: Flask, smtp: ScriptedSmtpServer, mailbox: ImapUser
) -> None:
    """The chore runs on the embedded default (SQLite) as on PostgreSQL."""
    acme = tenant("acme").id
    mail_server(acme, smtp, name="acme-smtp")
    db.session.commit()
    config = receive_config(acme, mailbox)
    bounced, read_mail = sent(any_app, acme), sent(any_app, acme, to="erin@example.com")
    bounce = sample("postfix_5_1_1.eml", bounced)
    mailbox.append_many([bounce, sample("mdn_displayed.eml", read_mail), bounce])

    report = fetch()

    assert (report.total("stored"), report.total("duplicates")) == (2, 1)
    assert (report.total("bounces_failed"), report.total("receipts_read")) == (1, 1)
    assert (record(bounced.id).status, record(bounced.id).bounce_code) == ("Failed", "550 5.1.1")
    assert record(read_mail.id).read_at is not None
    assert suppressions() == [(acme, "mail", "ann@example.com", "hard_bounce")]
    assert watermark(config)[1] == 3
    assert fetch().total("stored") == 0


# --- tenants ---------------------------------------------------------------------------------


def test_another_tenants_mailbox_never_touches_this_tenants_records(
    app: Flask, acme: int, smtp: ScriptedSmtpServer, dovecot: DovecotServer
) -> None:
    globex = tenant("globex").id
    mail_server(globex, smtp, name="globex-smtp")
    db.session.commit()
    acme_box, globex_box = dovecot.add_user(), dovecot.add_user()
    receive_config(acme, acme_box)
    globex_config = receive_config(globex, globex_box)
    mail = sent(app, acme)
    # Acme's bounce and read receipt land in Globex's mailbox.
    globex_box.append(sample("postfix_5_1_1.eml", mail))
    globex_box.append(sample("mdn_displayed.eml", mail))

    fetch()

    row = record(mail.id)
    assert (row.status, row.version, row.read_at, row.bounce_code) == (
        "Sent",
        mail.version,
        None,
        None,
    )
    rows = received(globex_config)
    assert [(r.tenant_id, r.kind, r.record_id) for r in rows] == [
        (globex, "bounce", None),
        (globex, "read_receipt", None),
    ]
    assert suppressions() == []


def test_the_platform_mailbox_touches_only_records_sent_through_platform_servers(
    app: Flask, acme: int, smtp: ScriptedSmtpServer, mailbox: ImapUser
) -> None:
    """A tenant without a server of its own sends through the platform's default server, so
    its bounces come back to the platform's mailbox; a tenant's own server's mail does not."""
    globex = tenant("globex").id
    mail_server(PLATFORM_TENANT_ID, smtp, name="platform-smtp")
    db.session.commit()
    config = receive_config(PLATFORM_TENANT_ID, mailbox)
    via_platform = sent(app, globex)
    own_server = sent(app, acme)
    mailbox.append(sample("postfix_5_1_1.eml", via_platform))
    mailbox.append(sample("postfix_5_1_1.eml", own_server, **{"3F1C2A0012": "3F1C2A0077"}))

    fetch()

    assert (record(via_platform.id).status, record(own_server.id).status) == ("Failed", "Sent")
    assert suppressions() == [(globex, "mail", "ann@example.com", "hard_bounce")]
    assert [r.record_id for r in received(config)] == [via_platform.id, None]


# --- connections -----------------------------------------------------------------------------


def test_imaps_starttls_and_certificate_checks(app: Flask, acme: int, mailbox: ImapUser) -> None:
    implicit = receive_config(acme, mailbox, name="imaps", security="ssl")
    starttls = receive_config(acme, mailbox, name="starttls", security="starttls")
    checked = receive_config(acme, mailbox, name="checked", security="ssl", verify_tls=True)
    receive_config(acme, mailbox, name="off", enabled=False)
    mailbox.append(auto_message(1))

    report = fetch()

    runs = {run.config_id: run for run in report.mailboxes}
    assert set(runs) == {implicit, starttls, checked}  # a disabled mailbox is not read
    assert (runs[implicit].stored, runs[implicit].error) == (1, None)
    assert (runs[starttls].stored, runs[starttls].error) == (1, None)
    # The test server's certificate is self-signed: verification refuses it.
    assert runs[checked].stored == 0
    assert runs[checked].error is not None
    assert "TLS certificate was not accepted" in runs[checked].error


def test_a_wrong_password_is_reported_and_other_mailboxes_still_read(
    app: Flask, acme: int, mailbox: ImapUser
) -> None:
    # Its own server: Dovecot slows every login from an address after a failed one.
    with DovecotServer(users=1) as elsewhere:
        other = elsewhere.add_user()
        wrong = receive_config(acme, other, name="wrong")
        config = db.session.get(MailReceiveConfig, wrong)
        assert config is not None
        config.secret = "not-the-password"
        db.session.commit()
        good = receive_config(acme, mailbox, name="good")
        mailbox.append(auto_message(1))

        report = fetch()

    runs = {run.config_id: run for run in report.mailboxes}
    assert runs[wrong].error is not None
    assert "Login failed" in runs[wrong].error
    assert "not-the-password" not in (runs[wrong].error or "")
    assert (runs[wrong].stored, runs[good].stored) == (0, 1)


# --- the suppression list --------------------------------------------------------------------


def test_suppress_is_idempotent_and_unsuppress_keeps_the_history(app: Flask, acme: int) -> None:
    first = suppression.suppress(
        db.session, acme, "mail", " Ann@Example.COM ", "manual", by="ops@acme.test"
    )
    again = suppression.suppress(db.session, acme, Channel.MAIL, "ann@example.com", "complaint")
    assert again.id == first.id
    assert again.reason == "manual"
    sms = suppression.suppress(db.session, acme, "sms", "+44 7911 123456", "hard_bounce")
    assert sms.address == "+447911123456"
    db.session.commit()

    assert suppression.active(db.session, acme, "sms", "+447911123456") is not None
    assert suppression.unsuppress(
        db.session, acme, "mail", "ANN@example.com", by="ops@acme.test", reason="asked us to"
    )
    assert not suppression.unsuppress(
        db.session, acme, "mail", "ann@example.com", by="ops@acme.test", reason="again"
    )
    db.session.commit()
    assert suppression.active(db.session, acme, "mail", "ann@example.com") is None
    removed = db.session.get(Suppression, first.id)
    assert removed is not None
    assert (removed.removed_by, removed.removal_reason) == ("ops@acme.test", "asked us to")
    assert removed.removed_at is not None

    # On the list again after removal: a new row; the old one stays as history.
    back = suppression.suppress(db.session, acme, "mail", "ann@example.com", "hard_bounce")
    db.session.commit()
    assert back.id != first.id
    assert db.session.scalar(select(func.count()).select_from(Suppression)) == 3
    with pytest.raises(ValueError, match="reason"):
        suppression.unsuppress(db.session, acme, "mail", "ann@example.com", by="x", reason=" ")


@pytest.mark.parametrize(
    ("channel", "address", "expected"),
    [
        ("mail", "Ann@Example.COM", "ann@example.com"),
        ("mail", " <bob@example.org> ", "bob@example.org"),
        ("sms", "+44 7911 123456", "+447911123456"),
        ("sms", "+1 (650) 253-0000", "+16502530000"),
    ],
)
def test_addresses_are_normalised(channel: str, address: str, expected: str) -> None:
    assert suppression.normalise(channel, address) == expected


@pytest.mark.parametrize(
    ("channel", "address"),
    [("mail", "no-at-sign"), ("mail", "a b@example.com"), ("sms", "07911 123456"), ("sms", "")],
)
def test_addresses_that_cannot_be_listed_are_refused(channel: str, address: str) -> None:
    with pytest.raises(suppression.InvalidAddress):
        suppression.normalise(channel, address)


# --- the chore -------------------------------------------------------------------------------


FETCH_ID = f"{PREFIX}fetch-mail"
SWEEP_ID = f"{PREFIX}sweep-stuck-sends"
MATCH_ID = f"{PREFIX}match-events"


def test_the_fetch_chore_has_a_fixed_id_and_registration_stays_idempotent(
    redis_client: redis.Redis,
) -> None:
    settings = settings_for_tests(TEST_DATABASE_URL, sweep_interval_s=1.0)
    # ... and the retention and inbox chores.
    every = [SWEEP_ID, FETCH_ID, MATCH_ID, f"{PREFIX}retention", f"{PREFIX}notices"]
    assert ensure_schedules(redis_client, settings) == dict.fromkeys(every, "added")
    assert ensure_schedules(redis_client, settings) == {}
    assert ensure_schedules(redis_client, settings) == {}
    jobs = {j.id: j for j in Scheduler(queue_name=QUEUE, connection=redis_client).get_jobs()}
    assert sorted(jobs) == sorted(every)
    job = jobs[FETCH_ID]
    assert (job.func_name, job.origin, job.meta["interval"]) == (
        "portal.delivery.chores.fetch_mail_job",
        QUEUE,
        60,
    )
    assert redis_client.zcard(Scheduler.scheduled_jobs_key) == len(every)


@pytest.mark.process
def test_the_fetch_chore_reads_the_mailboxes_in_its_own_process(
    app: Flask, acme: int, mailbox: ImapUser, tmp_path: Path
) -> None:
    """The job function as the rq worker runs it: a fresh process configured by environment."""
    config = receive_config(acme, mailbox)
    mail = sent(app, acme)
    mailbox.append(sample("postfix_5_1_1.eml", mail))
    program = (
        "import json\n"
        "from portal.delivery.chores import fetch_mail_job\n"
        "print('RESULT ' + json.dumps(fetch_mail_job()))\n"
    )
    env = worker_env(tmp_path, app.config["SETTINGS"].secret_key, REDIS_URL=TEST_REDIS_URL)
    env["OUTBOUND_TENANT_ALLOW_PRIVATE"] = "true"  # the mailbox is on 127.0.0.1
    done = subprocess.run(
        [sys.executable, "-c", program],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    (line,) = [ln for ln in done.stdout.decode().splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert (result["stored"], result["bounces_failed"]) == (1, 1)
    assert result["mailboxes"][0]["config_id"] == config
    assert record(mail.id).status == "Failed"


# --- every run is recorded on the folder's state ---------------------------------------------


def run_state(config_id: int, folder: str = "INBOX") -> MailReceiveState:
    db.session.expire_all()
    state = db.session.scalars(
        select(MailReceiveState).where(
            MailReceiveState.config_id == config_id, MailReceiveState.folder == folder
        )
    ).one()
    return state


def set_config(config_id: int, **fields: Any) -> None:
    config = db.session.get(MailReceiveConfig, config_id)
    assert config is not None
    for name, value in fields.items():
        setattr(config, name, value)
    db.session.commit()


def test_a_run_that_cannot_read_the_folder_is_recorded_and_a_run_that_can_clears_it(
    app: Flask, acme: int, mailbox: ImapUser
) -> None:
    """A folder never opened has no state row yet: the failure creates it."""
    config = receive_config(acme, mailbox, folder="Later")
    assert db.session.scalar(select(func.count()).select_from(MailReceiveState)) == 0

    (run,) = fetch().mailboxes
    state = run_state(config, "Later")
    assert state.last_error is not None
    assert state.last_error.startswith("Folder missing. Logged in, but the folder 'Later'")
    assert state.last_error == run.error
    assert state.last_run_at is not None
    assert state.last_error_at == state.last_run_at
    assert (state.uidvalidity, state.last_uid) == (None, 0)  # never opened
    first_failure, first_run = state.last_error_at, state.last_run_at

    fetch()  # still failing: the run moves, "failing since" stays
    state = run_state(config, "Later")
    assert state.last_run_at is not None
    assert state.last_run_at > first_run
    assert state.last_error_at == first_failure

    mailbox.create("Later")
    mailbox.append(auto_message(1), "Later")
    (run,) = fetch().mailboxes
    assert (run.stored, run.error, run.uidvalidity_reset) == (1, None, False)
    state = run_state(config, "Later")
    assert (state.last_error, state.last_error_at) == (None, None)
    assert state.last_run_at is not None
    assert state.last_run_at > first_run
    assert (state.uidvalidity, state.last_uid) == (mailbox.uidvalidity("Later"), 1)


def test_each_kind_of_failure_is_said_plainly_and_last_read_stays(
    app: Flask, acme: int, mailbox: ImapUser
) -> None:
    config = receive_config(acme, mailbox)
    mailbox.append(auto_message(1))
    assert fetch().mailboxes[0].error is None
    read_at = run_state(config).updated_time

    with socket.socket() as sock:  # a port with nothing listening
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    set_config(config, port=closed)
    fetch()
    error = run_state(config).last_error or ""
    assert error == f"Connection refused. Nothing answers at 127.0.0.1:{closed}.", error

    with socket.socket() as silent:  # takes the connection and never says hello
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        set_config(config, port=silent.getsockname()[1])
        fetch(timeout_s=1)
    error = run_state(config).last_error or ""
    assert error.startswith("Timed out. The server did not answer in time"), error

    set_config(config, port=mailbox.server.imaps_port, security="ssl", verify_tls=True)
    fetch()
    error = run_state(config).last_error or ""
    assert error.startswith("TLS failed. The server's TLS certificate was not accepted"), error
    assert "CERTIFICATE_VERIFY_FAILED" not in error  # never the server's or library's words

    set_config(config, secret_encrypted="not-a-fernet-token")  # the key changed since
    fetch()
    assert run_state(config).last_error == UNREADABLE_PASSWORD

    state = run_state(config)
    assert state.updated_time == read_at  # "last read" is when the folder was last read
    assert state.last_run_at is not None
    assert state.last_run_at > read_at
    assert db.session.scalar(select(func.count()).select_from(MailReceiveState)) == 1


def run_ends(config_id: int, error: str | None) -> None:
    db.session.rollback()  # the test's reads end here: on SQLite an open one holds the lock
    record_run(db.engine, config_id, "INBOX", error)


def test_runs_are_recorded_on_each_database(any_app: Flask, mailbox: ImapUser) -> None:
    """The upsert (with "failing since" kept) on SQLite as on PostgreSQL; an error is kept to
    2,000 characters; a config deleted during its run leaves nothing behind, and no error."""
    config = receive_config(tenant("acme").id, mailbox)
    run_ends(config, "x" * 5000 + "\x00")
    state = run_state(config)
    assert state.last_error == "x" * 2000
    since = state.last_error_at
    assert since is not None
    run_ends(config, "Login failed.")
    state = run_state(config)
    assert (state.last_error, state.last_error_at) == ("Login failed.", since)
    assert state.last_run_at is not None
    assert state.last_run_at >= since  # SQLite's clock has milliseconds only
    run_ends(config, None)
    state = run_state(config)
    assert (state.last_error, state.last_error_at) == (None, None)
    db.session.delete(db.session.get(MailReceiveConfig, config))
    db.session.commit()
    run_ends(config, "gone")
    assert db.session.scalar(select(func.count()).select_from(MailReceiveState)) == 0
