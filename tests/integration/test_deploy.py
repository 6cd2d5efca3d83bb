"""deploy/: the Prometheus alert rules pass ``promtool check rules`` and fire
on synthetic series (``promtool test rules``), and every metric the rules and the Grafana
dashboard name exists on the portal's /metrics. promtool comes from Debian's prometheus
package (scripts/test.sh installs it); a missing promtool fails the run."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from flask import Flask

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "postroom-alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "postroom-alerts.test.yml"
DASHBOARD = DEPLOY / "grafana" / "postroom.json"
# Our metric families: every name the rules or the dashboard use starts with one of these.
OURS = re.compile(r"\b((?:message|server|callback|chore|retention|sent_write)_[a-z_]+)")
SUFFIXES = ("_bucket", "_count", "_sum")


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        raise pytest.UsageError("promtool is missing: apt-get install prometheus (scripts/test.sh)")
    return found


def test_the_rules_are_valid_and_each_alert_fires_on_synthetic_series() -> None:
    for args in (["check", "rules", RULES.name], ["test", "rules", RULE_TESTS.name]):
        done = subprocess.run(
            [promtool(), *args], cwd=RULES.parent, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr
    alerts = set(re.findall(r"alert: (\w+)", RULES.read_text()))
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert alerts == tested
    assert len(alerts) == 6


def named_metrics() -> set[str]:
    exprs = re.findall(r"expr: (.+)", RULES.read_text())
    exprs += [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    names = set()
    for expr in exprs:
        for name in OURS.findall(expr):
            for suffix in SUFFIXES:
                name = name.removesuffix(suffix)
            names.add(name)
    return names


def test_every_metric_named_in_rules_and_dashboard_is_on_metrics(app: Flask) -> None:
    names = named_metrics()
    assert {
        "message_oldest_due_age_seconds",
        "server_up",
        "callback_attempts_total",
        "sent_write_batch_size",
    } <= names
    text = app.test_client().get("/metrics").text
    families = set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
    exposed = families | {f"{f}_total" for f in families}
    missing = sorted(n for n in names if n not in exposed)
    assert not missing, f"named in deploy/ but not on /metrics: {missing}"
