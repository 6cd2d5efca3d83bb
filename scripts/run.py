"""Start the whole service on this machine: SMTP sink, portal and worker, on the embedded
defaults (SQLite and Redis under instance/) unless DATABASE_URL / REDIS_URL say otherwise.

Called by ``make run`` after it has installed the virtualenv; migrates, loads the demo
configuration into an empty database, prints the URL and the demo logins, and stops every
child on Ctrl-C (the worker gets SIGTERM and finishes what it is sending).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from portal.config import Settings
from portal.delivery.children import die_with_parent
from portal.simulator import MAIL, MAIL_DOMAIN

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DEMO_RETRIES = {"MAX_RETRIES": "3", "BACKOFF_BASE_S": "3"}


# A process keeps pool size - 1 of its mail workers in flight to one server, so splitting
# fewer workers than this into processes costs more SMTP sessions than the next core gives.
MAIL_WORKERS_PER_PROCESS = 4


def default_processes(env: dict[str, str]) -> None:
    """DELIVERY_PROCESSES, unless set: one delivery process per core, as long as each keeps
    MAIL_WORKERS_PER_PROCESS mail workers. On 2 cores, 4 + 4 mail workers in two processes
    delivered 1.5x what 8 in one did, but 2 + 2 0.89x what 4 in one did, and three processes
    were no better than two (bench/README.md, "Levers measured"). Only on PostgreSQL: the
    embedded SQLite delivers in one process."""
    if not env.get("DATABASE_URL", "").startswith("postgres"):
        return
    try:
        workers = int(env.get("MAIL_SEND_CONCURRENCY") or Settings.mail_send_concurrency)
    except ValueError:
        return  # the worker says what is wrong with the setting
    cores = os.cpu_count() or 1
    env.setdefault(
        "DELIVERY_PROCESSES", str(max(1, min(cores, workers // MAIL_WORKERS_PER_PROCESS)))
    )


def _run(args: list[str], env: dict[str, str]) -> None:
    subprocess.run(args, cwd=ROOT, env=env, check=True)


def _wait_http(url: str, seconds: float, give_up: Any = lambda: False) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not give_up():
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return True
        except OSError:
            time.sleep(0.2)
    return False


def _curls(url: str, token: str, instance: Path, env: dict[str, str]) -> str:
    """The curls the user tries first: one delivered, and one that fails on purpose."""

    def curl(to: str, name: str) -> str:
        return (
            f"  curl -s {url}/api/v1/mail -H 'Authorization: Bearer {token}' "
            "-H 'Content-Type: application/json' \\\n"
            f'    -d \'{{"to": ["{to}"], "templateCode": "welcome", '
            f'"variables": {{"name": "{name}"}}}}\'\n'
        )

    refused = MAIL["refused"].address
    return (
        f"\nSend a mail:\n{curl('you@example.com', 'Ann')}"
        f"Mail lands in {instance / 'mail-sink'}.\n"
        f"\nSee one fail (the sink refuses {refused} with 550 5.1.1):\n"
        f"{curl(refused, 'Bob')}"
        f"Then sign in as support and type {refused} into the search box at the top "
        "of any page: the record is Failed, and its page says why.\n"
        f"Other addresses @{MAIL_DOMAIN} fail in other ways (retry, dead letter after "
        f"{env['MAX_RETRIES']} retries, no answer, slow): Send test on a template lists them.\n"
        "\nCtrl-C stops everything.\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "5000")))
    parser.add_argument("--smtp-port", type=int, default=2525)
    parser.add_argument("--instance", type=Path, default=None, help="instance folder")
    args = parser.parse_args(argv)

    env = dict(os.environ)
    # The demo's callback receivers, its tenant's SMTP server and test provider run on this
    # machine: allow tenants' configs to reach private addresses.
    env.setdefault("CALLBACK_ALLOW_PRIVATE", "true")
    env.setdefault("OUTBOUND_TENANT_ALLOW_PRIVATE", "true")
    env.setdefault("PUBLIC_BASE_URL", f"http://127.0.0.1:{args.port}")  # invitation links
    # A retry schedule short enough to watch a simulator address become a dead letter (about
    # 3 + 6 + 12 s, with jitter) instead of the production default's quarter of an hour.
    for name, value in DEMO_RETRIES.items():
        env.setdefault(name, value)
    default_processes(env)
    if args.instance is not None:
        env["INSTANCE_PATH"] = str(args.instance.resolve())
    instance = Path(env.get("INSTANCE_PATH", ROOT / "instance"))
    instance.mkdir(parents=True, exist_ok=True)
    env["INSTANCE_PATH"] = str(instance)
    env.setdefault("FLASK_APP", "app")
    flask = [str(BIN / "flask"), "--app", "app"]

    redis_holder: Any = None
    if not env.get("REDIS_URL"):
        # One embedded Redis for every process of the service, held open by this launcher.
        sys.path.insert(0, str(ROOT))
        os.environ["INSTANCE_PATH"] = str(instance)
        from portal.redis_store import connect

        redis_holder = connect(None)
        env["REDIS_URL"] = f"unix://{redis_holder.socket_file}"

    # Prometheus multiprocess mode: every gunicorn worker writes its counters here.
    metrics_dir = instance / "prometheus"
    if metrics_dir.exists():
        for stale in metrics_dir.glob("*.db"):
            stale.unlink()
    metrics_dir.mkdir(exist_ok=True)

    print("postroom: migrating the database", flush=True)
    _run([*flask, "db", "upgrade"], env)
    _run([*flask, "seed-demo", "--if-empty", "--smtp-port", str(args.smtp_port)], env)

    children: list[subprocess.Popen[bytes]] = []
    portal_env = dict(env, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir))
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    # Before any child starts: a signal while the portal is still coming up stops the
    # children too, instead of killing this launcher and leaving them running.
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)

    def start(name: str, command: list[str], child_env: dict[str, str] | None = None) -> None:
        print(f"postroom: starting {name}", flush=True)
        # Each child in its own session: Ctrl-C reaches this launcher only, which then sends
        # one SIGTERM to each (a second signal would make the worker exit at once). Should
        # this launcher die without doing so (SIGKILL), the kernel sends them SIGTERM.
        children.append(
            subprocess.Popen(
                command,
                cwd=ROOT,
                env=child_env or env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        )

    start(
        "SMTP sink",
        [
            sys.executable,
            "scripts/smtp_sink.py",
            "--port",
            str(args.smtp_port),
            "--dir",
            str(instance / "mail-sink"),
        ],
    )
    start(
        "portal",
        [
            str(BIN / "gunicorn"),
            "--config",
            "scripts/gunicorn_conf.py",
            "--workers",
            "2",
            "--threads",
            "4",
            "--bind",
            f"127.0.0.1:{args.port}",
            "--access-logfile",
            "-",
            "app:app",
        ],
        portal_env,
    )
    start("worker", [sys.executable, "worker.py"])

    url = f"http://127.0.0.1:{args.port}"
    if _wait_http(f"{url}/health", 30, lambda: stopping):
        demo = json.loads((ROOT / "demo" / "demo-config.json").read_text())
        print(f"\npostroom is running at {url}\n\nDemo logins:", flush=True)
        for user in demo["users"]:
            print(f"  {user['role']:<18} {user['email']:<26} {user['password']}")
        for key in demo["apiKeys"]:
            print(f"  API key ({key['tenant']}): {key['token']}")
        print(_curls(url, demo["apiKeys"][0]["token"], instance, env), flush=True)
    elif not stopping:
        print("postroom: the portal did not answer within 30 s; see the output above", flush=True)

    while not stopping and all(child.poll() is None for child in children):
        time.sleep(0.2)
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    for child in children:
        try:
            child.wait(timeout=40)
        except subprocess.TimeoutExpired:
            child.kill()
    del redis_holder
    return 0 if stopping else 1


if __name__ == "__main__":
    sys.exit(main())
