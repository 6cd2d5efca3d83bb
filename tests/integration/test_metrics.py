"""Metrics and logs ("Monitoring and troubleshooting"): the portal's and the worker's /metrics
expose the counters and the backlog read from the database; the worker writes one JSON object a
line, with record id, tenant and trace id on every delivery line, at the seed's levels."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from flask import Flask
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from portal.extensions import db
from portal.messaging.sending.backoff import BackoffPolicy
from portal.models import MailSendRecord, MailTemplate
from tests.support.delivery import accept_mail, drain, mail_server, tenant
from tests.support.smtp_server import ScriptedSmtpServer
from tests.support.workers import (
    Worker,
    WorkerGroup,
    accept_abandoned,
    free_port,
    stop,
    wait_for,
    worker_group,
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
FAMILIES = (
    "message_sent",
    "message_failed",
    "message_send_duration_seconds",
    "message_backlog",
    "message_oldest_due_age_seconds",
)
SERVER = "acme-smtp"


def parse(text: str) -> tuple[set[str], Samples]:
    """Family names and every sample, keyed by (name, labels)."""
    families: set[str] = set()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return families, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
def acme(app: Flask, smtp: ScriptedSmtpServer) -> int:
    row = tenant("acme")
    mail_server(row.id, smtp, name=SERVER)
    db.session.commit()
    return row.id


def scrape_portal(app: Flask) -> tuple[set[str], Samples]:
    response = app.test_client().get("/metrics")
    assert response.status_code == 200
    assert response.mimetype == "text/plain"
    return parse(response.get_data(as_text=True))


# --- the portal ------------------------------------------------------------------------------


def test_portal_metrics_show_the_backlog_by_channel_and_status(app: Flask, acme: int) -> None:
    # Two records in Retry, not due for a minute (a slow back-off), one abandoned in Sending ...
    slow = BackoffPolicy(max_retries=5, base_s=60.0, quota_floor_s=60.0, retry_after_cap_s=60.0)
    retry = [accept_mail(app, acme, to=[f"r421-{i}@example.com"]) for i in range(2)]
    drain(app, policy=slow, until=lambda: True)  # until nothing is due
    accept_abandoned(app, acme)
    # ... and three Pending, the oldest accepted a little while ago.
    pending = [accept_mail(app, acme, to=[f"p{i}@example.com"]) for i in range(3)]
    time.sleep(0.3)
    statuses = dict(
        db.session.execute(
            select(MailSendRecord.id, MailSendRecord.status).where(
                MailSendRecord.id.in_(retry + pending)
            )
        ).all()
    )
    db.session.rollback()
    assert statuses == dict.fromkeys(retry, "Retry") | dict.fromkeys(pending, "Pending")

    families, samples = scrape_portal(app)
    assert set(FAMILIES) <= families
    backlog = {
        status: value(samples, "message_backlog", channel="mail", status=status)
        for status in ("Pending", "Retry", "Sending", "Uncertain")
    }
    assert backlog == {"Pending": 3, "Retry": 2, "Sending": 1, "Uncertain": 0}
    assert {
        value(samples, "message_backlog", channel="sms", status=s)
        for s in ("Pending", "Retry", "Sending", "Uncertain")
    } == {0}
    age = value(samples, "message_oldest_due_age_seconds", channel="mail")
    assert 0.3 <= age < 30, age
    assert value(samples, "message_oldest_due_age_seconds", channel="sms") == 0

    # Once nothing is due (the Retry ones wait a minute), the oldest-due age is 0.
    drain(app, policy=slow, until=lambda: True)
    _, samples = scrape_portal(app)
    assert value(samples, "message_backlog", channel="mail", status="Pending") == 0
    assert value(samples, "message_oldest_due_age_seconds", channel="mail") == 0


def test_portal_metrics_count_sends_and_failures_by_outcome(
    app: Flask, acme: int, smtp: ScriptedSmtpServer
) -> None:
    _, before = scrape_portal(app)
    accept_mail(app, acme, to=["ok@example.com"])
    accept_mail(app, acme, to=["r550@example.com"])  # permanent: Failed
    accept_mail(app, acme, to=["r421@example.com"])  # transient: Retry, then DeadLetter
    one_retry = BackoffPolicy(max_retries=1, base_s=0.02, quota_floor_s=0.05, retry_after_cap_s=1)
    drain(app, policy=one_retry)
    _, after = scrape_portal(app)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("message_sent_total", channel="mail", provider=SERVER) == 1
    for outcome in ("retry", "failed", "dead_letter"):
        assert moved("message_failed_total", channel="mail", provider=SERVER, outcome=outcome) == 1
    assert moved("message_send_duration_seconds_count", channel="mail") == 4  # attempts
    assert len(smtp.messages) == 1


# --- the worker ------------------------------------------------------------------------------


def start_worker(app: Flask, group: WorkerGroup, **env: str) -> Worker:
    worker = group.start(**env)
    worker.wait_ready()
    return worker


def settle(ids: list[int], worker: Worker, timeout_s: float = 20.0) -> dict[int, str]:
    def settled() -> dict[int, str] | None:
        assert worker.process.poll() is None, f"{worker.name} exited"
        rows = dict(
            db.session.execute(
                select(MailSendRecord.id, MailSendRecord.status).where(MailSendRecord.id.in_(ids))
            ).all()
        )
        db.session.rollback()
        done = all(s in ("Sent", "Failed", "DeadLetter") for s in rows.values())
        return rows if done else None

    return wait_for(settled, timeout_s, "records settled", poll_s=0.1)


WORKER_ENV = {
    "MAIL_SEND_CONCURRENCY": "2",
    "SMS_SEND_CONCURRENCY": "2",
    "MAX_RETRIES": "1",
    "BACKOFF_BASE_S": "0.1",
    "SHUTDOWN_GRACE_S": "3",
    "SWEEP_INTERVAL_S": "1",
    "STUCK_SEND_THRESHOLD_S": "60",
}


def deliver_mixed(app: Flask, acme: int) -> dict[str, int]:
    return {
        "ok-1": accept_mail(app, acme, to=["ok-1@example.com"]),
        "ok-2": accept_mail(app, acme, to=["ok-2@example.com"]),
        "failed": accept_mail(app, acme, to=["r550@example.com"]),
        "dead": accept_mail(app, acme, to=["r421@example.com"]),
    }


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_worker_metrics_port_serves_the_same_families(
    app: Flask, acme: int, tmp_path: Path
) -> None:
    port = free_port()
    with worker_group(
        tmp_path, app.config["SETTINGS"].secret_key, **WORKER_ENV, WORKER_METRICS_PORT=str(port)
    ) as group:
        worker = start_worker(app, group)
        ids = deliver_mixed(app, acme)
        final = settle(list(ids.values()), worker)
        assert final == {
            ids["ok-1"]: "Sent",
            ids["ok-2"]: "Sent",
            ids["failed"]: "Failed",
            ids["dead"]: "DeadLetter",
        }
        accept_abandoned(app, acme)  # one in Sending, not yet stuck (threshold 60 s)

        response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert response.status_code == 200
        families, samples = parse(response.text)
        assert set(FAMILIES) <= families
        # A fresh process: its counters are exactly what it did.
        assert value(samples, "message_sent_total", channel="mail", provider=SERVER) == 2
        for outcome in ("retry", "failed", "dead_letter"):
            assert (
                value(
                    samples,
                    "message_failed_total",
                    channel="mail",
                    provider=SERVER,
                    outcome=outcome,
                )
                == 1
            ), outcome
        assert value(samples, "message_send_duration_seconds_count", channel="mail") == 5
        assert value(samples, "message_backlog", channel="mail", status="Sending") == 1
        assert value(samples, "message_backlog", channel="mail", status="Pending") == 0
        assert ("message_oldest_due_age_seconds", frozenset({("channel", "mail")})) in samples
        stop([worker])


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_worker_logs_are_json_lines_with_record_tenant_and_trace(
    app: Flask, acme: int, tmp_path: Path
) -> None:
    with worker_group(tmp_path, app.config["SETTINGS"].secret_key, **WORKER_ENV) as group:
        worker = start_worker(app, group)
        ids = deliver_mixed(app, acme)
        # A marker-code failure: a template that does not render (Failed before any send;
        # an unknown code is refused at acceptance).
        broken = MailTemplate(
            tenant_id=acme, code="broken", subject="Hi", text_body="{{ x | no_such_filter }}"
        )
        db.session.add(broken)
        db.session.commit()
        ids["marker"] = accept_mail(
            app,
            acme,
            to=["t@example.com"],
            subject=None,
            text=None,
            templateCode="broken",
            variables={"x": 1},
        )
        settle(list(ids.values()), worker)
        stop([worker])

        lines = worker.stderr_lines()
        assert lines
        for line in lines:
            entry = json.loads(line)  # every line, not only the ones we look at
            assert isinstance(entry, dict), line
            assert {"ts", "level", "logger", "msg"} <= set(entry), line

        traces = dict(
            db.session.execute(
                select(MailSendRecord.id, MailSendRecord.trace_id).where(
                    MailSendRecord.id.in_(ids.values())
                )
            ).all()
        )
        db.session.rollback()
        delivery = [e for e in worker.log_lines() if "record_id" in e]
        assert {e["record_id"] for e in delivery} == set(ids.values())
        for entry in delivery:
            assert entry["tenant_id"] == acme, entry
            assert entry["trace_id"] == traces[entry["record_id"]], entry

        def levels(record_id: int) -> list[tuple[str, str]]:
            # A SERVER_BUSY deferral (the pool's other senders all still busy after a
            # second, as on a slow machine at start-up) is no outcome: left out.
            return [
                (e["level"], e.get("outcome", e["msg"]))
                for e in delivery
                if e["record_id"] == record_id and e.get("error_code") != "SERVER_BUSY"
            ]

        assert levels(ids["ok-1"]) == [("INFO", "sent")]
        assert levels(ids["failed"]) == [("ERROR", "failed")]
        assert levels(ids["dead"]) == [("WARNING", "retry"), ("ERROR", "dead_letter")]
        assert levels(ids["marker"]) == [("ERROR", "failed")]
        (marker,) = [e for e in delivery if e["record_id"] == ids["marker"]]
        assert marker["error_code"] == "TEMPLATE_NOT_RESOLVABLE"


# --- the sweep, run by the worker's chore children -------------------------------------------


def run_a_sweep(
    app: Flask, acme: int, tmp_path: Path, metrics_port: int | None = None
) -> tuple[Worker, int, str]:
    """A worker whose chores sweep one abandoned claim, then send it; returns the worker (its
    logs), the record and the worker's /metrics text read before it stopped."""
    env = WORKER_ENV | {
        "STUCK_SEND_THRESHOLD_S": "1",
        "WORKER_METRICS_PORT": str(metrics_port or 0),
    }
    with worker_group(tmp_path, app.config["SETTINGS"].secret_key, **env) as group:
        worker = start_worker(app, group)
        stuck = accept_abandoned(app, acme)
        assert settle([stuck], worker) == {stuck: "Sent"}
        metrics = ""
        if metrics_port:
            metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        stop([worker])
    return worker, stuck, metrics


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_sweep_by_the_worker_logs_json_and_counts_on_its_metrics_port(
    app: Flask, acme: int, tmp_path: Path
) -> None:
    worker, stuck, metrics = run_a_sweep(app, acme, tmp_path, metrics_port=free_port())
    # (1) its log lines, like every other, are JSON with the record, tenant and trace id
    not_json = [ln for ln in worker.stderr_lines() if not ln.startswith("{")]
    assert not not_json, not_json
    swept = worker.logged("stuck send put back to retry")
    assert [(e["level"], e["record_id"], e["tenant_id"]) for e in swept] == [
        ("WARNING", stuck, acme)
    ]
    assert swept[0]["trace_id"]
    # (2) the worker's /metrics counts it
    _, samples = parse(metrics)
    assert (
        value(samples, "message_failed_total", channel="mail", provider="sweeper", outcome="retry")
        == 1
    )
