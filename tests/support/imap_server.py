"""A real IMAP server for tests: Debian's Dovecot, run as our own instance.

``DovecotServer`` writes a configuration into a fresh directory (IMAP with STARTTLS, and IMAPS,
on free 127.0.0.1 ports, a self-signed certificate, passwd-file users, Maildir under the same
directory), runs ``dovecot -F -c <conf>`` as a child process and stops it on ``stop()``. No
system Dovecot is involved: the test command only installs the package.

Each test takes its own user (``add_user``, from a pool written before the start), so tests
share one server and never see each other's mail. Messages are delivered the way a mail program
files them, by IMAP APPEND.
"""

from __future__ import annotations

import imaplib
import os
import pwd
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from tests.support.smtp_server import self_signed_certificate

DOVECOT = shutil.which("dovecot") or "/usr/sbin/dovecot"
UNPRIVILEGED_MAIL_USER = "nobody"  # mail processes never run as root (and so obey file modes)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class ImapUser:
    """A mailbox on the test server, with what a test needs to fill and inspect it."""

    server: DovecotServer
    name: str
    password: str

    @property
    def maildir(self) -> Path:
        return self.server.root / "home" / self.name / "Maildir"

    def client(self) -> imaplib.IMAP4:
        imap = imaplib.IMAP4("127.0.0.1", self.server.imap_port, timeout=10)
        imap.login(self.name, self.password)
        return imap

    def append(self, raw: bytes, folder: str = "INBOX") -> int:
        """File a message; returns its UID."""
        return self.append_many([raw], folder)[0]

    def append_many(self, messages: list[bytes], folder: str = "INBOX") -> list[int]:
        imap = self.client()
        try:
            uids = []
            for raw in messages:
                typ, data = imap.append(_quoted(folder), None, None, raw)
                assert typ == "OK", data
                m = re.search(rb"APPENDUID \d+ (\d+)", data[0] or b"")
                assert m is not None, data
                uids.append(int(m.group(1)))
            return uids
        finally:
            imap.logout()

    def create(self, folder: str) -> None:
        self._simple("create", folder)

    def delete(self, folder: str) -> None:
        self._simple("delete", folder)

    def flags(self, folder: str = "INBOX") -> dict[int, set[str]]:
        """UID -> flags, read without changing them."""
        imap = self.client()
        try:
            imap.select(_quoted(folder), readonly=True)
            _typ, data = imap.uid("FETCH", "1:*", "(FLAGS)")
            found: dict[int, set[str]] = {}
            for line in data:
                if isinstance(line, bytes):
                    m = re.search(rb"UID (\d+) FLAGS \(([^)]*)\)|FLAGS \(([^)]*)\) UID (\d+)", line)
                    if m:
                        uid = int(m.group(1) or m.group(4))
                        flags = (m.group(2) if m.group(1) else m.group(3)).decode().split()
                        found[uid] = set(flags)
            return found
        finally:
            imap.logout()

    def uidvalidity(self, folder: str = "INBOX") -> int:
        imap = self.client()
        try:
            imap.select(_quoted(folder), readonly=True)
            _typ, data = imap.response("UIDVALIDITY")
            assert data
            assert data[0] is not None
            return int(data[0])
        finally:
            imap.logout()

    def file_of(self, marker: bytes, folder: str = "INBOX") -> Path:
        """The Maildir file holding the one message that contains ``marker``."""
        base = self.maildir if folder == "INBOX" else self.maildir / f".{folder}"
        found = [
            path
            for sub in ("new", "cur")
            for path in (base / sub).iterdir()
            if marker in path.read_bytes()
        ]
        assert len(found) == 1, found
        return found[0]

    def _simple(self, command: str, folder: str) -> None:
        imap = self.client()
        try:
            typ, data = getattr(imap, command)(_quoted(folder))
            assert typ == "OK", data
        finally:
            imap.logout()


class DovecotServer:
    """Our own Dovecot: ``start()``, ``add_user()``, ``stop()`` (or use it as a context)."""

    def __init__(self, users: int = 100) -> None:
        self.users = users
        self._pool = [ImapUser(self, f"user{n}", secrets.token_hex(8)) for n in range(1, users + 1)]
        self.root = Path(tempfile.mkdtemp(prefix="postroom-dovecot-"))
        # Dovecot's unprivileged processes must reach the directory (mkdtemp makes it 0700).
        self.root.chmod(0o755)
        self.imap_port = _free_port()
        self.imaps_port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.certificate_pem = b""

    def __enter__(self) -> DovecotServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def log(self) -> str:
        path = self.root / "dovecot.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, timeout_s: float = 15.0) -> None:
        if not Path(DOVECOT).exists():
            raise RuntimeError(
                "dovecot is not installed; scripts/test.sh installs Debian's dovecot-imapd"
            )
        for sub in ("run", "state", "home"):
            (self.root / sub).mkdir()
        uid, gid, internal_user, login_user = self._users()
        os.chown(self.root / "home", uid, gid)
        cert, key = self.root / "cert.pem", self.root / "key.pem"
        self.certificate_pem, key_pem = self_signed_certificate("localhost")
        cert.write_bytes(self.certificate_pem)
        key.write_bytes(key_pem)
        key.chmod(0o600)
        (self.root / "passwd").write_text(
            "".join(f"{u.name}:{{PLAIN}}{u.password}::::::\n" for u in self._pool)
        )
        conf = self.root / "dovecot.conf"
        conf.write_text(
            _CONFIG.format(
                root=self.root,
                imap_port=self.imap_port,
                imaps_port=self.imaps_port,
                uid=uid,
                gid=gid,
                internal_user=internal_user,
                login_user=login_user,
            )
        )
        self.process = subprocess.Popen(
            [DOVECOT, "-F", "-c", str(conf)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                out = (
                    self.process.stdout.read().decode(errors="replace")
                    if self.process.stdout
                    else ""
                )
                raise RuntimeError(f"dovecot exited ({self.process.returncode}): {out}\n{self.log}")
            if self._greets():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"dovecot did not start within {timeout_s} s:\n{self.log}")
            time.sleep(0.05)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        if process is not None and process.stdout is not None:
            process.stdout.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def add_user(self) -> ImapUser:
        """A mailbox user nobody else has used (from the pool written before the start:
        Dovecot notices a changed passwd file only by its mtime, to the second)."""
        try:
            return self._pool.pop(0)
        except IndexError:
            raise RuntimeError(f"all {self.users} test users are taken; raise users=") from None

    def _greets(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.imap_port), timeout=1) as sock:
                return sock.recv(64).startswith(b"* OK")
        except OSError:
            return False

    @staticmethod
    def _users() -> tuple[int, int, str, str]:
        """(mail uid, mail gid, internal user, login user) for this process's privileges."""
        if os.geteuid() == 0:
            mail = pwd.getpwnam(UNPRIVILEGED_MAIL_USER)
            return mail.pw_uid, mail.pw_gid, "dovecot", "dovenull"
        me = pwd.getpwuid(os.geteuid())
        return me.pw_uid, me.pw_gid, me.pw_name, me.pw_name

    def tls_context(self) -> ssl.SSLContext:
        """A client context that trusts this server's certificate."""
        context = ssl.create_default_context(cadata=self.certificate_pem.decode())
        return context


def _quoted(folder: str) -> str:
    return '"' + folder.replace("\\", "\\\\").replace('"', '\\"') + '"'


_CONFIG = """\
# Written by tests/support/imap_server.py for one test session.
base_dir = {root}/run
state_dir = {root}/state
log_path = {root}/dovecot.log
protocols = imap
listen = 127.0.0.1
default_internal_user = {internal_user}
default_login_user = {login_user}
first_valid_uid = 1
first_valid_gid = 1
ssl = yes
ssl_cert = <{root}/cert.pem
ssl_key = <{root}/key.pem
ssl_min_protocol = TLSv1.2
disable_plaintext_auth = no
auth_mechanisms = plain login
auth_failure_delay = 0
mail_location = maildir:~/Maildir
mail_fsync = never
passdb {{
  driver = passwd-file
  args = scheme=PLAIN username_format=%u {root}/passwd
}}
userdb {{
  driver = static
  args = uid={uid} gid={gid} home={root}/home/%u
}}
service imap-login {{
  chroot =
  inet_listener imap {{
    address = 127.0.0.1
    port = {imap_port}
  }}
  inet_listener imaps {{
    address = 127.0.0.1
    port = {imaps_port}
    ssl = yes
  }}
}}
service anvil {{
  chroot =
}}
"""
