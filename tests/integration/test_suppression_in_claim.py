"""The suppression lookup rides on the claim (migration 0028): on PostgreSQL a claimed
record carries its tenant's active suppressions of its recipients and the configuration epoch,
and the attempt's check answers from them without a statement of its own, exactly as the
lookup would have: case, a forgotten recipient's hashed row, another tenant's and removed rows,
cc and bcc, SMS. A recipient whose normal form is not its ASCII lower case is looked up as
before."""

from __future__ import annotations

from typing import Any

from flask import Flask
from sqlalchemy import update

from portal.extensions import db
from portal.messaging.after_send import suppression
from portal.messaging.sending import claim
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.pipeline import MailContext, process_mail
from portal.messaging.sending.preparation import suppressed_recipients
from portal.models import Channel, ConfigEpoch, MailSendRecord, SmsSendRecord, Suppression
from tests.conftest import make_tenant
from tests.support.delivery import accept_mail, mail_server
from tests.support.sms import UK, accept_sms
from tests.support.smtp_server import ScriptedSmtpServer

FORGOTTEN = "gone@example.com"


def _suppressions(acme: int, other: int) -> None:
    s = db.session
    suppression.suppress(s, acme, Channel.MAIL, "Bob@Example.com", "hard_bounce", by="ops@x.test")
    suppression.suppress(s, acme, Channel.MAIL, FORGOTTEN, "complaint", detail="said so")
    suppression.suppress(s, acme, Channel.MAIL, "was@example.com", "manual")
    suppression.suppress(s, other, Channel.MAIL, "ann@example.com", "manual")
    suppression.suppress(s, acme, Channel.SMS, UK, "complaint")
    db.session.flush()
    # Forgotten: only the address's hash is kept. Removed: no longer active.
    s.execute(
        update(Suppression)
        .where(Suppression.address == FORGOTTEN)
        .values(address=suppression.hashed(FORGOTTEN), detail=None)
    )
    assert suppression.unsuppress(s, acme, Channel.MAIL, "was@example.com", by="ops", reason="ok")
    db.session.commit()


def _claim_all(model: Any) -> dict[int, Any]:
    claimed: dict[int, Any] = {}
    while batch := claim.claim_due(db.engine, model, 5):
        claimed |= {r.id: r for r in batch}
    return claimed


def _looked_up_alone(record: Any) -> tuple[dict[str, str], int]:
    """The same check with what the claim read taken away: the lookup's own statement."""
    saved = vars(record).pop(claim._LOOKED)
    try:
        return suppressed_recipients(db.engine, record)
    finally:
        vars(record)[claim._LOOKED] = saved


def test_a_claimed_record_answers_the_suppression_check_as_the_lookup_does(app: Flask) -> None:
    acme = make_tenant("acme").id
    other = make_tenant("other").id
    _suppressions(acme, other)
    cases = {
        "case": accept_mail(app, acme, to=["BOB@example.COM"]),
        "mixed": accept_mail(app, acme, to=["ann@example.com"], cc=["bob@example.com"]),
        "forgotten in bcc": accept_mail(app, acme, to=["ann@example.com"], bcc=[FORGOTTEN]),
        "removed and other tenant's": accept_mail(app, acme, to=["was@example.com"]),
        "none": accept_mail(app, acme, to=["carol@example.com", "dan@example.com"]),
        "all three lists": accept_mail(
            app, acme, to=["Bob@Example.com"], cc=[FORGOTTEN.upper()], bcc=["bob@example.com"]
        ),
    }
    epoch = db.session.get(ConfigEpoch, 1) or ConfigEpoch(id=1, epoch=41)
    epoch.epoch += 1
    db.session.add(epoch)
    db.session.commit()
    claimed = _claim_all(MailSendRecord)
    assert set(claimed) == set(cases.values())
    answers = {}
    for name, rid in cases.items():
        record = claimed[rid]
        look = claim.looked(record)
        assert look is not None, name
        assert look.epoch == epoch.epoch
        # No statement of its own: it cannot even reach a database.
        answer = suppressed_recipients(None, record)  # type: ignore[arg-type]
        assert answer == _looked_up_alone(record), name
        answers[name] = answer
    assert answers["case"] == ({"bob@example.com": answers["case"][0]["bob@example.com"]}, 1)
    assert answers["case"][0]["bob@example.com"].startswith("hard bounce since ")
    assert answers["case"][0]["bob@example.com"].endswith(" UTC by ops@x.test")
    assert set(answers["mixed"][0]) == {"bob@example.com"}
    assert answers["forgotten in bcc"][0] == {FORGOTTEN: answers["forgotten in bcc"][0][FORGOTTEN]}
    assert "complaint since" in answers["forgotten in bcc"][0][FORGOTTEN]
    assert answers["removed and other tenant's"] == ({}, 1)
    assert answers["none"] == ({}, 2)
    assert set(answers["all three lists"][0]) == {"bob@example.com", FORGOTTEN}
    assert answers["all three lists"][1] == 2


def test_recipients_the_claim_cannot_normalise_are_looked_up_on_their_own(app: Flask) -> None:
    acme = make_tenant("acme").id
    other = make_tenant("other").id
    _suppressions(acme, other)
    rid = accept_mail(app, acme, to=["ann@example.com"])
    # Written as a client might have (acceptance keeps what it was given): blanks around it,
    # angle brackets, a non-ASCII local part. Their normal form is not their lower case.
    odd = [" Bob@Example.com ", "<bob@example.com>", "Zoë@example.com"]
    db.session.execute(update(MailSendRecord).where(MailSendRecord.id == rid).values(cc_addrs=odd))
    suppression.suppress(db.session, acme, Channel.MAIL, "zoë@example.com", "manual")
    db.session.commit()
    (record,) = _claim_all(MailSendRecord).values()
    assert claim.looked(record) is not None
    blocked, total = suppressed_recipients(db.engine, record)
    assert set(blocked) == {"bob@example.com", "zoë@example.com"}
    assert total == 3
    assert (blocked, total) == _looked_up_alone(record)


def test_a_claimed_sms_answers_from_the_claim(app: Flask) -> None:
    acme = make_tenant("acme").id
    other = make_tenant("other").id
    _suppressions(acme, other)
    mine = accept_sms(app, acme)
    theirs = accept_sms(app, other)
    claimed = _claim_all(SmsSendRecord)
    answer = suppressed_recipients(None, claimed[mine])  # type: ignore[arg-type]
    assert set(answer[0]) == {UK}
    assert answer[1] == 1
    assert "complaint since" in answer[0][UK]
    assert answer == _looked_up_alone(claimed[mine])
    assert suppressed_recipients(None, claimed[theirs]) == ({}, 1)  # type: ignore[arg-type]


def test_the_next_claim_in_the_sent_write_carries_it_too(app: Flask) -> None:
    acme = make_tenant("acme").id
    other = make_tenant("other").id
    _suppressions(acme, other)
    settings = app.config["SETTINGS"]
    ctx = MailContext(
        engine=db.engine, settings=settings, policy=BackoffPolicy.from_settings(settings)
    )
    with ScriptedSmtpServer() as smtp:
        mail_server(acme, smtp)
        first = accept_mail(app, acme, to=["carol@example.com"])
        (record,) = claim.claim_due(db.engine, MailSendRecord, 1)
        second = accept_mail(app, acme, to=["bob@example.com"])
        # As a pool worker does: the Sent write of one record claims the next.
        with claim.claiming_next(MailSendRecord, lambda: True) as following:
            process_mail(ctx, record)
        assert following.ran
        (after,) = following.records
        assert after.id == second
        look = claim.looked(after)
        assert look is not None
        assert look.suppressions is not None
        assert "bob@example.com" in look.suppressions
        process_mail(ctx, after)
        ctx.close()
        assert [m.rcpt_tos for m in smtp.messages] == [["carol@example.com"]]
    db.session.expire_all()
    assert db.session.get(MailSendRecord, first).status == "Sent"  # type: ignore[union-attr]
    assert db.session.get(MailSendRecord, second).status == "Suppressed"  # type: ignore[union-attr]
