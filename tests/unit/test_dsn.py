"""Reading received mail (no I/O): DSN bounces (RFC 3464), bounces without a report
(flufl.bounce), read receipts (RFC 8098), bounce codes, and which Message-IDs point at the
original. The samples under tests/data are shaped like what Postfix, Exim and Thunderbird send."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from portal.messaging.after_send.receiving import bounces
from portal.messaging.after_send.receiving.apply import OUR_MESSAGE_ID
from portal.messaging.after_send.receiving.bounces import Kind, Severity, bounce_code, read
from portal.messaging.after_send.receiving.fetch import MAX_MESSAGE_BYTES, dedup_key
from portal.messaging.after_send.receiving.imap import Fetched
from portal.messaging.sending.preparation import message_id_for

DATA = Path(__file__).resolve().parent.parent / "data"
ORIGINAL = "<mail-1234@acme-smtp.test>"


def sample(name: str) -> bytes:
    return (DATA / name).read_bytes()


def test_a_postfix_dsn_is_a_permanent_bounce_with_its_code_and_the_original_id() -> None:
    report = read(sample("postfix_5_1_1.eml"))
    assert report.kind is Kind.BOUNCE
    assert report.bounce is not None
    assert (report.bounce.source, report.bounce.severity) == ("dsn", Severity.PERMANENT)
    (ann,) = report.bounce.recipients
    assert (ann.recipient, ann.action, ann.status, ann.code) == (
        "ann@example.com",
        "failed",
        "5.1.1",
        "550 5.1.1",
    )
    assert ann.hard
    assert ann.diagnostic == (
        "550 5.1.1 <ann@example.com>: Recipient address rejected: "
        "User unknown in virtual mailbox table"
    )
    assert report.referenced_ids == (ORIGINAL,)  # from the text/rfc822-headers part
    assert report.message_id == "<20241014102107.3F1C2A0012@mx.acme-smtp.test>"
    assert (report.from_addr, report.subject) == (
        "mailer-daemon@mx.acme-smtp.test",
        "Undelivered Mail Returned to Sender",
    )


def test_a_delayed_dsn_is_a_temporary_bounce() -> None:
    report = read(sample("postfix_delayed_4_4_1.eml"))
    assert report.kind is Kind.BOUNCE
    assert report.bounce is not None
    assert report.bounce.severity is Severity.TEMPORARY
    (bob,) = report.bounce.recipients
    assert (bob.recipient, bob.action, bob.code, bob.hard) == (
        "bob@example.org",
        "delayed",
        "4.4.1",
        False,
    )
    assert bob.diagnostic == "connect to mx.example.org[192.0.2.30]:25: Connection timed out"
    assert report.referenced_ids == (ORIGINAL,)


def test_an_exim_bounce_without_a_report_is_found_by_flufl_bounce() -> None:
    report = read(sample("exim_failed.eml"))
    assert report.kind is Kind.BOUNCE
    assert report.bounce is not None
    assert (report.bounce.source, report.bounce.severity) == ("heuristic", Severity.PERMANENT)
    (carol,) = report.bounce.recipients
    assert (carol.recipient, carol.code) == ("carol@example.net", "550 5.1.1")
    assert carol.diagnostic is not None
    assert carol.diagnostic.startswith("550-5.1.1 The email account that you tried to reach")
    assert report.referenced_ids == (ORIGINAL,)  # quoted in the copy of the message


QMAIL = b"""\
Return-Path: <>
Date: 14 Oct 2024 11:40:02 -0000
From: MAILER-DAEMON@mx.acme-smtp.test
To: sender@acme-smtp.test
Subject: failure notice

Hi. This is the qmail-send program at mx.acme-smtp.test.
I'm afraid I wasn't able to deliver your message to the following addresses.
This is a permanent error; I've given up. Sorry it didn't work out.

<frank@example.com>:
192.0.2.50 does not like recipient.
Remote host said: 550 #5.1.1 No such mailbox
Giving up on 192.0.2.50.

--- Below this line is a copy of the message.

Return-Path: <sender@acme-smtp.test>
Message-ID: <mail-1234@acme-smtp.test>
From: Sender <sender@acme-smtp.test>
To: frank@example.com
Subject: Hello

Hi Frank
"""


def test_a_qmail_bounce_is_found_by_flufl_bounce() -> None:
    report = read(QMAIL)
    assert report.kind is Kind.BOUNCE
    assert report.bounce is not None
    assert report.bounce.severity is Severity.PERMANENT
    (frank,) = report.bounce.recipients
    assert (frank.recipient, frank.code) == ("frank@example.com", "550 5.1.1")
    assert report.referenced_ids == (ORIGINAL,)


def test_a_person_quoting_an_error_is_not_a_bounce() -> None:
    """flufl.bounce's heuristics only run on machine-generated mail."""
    raw = b"""\
From: Grace <grace@example.com>
To: sender@acme-smtp.test
Message-ID: <reply-1@example.com>
In-Reply-To: <mail-1234@acme-smtp.test>
Subject: Re: Hello

I tried to forward it but got this:

The following addresses had permanent fatal errors
<heidi@example.com>
550 5.1.1 user unknown
Transcript of session follows
"""
    report = read(raw)
    assert (report.kind, report.bounce) == (Kind.OTHER, None)
    assert report.referenced_ids == (ORIGINAL,)


def test_a_read_receipt_names_the_original_and_says_displayed() -> None:
    report = read(sample("mdn_displayed.eml"))
    assert report.kind is Kind.READ_RECEIPT
    assert report.bounce is None
    assert report.receipt is not None
    assert report.receipt.original_message_id == ORIGINAL
    assert report.receipt.displayed
    assert report.receipt.final_recipient == "ann@example.com"
    assert report.receipt.date == datetime(2024, 10, 14, 10, 30, 15, tzinfo=UTC)
    assert report.referenced_ids == (ORIGINAL,)


def test_a_deleted_disposition_is_not_a_read() -> None:
    raw = sample("mdn_displayed.eml").replace(
        b"MDN-sent-manually; displayed", b"MDN-sent-automatically; deleted"
    )
    report = read(raw)
    assert report.kind is Kind.READ_RECEIPT
    assert report.receipt is not None
    assert not report.receipt.displayed


def test_a_success_report_is_not_a_bounce() -> None:
    raw = (
        sample("postfix_5_1_1.eml")
        .replace(b"Action: failed", b"Action: delivered")
        .replace(b"Status: 5.1.1", b"Status: 2.0.0")
    )
    report = read(raw)
    assert (report.kind, report.bounce) == (Kind.OTHER, None)


def test_a_delivery_given_up_after_a_temporary_error_fails_but_is_not_hard() -> None:
    raw = sample("postfix_delayed_4_4_1.eml").replace(b"Action: delayed", b"Action: failed")
    report = read(raw.replace(b"Status: 4.4.1", b"Status: 4.4.7"))
    assert report.bounce is not None
    assert report.bounce.severity is Severity.PERMANENT
    (bob,) = report.bounce.recipients
    assert (bob.code, bob.hard) == ("4.4.7", False)


def test_a_message_without_message_id_is_other_and_points_at_the_original() -> None:
    report = read(sample("no_message_id.eml"))
    assert (report.kind, report.message_id) == (Kind.OTHER, None)
    assert report.referenced_ids == (ORIGINAL,)


def test_a_truncated_bounce_is_still_read() -> None:
    raw = sample("oversized_5_2_2.eml")
    assert len(raw) > MAX_MESSAGE_BYTES
    report = read(raw[:MAX_MESSAGE_BYTES])
    assert report.bounce is not None
    assert report.bounce.severity is Severity.PERMANENT
    assert [r.code for r in report.bounce.recipients] == ["552 5.2.2"]
    assert report.referenced_ids == (ORIGINAL,)  # from the returned message/rfc822 part


@pytest.mark.parametrize(
    ("diagnostic", "status", "expected"),
    [
        ("550 5.1.1 <ann@example.com>: Recipient address rejected", "5.1.1", "550 5.1.1"),
        ("550-5.1.1 The email account that you tried to reach", None, "550 5.1.1"),
        ("550 #5.1.0 Address rejected", None, "550 5.1.0"),
        ("554 rejected by policy", None, "554"),
        ("connect to mx.example.org[192.0.2.30]:25: Connection timed out", "4.4.1", "4.4.1"),
        ("Host or domain name not found", None, None),
        (None, "5.2.2", "5.2.2"),
        ("said: 552 5.2.2 Mailbox full", None, "552 5.2.2"),
    ],
)
def test_bounce_codes(diagnostic: str | None, status: str | None, expected: str | None) -> None:
    assert bounce_code(diagnostic, status) == expected


def test_message_ids_are_found_in_header_values() -> None:
    assert bounces.message_ids(["<a@b> <c@d>", "junk", "x <mail-1@acme.test>"]) == [
        "<a@b>",
        "<c@d>",
        "<mail-1@acme.test>",
    ]


def test_our_message_id_pattern_matches_what_preparation_writes() -> None:
    written = message_id_for(987654321, "sender@acme-smtp.test")
    match = OUR_MESSAGE_ID.match(written)
    assert match is not None
    assert match.group(1) == "987654321"
    assert OUR_MESSAGE_ID.match("<mail-x@acme-smtp.test>") is None


def test_dedup_keys() -> None:
    small = Fetched(uid=1, size=5, data=b"hello")
    assert dedup_key("<a@b>", small) == "mid:<a@b>"
    assert dedup_key(None, small).startswith("sha256:")
    assert dedup_key(None, small) == dedup_key(None, Fetched(uid=9, size=5, data=b"hello"))
    # A message cut short is told apart from a short one with the same beginning.
    assert dedup_key(None, small) != dedup_key(None, Fetched(uid=1, size=500, data=b"hello"))
    assert dedup_key("<" + "x" * 400 + "@b>", small).startswith("mid-sha256:")
