"""The embedded default for real: what the README's run command starts (past its install
step), with no DATABASE_URL or REDIS_URL, delivers a mail sent over HTTP to its SMTP sink."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = json.loads((ROOT / "demo" / "demo-config.json").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_run_command_serves_the_api_and_delivers_to_its_smtp_sink(tmp_path: Path) -> None:
    port, smtp_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env |= {"WORKER_METRICS_PORT": "0", "POLL_INTERVAL_S": "0.2"}
    instance = tmp_path / "instance"
    log = (tmp_path / "run.log").open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "scripts/run.py",
            "--port",
            str(port),
            "--smtp-port",
            str(smtp_port),
            "--instance",
            str(instance),
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        # Migrating, seeding the demo (its passwords hashed at the production cost) and
        # starting four processes: 15 s on an idle machine, over 60 s beside a busy test run.
        wait_for(lambda: healthy(url), 150, "the portal")
        assert (instance / "postroom.db").exists()  # SQLite under the instance folder
        token = DEMO["apiKeys"][0]["token"]
        body = json.dumps(
            {"to": ["you@example.com"], "templateCode": "welcome", "variables": {"name": "Ann"}}
        ).encode()
        request = urllib.request.Request(
            f"{url}/api/v1/mail",
            data=body,
            method="POST",
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 202
            record_id = json.loads(response.read())["id"]
        sink = instance / "mail-sink"
        wait_for(lambda: any(sink.glob("*.eml")), 30, "the mail at the SMTP sink")
        (mail,) = sink.glob("*.eml")
        text = mail.read_text()
        assert "Subject: Welcome, Ann" in text
        assert f"X-Postroom-Record: {record_id}" in text

        def status() -> str:
            shown = urllib.request.Request(
                f"{url}/api/v1/mail/{record_id}", headers={"Authorization": f"Bearer {token}"}
            )
            with urllib.request.urlopen(shown, timeout=5) as response:
                return str(json.loads(response.read())["status"])

        wait_for(lambda: status() == "Sent", 60, "the record to be Sent")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=45)
        except subprocess.TimeoutExpired:
            process.kill()
            code = -9
        log.close()
        output = (tmp_path / "run.log").read_text(errors="replace")
        print(output[-5000:])
    assert code == 0
