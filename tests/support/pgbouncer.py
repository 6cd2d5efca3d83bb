"""A local PgBouncer in transaction mode in front of the test database (Debian's 1.18:
no prepared statements in transaction mode). PgBouncer will not run as root: it runs as the
``postgres`` system user, from a folder of its own."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import make_url

PGBOUNCER = "/usr/sbin/pgbouncer"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def pgbouncer(database_url: str) -> Iterator[str]:
    """Run PgBouncer (transaction mode) in front of ``database_url``'s server; yields the URL
    of the same database through it."""
    if not Path(PGBOUNCER).exists():
        raise pytest.UsageError("pgbouncer is missing: apt-get install pgbouncer (scripts/test.sh)")
    url = make_url(database_url)
    port = _free_port()
    folder = Path(tempfile.mkdtemp(prefix="postroom-pgbouncer-"))
    (folder / "users.txt").write_text(f'"{url.username}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={url.host or '127.0.0.1'} port={url.port or 5432}\n"
        "[pgbouncer]\n"
        "listen_addr = 127.0.0.1\n"
        f"listen_port = {port}\n"
        "auth_type = trust\n"
        f"auth_file = {folder / 'users.txt'}\n"
        "pool_mode = transaction\n"
        "max_client_conn = 500\n"
        "default_pool_size = 20\n"
        "unix_socket_dir =\n"
        f"logfile = {folder / 'pgbouncer.log'}\n"
        "ignore_startup_parameters = extra_float_digits,options\n"
    )
    shutil.chown(folder, "postgres")
    for child in folder.iterdir():
        shutil.chown(child, "postgres")
    process = subprocess.Popen(
        [PGBOUNCER, "-u", "postgres", str(folder / "pgbouncer.ini")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise AssertionError(
                        "pgbouncer did not start: "
                        + (folder / "pgbouncer.log").read_text(errors="replace")[-2000:]
                    ) from None
                time.sleep(0.05)
        yield url.set(host="127.0.0.1", port=port).render_as_string(hide_password=False)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        shutil.rmtree(folder, ignore_errors=True)
