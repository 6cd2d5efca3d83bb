"""The one search box and the recipient page, through Flask's test
client on PostgreSQL: each kind of input, national numbers per tenant country, both channels
on one page newest first with keyset pages, what the page says it understood, and tenant
isolation of the recipient page's token."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
from flask import Flask
from sqlalchemy import select, update

from portal.extensions import db
from portal.messaging.after_send import suppression
from portal.messaging.records import search
from portal.models import (
    DeliveryEvent,
    MailSendRecord,
    MailSendSubject,
    RecipientToken,
    SendAttempt,
    SmsSendRecord,
    Tenant,
)
from portal.web.records.filters import MAX_SEARCH_CHARS
from tests.integration.test_portal_records import (
    ADMIN,
    OPERATOR,
    SUPPORT,
    World,
    cheap_passwords,
    mail,
    signed_in,
    sms,
    world,
)

__all__ = ["cheap_passwords", "world"]  # fixtures, imported for pytest


def results(app: Flask, q: str, who: str = SUPPORT, view: str | int | None = None) -> str:
    client, _ = signed_in(app, who, view)
    response = client.get("/search/", query_string={"q": q})
    assert response.status_code == 200, response.text
    return str(response.text)


def understood(page: str) -> str:
    found = re.search(r'<p class="result-note" id="understood">\s*(.*?)\s*</p>', page, re.S)
    assert found is not None
    return found.group(1)


def mail_link(record_id: int) -> str:
    return f'href="/mail-records/{record_id}"'


def sms_link(record_id: int) -> str:
    return f'href="/sms-records/{record_id}"'


# --- the results page ---------------------------------------------------------------------------


def test_a_full_address_finds_mail_in_this_tenant_only(app: Flask, world: World) -> None:
    page = results(app, "ANN@example.com")
    assert mail_link(world.mail) in page
    assert mail_link(world.mail_other) not in page  # globex's, same address
    assert mail_link(world.sent_mail) not in page
    assert "email address ann@example.com" in understood(page)


def test_a_partial_address_and_a_domain(app: Flask, world: World) -> None:
    carol = mail(world.acme, to="carol@shop.example.org", subject="Hello")
    for typed in ("carol", "carol@", "@shop.example.org", "shop.example"):
        page = results(app, typed)
        assert mail_link(carol) in page, typed
        assert mail_link(world.mail) not in page, typed
    # "carol@" is a prefix: an address with carol@ in the middle is not one.
    mail(world.acme, to="xcarol@other.example", subject="Not her")
    assert "xcarol@other.example" not in results(app, "carol@")


def test_a_partial_address_with_an_identifier_is_checked_whole(app: Flask, world: World) -> None:
    """The index looks up the stretch around the digits (search.rare_core: "er4242"); the
    whole part is checked on what it finds, newest first."""
    older = mail(world.acme, to="user4242@example.com", subject="One")
    newer = mail(world.acme, to="a.user42420@example.net", subject="Two")
    other = mail(world.acme, to="peter4242@example.com", subject="Three")  # has "er4242"
    page = results(app, "user4242")
    assert mail_link(older) in page
    assert mail_link(newer) in page
    assert mail_link(other) not in page
    assert page.index(mail_link(newer)) < page.index(mail_link(older))


def test_a_subject_word_never_lands_on_an_empty_sms_list(app: Flask, world: World) -> None:
    invoice = mail(world.acme, subject="Your Invoice for March")
    page = results(app, "invoice")
    assert mail_link(invoice) in page
    assert "mail subject containing “invoice”" in understood(page)
    assert "No text message records match" not in page
    client, _ = signed_in(app, SUPPORT)
    # The dashboard's box lands here too.
    dashboard = client.get("/").text
    assert 'action="/search/"' in dashboard


def test_a_rendered_subject_is_found_once_preparation_writes_it(app: Flask, world: World) -> None:
    templated = mail(world.acme, subject=None, template_code="welcome")
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == templated)
        .values(rendered_subject="Welcome aboard, Dana")
    )
    db.session.commit()
    assert mail_link(templated) in results(app, "aboard")
    rows = db.session.scalars(
        select(MailSendSubject.subject).where(MailSendSubject.record_id == templated)
    ).all()
    assert rows == ["Welcome aboard, Dana"]


@pytest.mark.parametrize(
    ("country", "typed"),
    [
        (None, "07911 123456"),  # DEFAULT_COUNTRY: GB
        ("GB", "07911123456"),
        ("DE", "+44 7911 123456"),
        ("DE", "447911123456"),
        ("DE", "0044 7911 123456"),
    ],
)
def test_phone_numbers_as_people_write_them(
    app: Flask, world: World, country: str | None, typed: str
) -> None:
    db.session.execute(update(Tenant).where(Tenant.id == world.acme).values(country=country))
    db.session.commit()
    page = results(app, typed)
    assert sms_link(world.sms) in page
    assert sms_link(world.sms_other) not in page
    assert "phone number +447911123456" in understood(page)


def test_a_national_number_is_read_in_the_tenant_country(app: Flask, world: World) -> None:
    berlin = sms(world.acme, number="+49301234567")
    db.session.execute(update(Tenant).where(Tenant.id == world.acme).values(country="DE"))
    db.session.commit()
    page = results(app, "030 1234567")
    assert sms_link(berlin) in page
    assert "phone number +49301234567 (DE)" in understood(page)
    # The same digits in GB are another number (or none): not Berlin's.
    db.session.execute(update(Tenant).where(Tenant.id == world.acme).values(country="GB"))
    db.session.commit()
    assert sms_link(berlin) not in results(app, "030 1234567")


def test_default_country_setting(app: Flask, world: World) -> None:
    berlin = sms(world.acme, number="+49301234567")
    settings = app.config["SETTINGS"]
    app.config["SETTINGS"] = settings.replace(default_country="DE")
    try:
        assert sms_link(berlin) in results(app, "030 1234567")
    finally:
        app.config["SETTINGS"] = settings


def test_ids_message_id_provider_id_and_business_key(app: Flask, world: World) -> None:
    keyed = mail(world.acme, business_key="order-77", subject="Keyed")
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == world.sent_mail)
        .values(message_id_header=f"<mail-{world.sent_mail}@example.com>")
    )
    db.session.add(
        SendAttempt(
            tenant_id=world.acme,
            channel="sms",
            record_id=world.sms,
            number=1,
            started_at=datetime.now(UTC),
            outcome="sent",
            ambiguous=False,
            provider_message_id="SM0123456789abcdef",
        )
    )
    db.session.commit()
    page = results(app, str(world.mail))
    assert mail_link(world.mail) in page
    assert f"record id {world.mail}" in understood(page)
    page = results(app, f"<mail-{world.sent_mail}@example.com>")
    assert mail_link(world.sent_mail) in page
    assert mail_link(world.mail) not in page
    page = results(app, "SM0123456789abcdef")
    assert sms_link(world.sms) in page
    assert "provider message id “SM0123456789abcdef”" in understood(page)
    page = results(app, "order-77")
    assert mail_link(keyed) in page
    # Another tenant's id is not found by guessing.
    assert mail_link(world.mail_other) not in results(app, str(world.mail_other))


def test_both_channels_together_newest_first_in_keyset_pages(
    app: Flask, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("portal.web.records.search.PAGE_SIZE", 3)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    made = []
    for i in range(4):  # alternate channels, each a minute newer than the last
        when = start + timedelta(minutes=2 * i)
        made.append(
            (
                "mail",
                mail(world.acme, to="dup@example.com", subject="k", business_key=f"k{i}m"),
                when,
            )
        )
        made.append(("sms", sms(world.acme, business_key=f"k{i}s"), when + timedelta(minutes=1)))
    for channel, record_id, when in made:
        model = MailSendRecord if channel == "mail" else SmsSendRecord
        db.session.execute(update(model).where(model.id == record_id).values(created_time=when))
    db.session.commit()
    # "k" reads as a subject word (mail) and a provider message id (both channels).
    client, _ = signed_in(app, SUPPORT)
    seen: list[str] = []
    url = "/search/?q=k"
    for channel, record_id, _ in made:
        if channel == "sms":
            db.session.add(
                SendAttempt(
                    tenant_id=world.acme,
                    channel="sms",
                    record_id=record_id,
                    number=1,
                    started_at=start,
                    outcome="sent",
                    ambiguous=False,
                    provider_message_id="k",
                )
            )
    db.session.commit()
    for _ in range(5):
        page = client.get(url).text
        seen += re.findall(r'href="/(mail|sms)-records/(\d+)">Record', page)
        older = re.search(r'href="([^"]*)" rel="next"', page)
        if older is None:
            break
        url = older.group(1).replace("&amp;", "&")
    expected = [(c, str(r)) for c, r, _ in sorted(made, key=lambda m: m[2], reverse=True)]
    assert [(c, r) for c, r in seen] == expected


def test_the_operator_searches_every_tenant(app: Flask, world: World) -> None:
    page = results(app, "ann@example.com", OPERATOR, "all")
    assert mail_link(world.mail) in page
    assert mail_link(world.mail_other) in page
    assert "every tenant" in understood(page)


def test_each_list_reads_the_box_the_same_way(app: Flask, world: World) -> None:
    client, _ = signed_in(app, SUPPORT)
    page = client.get("/sms-records/", query_string={"q": "07911 123456"}).text
    assert sms_link(world.sms) in page
    page = client.get("/mail-records/", query_string={"q": "@example.com"}).text
    assert mail_link(world.mail) in page
    page = client.get("/sms-records/", query_string={"q": "Invoice March"}).text
    assert "never a sms" in page


def test_too_long_a_search_is_a_422(app: Flask, world: World) -> None:
    client, _ = signed_in(app, SUPPORT)
    response = client.get("/search/", query_string={"q": "x" * (MAX_SEARCH_CHARS + 1)})
    assert response.status_code == 422


# --- the recipient page -------------------------------------------------------------------------


def recipient_href(page: str, address: str) -> str:
    found = re.search(r'href="(/recipients/[A-Za-z0-9_-]+)"[^>]*>' + re.escape(address), page)
    assert found is not None, address
    return found.group(1)


def test_the_recipient_page_from_a_search_result(app: Flask, world: World) -> None:
    older = mail(
        world.acme,
        to="ann@example.com",
        status="Sent",
        subject="Earlier",
        sent_at=datetime(2026, 1, 2, tzinfo=UTC),
        read_at=datetime(2026, 1, 3, tzinfo=UTC),
    )
    suppression.suppress(
        db.session(),
        world.acme,
        "mail",
        "ann@example.com",
        suppression.SuppressionReason.HARD_BOUNCE,
        detail="550 5.1.1 user unknown",
        by="bounce mailbox",
        record_id=world.mail,
    )
    db.session.add(
        DeliveryEvent(
            tenant_id=world.acme,
            channel="mail",
            config_id=1,
            provider="smtp",
            dedup_key="b1",
            recipient="ann@example.com",
            event_type="bounced",
            record_id=world.mail,
        )
    )
    db.session.commit()
    client, _ = signed_in(app, SUPPORT)
    page = client.get("/search/", query_string={"q": "ann@example.com"}).text
    href = recipient_href(page, "ann@example.com")
    assert "ann" not in href  # the address stays out of the URL
    response = client.get(href)
    assert response.status_code == 200
    assert response.headers["Referrer-Policy"] == "same-origin"
    text = response.text
    assert mail_link(world.mail) in text
    assert mail_link(older) in text
    assert mail_link(world.mail_other) not in text
    assert "50 %" in text  # one sent, one failed
    assert "2026-01-02 00:00:00" in text  # last delivered
    assert "Suppressed" in text
    assert "a hard bounce" in text
    assert "bounce mailbox" in text
    assert "A tenant admin can take it off the list" in text  # support cannot
    assert "Bounced" in text
    assert "Read 2026-01-03 00:00:00" in text
    assert "Most recent failure" in text
    assert "What to do:" in text
    admin, _ = signed_in(app, ADMIN)
    assert "Take off the suppression list" in admin.get(href).text


def test_another_tenants_recipient_token_is_a_404(app: Flask, world: World) -> None:
    operator, _ = signed_in(app, OPERATOR, "all")
    page = operator.get("/search/", query_string={"q": "+447911123456"}).text
    hrefs = set(re.findall(r'href="(/recipients/[A-Za-z0-9_-]+)"', page))
    assert len(hrefs) == 2  # acme's and globex's: one token each
    tokens = {
        row.tenant_id: f"/recipients/{row.token}"
        for row in db.session.scalars(select(RecipientToken))
    }
    client, _ = signed_in(app, SUPPORT)
    assert client.get(tokens[world.acme]).status_code == 200
    assert client.get(tokens[world.globex]).status_code == 404
    assert client.get("/recipients/not-a-token").status_code == 404
    assert operator.get(tokens[world.globex]).status_code == 200


def test_the_recipient_page_pages_by_keyset(
    app: Flask, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("portal.web.records.recipients.PAGE_SIZE", 2)
    ids = [sms(world.acme, number="+447911123457") for _ in range(3)]
    client, _ = signed_in(app, SUPPORT)
    page = client.get("/search/", query_string={"q": "07911 123457"}).text
    href = recipient_href(page, "+447911123457")
    first = client.get(href).text
    assert sms_link(ids[2]) in first
    assert sms_link(ids[1]) in first
    assert sms_link(ids[0]) not in first
    older = re.search(r'href="([^"]*)" rel="next"', first)
    assert older is not None
    second = client.get(older.group(1).replace("&amp;", "&")).text
    assert sms_link(ids[0]) in second


def test_every_record_page_links_its_recipients(app: Flask, world: World) -> None:
    cc = mail(world.acme, to="dana@example.com", cc_addrs=["Eve@Example.com"], subject="Copy")
    client, _ = signed_in(app, SUPPORT)
    page = client.get(f"/mail-records/{cc}").text
    for address in ("dana@example.com", "Eve@Example.com"):
        assert client.get(recipient_href(page, address)).status_code == 200
    page = client.get(f"/sms-records/{world.sms}").text
    recipient = client.get(recipient_href(page, "+447911123456")).text
    assert sms_link(world.sms) in recipient


# --- the tenant's country ------------------------------------------------------------------------


def test_import_config_sets_keeps_and_checks_the_country(app: Flask, world: World) -> None:
    from portal.importer import ConfigImportError, import_config

    tenant = {"slug": "acme", "name": "Acme"}
    import_config(db.session(), {"tenants": [tenant | {"country": "de"}]})
    db.session.commit()
    assert db.session.get(Tenant, world.acme).country == "DE"  # type: ignore[union-attr]
    import_config(db.session(), {"tenants": [tenant]})  # omitted: kept
    db.session.commit()
    assert db.session.get(Tenant, world.acme).country == "DE"  # type: ignore[union-attr]
    with pytest.raises(ConfigImportError, match="ISO 3166"):
        import_config(db.session(), {"tenants": [tenant | {"country": "XX"}]})
    db.session.rollback()
    import_config(db.session(), {"tenants": [tenant | {"country": None}]})  # the default
    db.session.commit()
    assert db.session.get(Tenant, world.acme).country is None  # type: ignore[union-attr]


def test_the_tenant_settings_page_sets_the_country(app: Flask, world: World) -> None:
    berlin = sms(world.acme, number="+49301234567")
    admin, csrf = signed_in(app, ADMIN)
    assert "(the platform default)" in admin.get("/tenant-settings/").text
    bad = admin.post("/tenant-settings/", data={"country": "XX", "csrf_token": csrf})
    assert bad.status_code == 422
    assert "two-letter country code" in bad.text
    saved = admin.post("/tenant-settings/", data={"country": "de", "csrf_token": csrf})
    assert saved.status_code == 303
    db.session.expire_all()
    assert db.session.get(Tenant, world.acme).country == "DE"  # type: ignore[union-attr]
    assert sms_link(berlin) in results(app, "030 1234567")
    support, _ = signed_in(app, SUPPORT)
    assert support.get("/tenant-settings/").status_code == 403


# --- both dialects: the triggers and LIKE's fallback ---------------------------------------------


def test_the_side_tables_and_conditions_on_each_dialect(any_app: Flask) -> None:
    """PostgreSQL (trigram indexes) and SQLite (plain LIKE): the subject triggers write the
    side table, and each kind of term finds its record and nothing else."""
    from portal.models import Channel
    from tests.conftest import make_tenant

    tenant = make_tenant("dialect").id
    db.session.commit()
    ids = [
        mail(tenant, to=f"{name}@shop.example.org", subject=f"{name} 50% off")
        for name in ("ann", "bob")
    ]
    db.session.execute(
        update(MailSendRecord)
        .where(MailSendRecord.id == ids[1])
        .values(rendered_subject="Rendered")
    )
    db.session.commit()

    def found(typed: str) -> list[int]:
        meaning = search.interpret(typed, "GB")
        where = search.conditions(meaning, Channel.MAIL, lambda column: column == tenant)
        assert where is not None
        stmt = select(MailSendRecord.id).where(where).order_by(MailSendRecord.id)
        return list(db.session.scalars(stmt))

    assert found("ann@shop.example.org") == [ids[0]]
    assert found("ANN") == [ids[0]]
    assert found("bob@") == [ids[1]]
    assert found("@shop.example.org") == ids
    assert found("0% off") == ids  # % taken literally
    assert found("rendered") == [ids[1]]
    assert found("nobody") == []
    assert found("ann 50% off") == [ids[0]]
    assert found("50% ann off") == []
    # With an identifier in the text the index looks up that word alone (search.index_word);
    # the whole text is still what matches (in that order, with those spaces).
    shipped = mail(tenant, to="john.smith1984@mail.example", subject="Order AB12345 shipped")
    other = mail(tenant, to="smith1984@mail.example", subject="AB12345 shipped, order")
    assert found("order ab12345 SHIPPED") == [shipped]
    assert found("order  ab12345 shipped") == []
    assert found("order-ab12345") == []  # also an address part and a business key: neither
    assert found("ab12345 shipped") == [shipped, other]
    assert found("john.smith1984") == [shipped]
    assert found("n.smith1984@mail") == [shipped]
    assert found("smith1984@") == [other]  # a prefix: the btree, no index word
