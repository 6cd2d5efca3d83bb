"""Every address acceptance takes can be written: an internationalised domain as its A-labels,
a non-ASCII local part only in an SMTPUTF8 transaction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portal.messaging.records.validation import AcceptanceError, _email
from portal.messaging.sending.transports.mail_message import (
    OutgoingMail,
    message_bytes,
    needs_smtputf8,
    utf8_message_bytes,
    wire_address,
)
from tests.support.sweeps import examples

LOCAL = st.one_of(
    st.from_regex(r"[a-zA-Z0-9!#$%&'*+/=?^_`{|}~-]{1,10}(\.[a-z0-9]{1,5})?", fullmatch=True),
    st.text(alphabet=st.characters(categories=("L", "N", "M")), min_size=1, max_size=10),
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=10),
)
DOMAIN = st.one_of(
    st.sampled_from(["example.com", "exämple.com", "bücher.example", "пример.рф", "例え.jp"]),
    st.from_regex(r"[a-zä-ü]{1,10}\.(com|de|example)", fullmatch=True),
)


def test_examples() -> None:
    assert wire_address("ann@exämple.com") == "ann@xn--exmple-cua.com"
    assert wire_address("ü@exämple.com") == "ü@xn--exmple-cua.com"
    assert wire_address("ann@example.com") == "ann@example.com"


@settings(max_examples=examples(400), deadline=None)
@given(local=LOCAL, domain=DOMAIN)
def test_every_accepted_address_can_be_written(local: str, domain: str) -> None:
    try:
        accepted = _email(f"{local}@{domain}", "to")
    except AcceptanceError:
        return
    wired = wire_address(accepted)
    wired_local, _, wired_domain = wired.rpartition("@")
    assert wired_domain.isascii()
    mail = OutgoingMail(
        message_id="<mail-1@example.com>", from_addr="s@example.com", to=[wired], text="Hi"
    )
    if needs_smtputf8(mail):
        assert not wired_local.isascii()
        data = utf8_message_bytes(mail)
        assert f"To: {wired}".encode() in data
    else:
        assert wired.isascii()
        assert f"To: {wired}".encode() in message_bytes(mail)


def test_without_smtputf8_a_utf8_local_part_cannot_be_written_as_ascii() -> None:
    mail = OutgoingMail(message_id="<m-1@example.com>", from_addr="s@example.com", to=["ü@x.com"])
    assert needs_smtputf8(mail)
    with pytest.raises(ValueError, match="ASCII"):
        message_bytes(mail)
