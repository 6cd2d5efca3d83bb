"""The wire form written directly (message_bytes) means what build_message's EmailMessage means."""

from __future__ import annotations

from email import message_from_bytes, policy
from email.message import EmailMessage

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portal.messaging.sending.transports import mail_message
from portal.messaging.sending.transports.mail_message import (
    Attachment,
    OutgoingMail,
    build_message,
    message_bytes,
)
from tests.support.sweeps import examples

HEADERS = (
    "Message-ID",
    "From",
    "To",
    "Cc",
    "Reply-To",
    "Subject",
    "X-Priority",
    "Importance",
    "Disposition-Notification-To",
    "X-Postroom-Record",
    "MIME-Version",
)


def parse(raw: bytes) -> EmailMessage:
    return message_from_bytes(raw, policy=policy.default)  # type: ignore[return-value]


def same_meaning(mail: OutgoingMail) -> bytes:
    """Assert both forms parse to the same headers, structure, encodings and content."""
    ours, theirs = message_bytes(mail), build_message(mail).as_bytes()
    a, b = parse(ours), parse(theirs)
    for name in HEADERS:
        assert str(a.get(name)) == str(b.get(name)), name
    assert a.defects == b.defects == []
    assert a["Date"] is not None
    a_parts, b_parts = list(a.walk()), list(b.walk())
    assert [p.get_content_type() for p in a_parts] == [p.get_content_type() for p in b_parts]
    for x, y in zip(a_parts, b_parts, strict=True):
        if x.is_multipart():
            continue
        assert x["Content-Transfer-Encoding"] == y["Content-Transfer-Encoding"]
        assert x.get_content_charset() == y.get_content_charset()
        assert x.get_content() == y.get_content()
        assert x.defects == y.defects == []
    longest = max(len(line) for line in theirs.split(b"\r\n"))
    assert all(len(line) <= max(78, longest) for line in ours.split(b"\r\n"))
    assert b"\n" not in ours.replace(b"\r\n", b"")  # CRLF only, as the SMTP policy writes
    return ours


def mail(**changes: object) -> OutgoingMail:
    values: dict[str, object] = {
        "message_id": "<rec-1.mail@postroom.test>",
        "from_addr": "sender@postroom.test",
        "from_name": "Postroom",
        "to": ["ann@example.com"],
        "subject": "Your order",
        "text": "Hello Ann",
        "extra_headers": {"X-Postroom-Record": "1"},
    }
    values.update(changes)
    return OutgoingMail(**values)  # type: ignore[arg-type]


BODIES = {
    "ascii": "Hello Ann,\n\nYour order shipped.\n",
    "empty": "",
    "utf-8 short lines": "Grüße aus Köln\nすし\n",
    "long ascii line": "x" * 200,
    "long utf-8 lines": ("Ça coûte très cher, déjà " * 10 + "\n") * 12,
    "mostly non-latin": "日本語のテキスト" * 40,
    "crlf and cr": "one\r\ntwo\rthree\n",
    "dots and From": ".\n..leading\nFrom the start\n.",
    "html": "<p>" + "<b>bold</b> " * 30 + "</p>",
}


@pytest.mark.parametrize("body", BODIES.values(), ids=BODIES.keys())
@pytest.mark.parametrize("shape", ["text", "html", "both"])
def test_bodies_mean_the_same(body: str, shape: str) -> None:
    text = body if shape in ("text", "both") else None
    html = body if shape in ("html", "both") else None
    same_meaning(mail(text=text, html=html))


def test_headers_fold_and_mean_the_same() -> None:
    raw = same_meaning(
        mail(
            from_name='Doe, John "JD"',
            to=[f"person{i}@example.com" for i in range(12)],
            cc=["c@example.com"],
            reply_to="help@postroom.test",
            subject="A subject long enough that it has to be folded somewhere " * 3,
            priority=1,
            read_receipt_to="receipts@postroom.test",
        )
    )
    head = raw.split(b"\r\n\r\n", 1)[0]
    assert all(len(line) <= 78 for line in head.split(b"\r\n"))


def test_the_common_mail_takes_the_direct_path() -> None:
    # Not the stdlib generator: its boundaries are decimal, ours hex; its headers fold the same.
    raw = same_meaning(mail(text="plain", html="<p>html</p>"))
    assert mail_message._ascii_header_lines(mail_message._header_fields(mail())) is not None
    assert b'boundary="===============' in raw


@pytest.mark.parametrize(
    "changes",
    [
        {"subject": "Café au lait"},
        {"from_name": "José Núñez"},
        {"subject": "x" * 120},  # one word longer than a line: RFC 2047 folding
        {"attachments": [Attachment("a.pdf", "application/pdf", b"%PDF")]},
    ],
    ids=["utf-8 subject", "utf-8 name", "unbreakable subject", "attachment"],
)
def test_what_the_direct_path_cannot_write_goes_through_build_message(
    changes: dict[str, object],
) -> None:
    same_meaning(mail(**changes))


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({"subject": "a\r\nBcc: x@y.z"}, "Subject must not contain CR"),
        ({"to": ["a@b.c>, evil@x.y"]}, "To is not a plain ASCII address"),
        ({"message_id": "no-brackets"}, "Message-ID must look like"),
        ({"to": [], "cc": [], "bcc": []}, "no recipients"),
        ({"extra_headers": {"Subject": "again"}}, "set from the mail itself"),
        ({"priority": 9}, "priority must be 1..5"),
    ],
)
def test_direct_path_checks_input_as_build_message_does(bad: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        message_bytes(mail(**bad))


printable = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=150)
any_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    max_size=400,
)


@settings(max_examples=examples(250), deadline=None)
@given(
    subject=printable.filter(lambda s: "\r" not in s and "\n" not in s),
    name=printable,
    text=st.one_of(st.none(), any_text),
    html=st.one_of(st.none(), any_text),
    recipients=st.integers(min_value=1, max_value=8),
)
def test_generated_mails_mean_the_same(
    subject: str, name: str, text: str | None, html: str | None, recipients: int
) -> None:
    same_meaning(
        mail(
            subject=subject,
            from_name=name,
            text=text,
            html=html,
            to=[f"r{i}@example.com" for i in range(recipients)],
        )
    )
