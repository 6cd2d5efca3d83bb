"""The simulator's recipients (portal/simulator.py) end where its table says: each mail address
through the demo's own SMTP sink (scripts/smtp_sink.py, served in this process on a free port)
and each number through the ``test`` SMS provider, delivered by the worker's own code with a
short retry schedule. Any other recipient is accepted as before; the editor's Send test lists
them; the run command prints a curl that fails on purpose."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from flask import Flask

from portal import simulator
from portal.extensions import db
from portal.messaging.sending.backoff import BackoffPolicy
from portal.messaging.sending.pipeline import MailContext
from portal.models import MailTemplate, SendStatus, SmsTemplate
from portal.simulator import Behaviour, Simulated
from tests.integration.test_portal_templates import Portal, world
from tests.support.delivery import accept_mail, mail_server, record, tenant
from tests.support.route_walker import free_port
from tests.support.sms import accept_sms, drain_sms, drain_with, provider, sms_record

__all__ = ["world"]

ROOT = Path(__file__).resolve().parents[2]
# Two retries, tens of milliseconds apart: a dead letter after three attempts, in well under
# a second.
POLICY = BackoffPolicy(max_retries=2, base_s=0.02, jitter=0.0)
RETRIES = POLICY.max_retries


def _script(name: str) -> ModuleType:
    """A module of scripts/ (not a package), loaded from its file."""
    spec = importlib.util.spec_from_file_location(f"postroom_{name}", ROOT / "scripts" / name)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SINK = _script("smtp_sink.py")


@dataclass
class Sink:
    host: str
    port: int
    directory: Path

    def kept(self) -> list[Path]:
        return sorted(self.directory.glob("*.eml"))


@pytest.fixture
def sink(tmp_path: Path) -> Iterator[Sink]:
    """The demo's SMTP sink, its real handler, on a free port."""
    running = Sink("127.0.0.1", free_port(), tmp_path / "mail-sink")
    controller = SINK.start(running.host, running.port, running.directory)
    try:
        yield running
    finally:
        controller.stop()


@dataclass(frozen=True)
class End:
    """Where a record ends: status, retries used, error code (prefix), ambiguous attempt."""

    status: SendStatus
    retries: int
    code: str | None = None
    ambiguous: bool = False


MAIL_ENDS = {
    Behaviour.REFUSED: End(SendStatus.FAILED, 0, "550 5.1.1"),
    Behaviour.TEMPORARY_ONCE: End(SendStatus.SENT, 1),
    Behaviour.TEMPORARY_ALWAYS: End(SendStatus.DEAD_LETTER, RETRIES, "451 4.3.0"),
    Behaviour.NO_ANSWER: End(SendStatus.DEAD_LETTER, RETRIES, "NETWORK_ERROR", ambiguous=True),
    Behaviour.SLOW: End(SendStatus.SENT, 0),
}
# How many copies the sink keeps: one per attempt that got as far as the end of DATA.
MAIL_KEPT = {
    Behaviour.REFUSED: 0,
    Behaviour.TEMPORARY_ONCE: 1,
    Behaviour.TEMPORARY_ALWAYS: 0,
    Behaviour.NO_ANSWER: RETRIES + 1,
    Behaviour.SLOW: 1,
}
SMS_ENDS = {
    Behaviour.REFUSED: End(SendStatus.FAILED, 0, "SMS_RECIPIENT_REFUSED"),
    Behaviour.TEMPORARY_ONCE: End(SendStatus.SENT, 1),
    Behaviour.TEMPORARY_ALWAYS: End(SendStatus.DEAD_LETTER, RETRIES, "SMS_PROVIDER_ERROR"),
    Behaviour.NO_ANSWER: End(SendStatus.DEAD_LETTER, RETRIES, "TIMEOUT", ambiguous=True),
    Behaviour.SLOW: End(SendStatus.SENT, 0),
}


def _ended(row: Any, end: End) -> None:
    seen = (SendStatus(row.status), row.retry_count, bool(row.ambiguous_attempt))
    why = (row.error_code, row.error_message)
    assert seen == (end.status, end.retries, end.ambiguous), why
    if end.code is not None:
        assert (row.error_code or "").startswith(end.code), (row.error_code, row.error_message)


def _deliver_mail(app: Flask, *, read_timeout_s: float = simulator.SLOW_S + 5) -> float:
    """Deliver every due mail as a worker would, with this test's schedule; the seconds it took."""
    settings = app.config["SETTINGS"].replace(smtp_read_timeout_s=read_timeout_s)
    ctx = MailContext(engine=db.engine, settings=settings, policy=POLICY)
    started = time.monotonic()
    try:
        drain_with(ctx, timeout_s=30)
    finally:
        ctx.pool.close_all()
    return time.monotonic() - started


def _ids(entry: Simulated) -> str:
    return entry.behaviour.value


# --- mail --------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", simulator.MAIL.values(), ids=_ids)
def test_each_simulator_address_ends_where_the_table_says(
    app: Flask, sink: Sink, entry: Simulated
) -> None:
    acme = tenant("acme")
    mail_server(acme.id, sink)  # host and port are all it reads
    db.session.commit()
    record_id = accept_mail(app, acme.id, to=[entry.address])
    took = _deliver_mail(app)
    _ended(record(record_id), MAIL_ENDS[entry.behaviour])
    assert len(sink.kept()) == MAIL_KEPT[entry.behaviour]
    if entry.behaviour is Behaviour.SLOW:
        assert took >= simulator.SLOW_S


def test_any_other_address_is_accepted_and_kept(app: Flask, sink: Sink) -> None:
    acme = tenant("acme")
    mail_server(acme.id, sink)
    db.session.commit()
    record_id = accept_mail(app, acme.id, to=[f"someone@{simulator.MAIL_DOMAIN}"])
    _deliver_mail(app)
    _ended(record(record_id), End(SendStatus.SENT, 0))
    assert len(sink.kept()) == 1


def test_temporary_once_fails_the_first_attempt_of_every_message(app: Flask, sink: Sink) -> None:
    acme = tenant("acme")
    mail_server(acme.id, sink)
    db.session.commit()
    address = simulator.MAIL[Behaviour.TEMPORARY_ONCE].address.upper()  # any case
    first = accept_mail(app, acme.id, to=[address])
    _deliver_mail(app)
    second = accept_mail(app, acme.id, to=[address])
    _deliver_mail(app)
    for record_id in (first, second):
        _ended(record(record_id), End(SendStatus.SENT, 1))


def test_no_answer_on_a_server_that_holds_is_uncertain_at_once(app: Flask, sink: Sink) -> None:
    acme = tenant("acme")
    mail_server(acme.id, sink, uncertain_policy="hold")
    db.session.commit()
    record_id = accept_mail(app, acme.id, to=[simulator.MAIL[Behaviour.NO_ANSWER].address])
    _deliver_mail(app)
    _ended(record(record_id), End(SendStatus.UNCERTAIN, 0, "NETWORK_ERROR", ambiguous=True))
    assert len(sink.kept()) == 1


# --- SMS ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", simulator.SMS.values(), ids=_ids)
def test_each_simulator_number_ends_where_the_table_says(app: Flask, entry: Simulated) -> None:
    acme = tenant("acme")
    provider(acme.id, "test", None)
    db.session.commit()
    record_id = accept_sms(app, acme.id, phoneNumber=entry.address)
    started = time.monotonic()
    drain_sms(app, policy=POLICY, timeout_s=30)
    _ended(sms_record(record_id), SMS_ENDS[entry.behaviour])
    if entry.behaviour is Behaviour.SLOW:
        assert time.monotonic() - started >= simulator.SLOW_S


def test_any_other_number_is_accepted(app: Flask) -> None:
    acme = tenant("acme")
    provider(acme.id, "test", None)
    db.session.commit()
    record_id = accept_sms(app, acme.id, phoneNumber="+442079460999")
    drain_sms(app, policy=POLICY)
    row = sms_record(record_id)
    _ended(row, End(SendStatus.SENT, 0))
    assert row.provider_message_id == f"test-postroom-sms-{record_id}"


def test_no_answer_on_a_provider_that_holds_is_uncertain_at_once(app: Flask) -> None:
    acme = tenant("acme")
    provider(acme.id, "test", None, uncertain_policy="hold")
    db.session.commit()
    record_id = accept_sms(app, acme.id, phoneNumber=simulator.SMS[Behaviour.NO_ANSWER].address)
    drain_sms(app, policy=POLICY)
    _ended(sms_record(record_id), End(SendStatus.UNCERTAIN, 0, "TIMEOUT", ambiguous=True))


def test_slow_beyond_the_read_timeout_is_no_answer(app: Flask) -> None:
    acme = tenant("acme")
    provider(acme.id, "test", None, uncertain_policy="hold")
    db.session.commit()
    record_id = accept_sms(app, acme.id, phoneNumber=simulator.SMS[Behaviour.SLOW].address)
    drain_sms(app, policy=POLICY, read_timeout_s=0.2)
    _ended(sms_record(record_id), End(SendStatus.UNCERTAIN, 0, "TIMEOUT", ambiguous=True))


# --- where people find it ----------------------------------------------------------------------


def test_the_table_names_every_behaviour_once_per_channel() -> None:
    for table in (simulator.MAIL, simulator.SMS):
        assert set(table) == {b.value for b in Behaviour}
        assert all(entry.does and entry.shows for entry in table.values())
    for entry in simulator.MAIL.values():
        assert simulator.mail_behaviour(f"<{entry.address.upper()}>") is entry.behaviour
    for entry in simulator.SMS.values():
        assert simulator.sms_behaviour(entry.address) is entry.behaviour
    assert simulator.mail_behaviour("refused@example.com") is None
    assert simulator.sms_behaviour("+447911123456") is None


def test_send_test_lists_the_simulator_recipients(app: Flask, world: dict[str, Any]) -> None:
    admin = Portal(app, "admin@acme.test")
    mail = db.session.get(MailTemplate, world["acme"]["mail"])
    sms = db.session.get(SmsTemplate, world["acme"]["sms"])
    assert mail is not None
    assert sms is not None
    mail_page = admin.get(f"/mail-templates/{mail.id}/edit").text
    sms_page = admin.get(f"/sms-templates/{sms.id}/edit").text
    assert 'id="send-test-simulator"' in mail_page
    for entry in simulator.MAIL.values():
        assert entry.address in mail_page
        assert entry.address not in sms_page
    for entry in simulator.SMS.values():
        assert entry.address in sms_page
        assert entry.address not in mail_page
    # The fragment Send test answers with lists them too.
    answer = admin.post(
        f"/sms-templates/{sms.id}/send-test",
        {
            "code": "otp",
            "name": "OTP",
            "content": "Code {{ code }}",
            "enabled": "on",
            "stream": "transactional",
            "variables": '{"code": "1"}',
            "phone": simulator.SMS[Behaviour.REFUSED].address,
        },
        htmx=True,
    )
    assert answer.status_code == 200, answer.text
    assert simulator.SMS[Behaviour.SLOW].address in answer.text


def test_the_run_command_prints_a_curl_that_fails_on_purpose(monkeypatch: Any) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    run = _script("run.py")
    text = run._curls("http://127.0.0.1:5000", "pk_x", Path("instance"), run.DEMO_RETRIES)
    refused = simulator.MAIL[Behaviour.REFUSED].address
    assert text.count("curl -s http://127.0.0.1:5000/api/v1/mail") == 2
    assert f'"to": ["{refused}"]' in text
    assert "search box" in text
