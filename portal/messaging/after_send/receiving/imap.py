"""A read-only IMAP client for bounce mailboxes: IMAPS, STARTTLS or plain, via imaplib.

The folder is opened with EXAMINE and bodies are read with BODY.PEEK, so reading never changes
the mailbox (no \\Seen flag, no expunge): the mailbox stays the operator's, and our progress is
the UID watermark we keep ourselves.
"""

from __future__ import annotations

import contextlib
import imaplib
import re
import socket
import ssl
from dataclasses import dataclass
from types import TracebackType

from portal.messaging.sending import outbound
from portal.models import SmtpSecurity

SEARCH_WINDOW = 5000  # UIDs per UID SEARCH, so no answer line grows past imaplib's limit


class ImapError(Exception):
    """The server refused, dropped the connection, or answered something unreadable."""


@dataclass(frozen=True)
class MailboxAddress:
    """Where a mailbox is and how to log in (the decrypted secret included: never log it)."""

    host: str
    port: int
    security: SmtpSecurity
    username: str
    password: str
    folder: str = "INBOX"
    verify_tls: bool = True
    timeout_s: float = 30.0
    # Whether the host may resolve to private and reserved addresses: the caller decides by the
    # config's tier (portal.messaging.sending.outbound.allows_private); every connection checks it.
    allow_private: bool = True

    def __repr__(self) -> str:  # keep the password out of logs and tracebacks
        return (
            f"MailboxAddress({self.security.value}://{self.username}@{self.host}:{self.port}"
            f"/{self.folder})"
        )


@dataclass(frozen=True)
class FolderState:
    uidvalidity: int
    uidnext: int | None  # None when the server does not say
    exists: int | None = None  # messages in the folder when it was opened


@dataclass(frozen=True)
class Fetched:
    uid: int
    size: int  # RFC822.SIZE: the whole message, whatever part of it was read
    data: bytes  # the first ``max_bytes`` bytes of the message

    @property
    def truncated(self) -> bool:
        return len(self.data) < self.size


class _Checked(imaplib.IMAP4):
    """IMAP connecting to the address the outbound policy checked (no second lookup); the
    host name stays the TLS server name (STARTTLS)."""

    def __init__(self, host: str, port: int, *, allow_private: bool, timeout: float) -> None:
        self.allow_private = allow_private
        super().__init__(host, port, timeout=timeout)

    def _create_socket(self, timeout: float | None) -> socket.socket:
        return outbound.connect(self.host, self.port, timeout, allow_private=self.allow_private)


class _CheckedSSL(imaplib.IMAP4_SSL):
    """IMAPS to the checked address, the host name as the TLS server name."""

    def __init__(
        self, host: str, port: int, *, allow_private: bool, context: ssl.SSLContext, timeout: float
    ) -> None:
        self.allow_private = allow_private
        super().__init__(host, port, ssl_context=context, timeout=timeout)

    def _create_socket(self, timeout: float | None) -> socket.socket:
        sock = outbound.connect(self.host, self.port, timeout, allow_private=self.allow_private)
        wrapped: socket.socket = self.ssl_context.wrap_socket(sock, server_hostname=self.host)
        return wrapped


class ReadOnlyMailbox:
    """One logged-in connection with one folder open read-only. Use as a context manager."""

    def __init__(self, address: MailboxAddress):
        self.address = address
        self._imap: imaplib.IMAP4 | None = None
        self.folder: FolderState | None = None

    def __enter__(self) -> ReadOnlyMailbox:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def open(self) -> FolderState:
        """Connect, log in and EXAMINE the folder; returns its UIDVALIDITY and UIDNEXT."""
        a = self.address
        try:
            if a.security is SmtpSecurity.SSL:
                imap: imaplib.IMAP4 = _CheckedSSL(
                    a.host,
                    a.port,
                    allow_private=a.allow_private,
                    context=outbound.tls_context(a.verify_tls),
                    timeout=a.timeout_s,
                )
            else:
                imap = _Checked(a.host, a.port, allow_private=a.allow_private, timeout=a.timeout_s)
                if a.security is SmtpSecurity.STARTTLS:
                    imap.starttls(outbound.tls_context(a.verify_tls))
            self._imap = imap
            imap.login(a.username, a.password)
            typ, data = imap.select(_quoted(a.folder), readonly=True)  # EXAMINE
            if typ != "OK":
                raise ImapError(f"cannot open folder {a.folder!r}: {_said(data)}")
            validity = _response_int(imap, "UIDVALIDITY")
            if validity is None:
                raise ImapError(f"the server gave no UIDVALIDITY for {a.folder!r}")
            exists = data[0] if data else None
            count = int(exists) if isinstance(exists, bytes) and exists.isdigit() else None
            self.folder = FolderState(validity, _response_int(imap, "UIDNEXT"), count)
            return self.folder
        except outbound.Refused as exc:
            self.close()
            raise ImapError(f"Refused: the server is refused: {exc}") from exc
        except (imaplib.IMAP4.error, OSError, ssl.SSLError) as exc:
            self.close()
            raise ImapError(f"{type(exc).__name__}: {exc}") from exc
        except ImapError:
            self.close()
            raise

    @property
    def connected(self) -> bool:
        return self._imap is not None

    def reopen(self) -> FolderState:
        """Open again after a dropped connection; the folder must be the one we were reading."""
        before = self.folder
        after = self.open()
        if before is not None and after.uidvalidity != before.uidvalidity:
            self.close()
            raise ImapError("UIDVALIDITY changed during the run; the next run starts again")
        return after

    def close(self) -> None:
        imap, self._imap = self._imap, None
        if imap is None:
            return
        try:
            imap.logout()  # no CLOSE: it would expunge, and EXAMINE has nothing to expunge
        except (imaplib.IMAP4.error, OSError):
            with contextlib.suppress(OSError):
                imap.shutdown()

    def uids_after(self, last_uid: int, limit: int) -> list[int]:
        """Up to ``limit`` UIDs greater than ``last_uid``, ascending."""
        imap = self._connected()
        uidnext = self.folder.uidnext if self.folder else None
        found: list[int] = []
        low = last_uid + 1
        while len(found) < limit:
            high: int | None = None
            if uidnext is not None:
                if low >= uidnext:
                    break
                high = min(uidnext - 1, low + SEARCH_WINDOW - 1)
            span = f"{low}:{high if high is not None else '*'}"
            try:
                typ, data = imap.uid("SEARCH", "UID", span)
            except (imaplib.IMAP4.error, OSError) as exc:
                raise ImapError(f"UID SEARCH failed: {exc}") from exc
            if typ != "OK":
                raise ImapError(f"UID SEARCH failed: {_said(data)}")
            # "n:*" also matches the highest UID when it is below n: keep only those above.
            uids = sorted(
                {
                    int(u)
                    for chunk in data
                    if isinstance(chunk, bytes)
                    for u in chunk.split()
                    if u.isdigit() and int(u) > last_uid
                }
            )
            found.extend(uids)  # windows ascend and do not overlap
            if high is None:
                break
            low = high + 1
        return found[:limit]

    def fetch(self, uid: int, max_bytes: int) -> Fetched | None:
        """The first ``max_bytes`` of one message (None: it is gone, expunged meanwhile)."""
        imap = self._connected()
        try:
            typ, data = imap.uid("FETCH", str(uid), f"(RFC822.SIZE BODY.PEEK[]<0.{max_bytes}>)")
        except (imaplib.IMAP4.error, OSError) as exc:
            raise ImapError(f"UID FETCH {uid} failed: {exc}") from exc
        if typ != "OK":
            raise ImapError(f"UID FETCH {uid} failed: {_said(data)}")
        for item in data:
            if not isinstance(item, tuple) or len(item) != 2:
                continue
            meta, body = item
            uid_m = re.search(rb"\bUID (\d+)", meta)
            if uid_m is None or int(uid_m.group(1)) != uid:
                continue  # an unsolicited FETCH about another message
            size_m = re.search(rb"RFC822\.SIZE (\d+)", meta)
            size = int(size_m.group(1)) if size_m else len(body)
            return Fetched(uid=uid, size=max(size, len(body)), data=bytes(body))
        return None

    def _connected(self) -> imaplib.IMAP4:
        if self._imap is None:
            raise ImapError("not connected")
        return self._imap


def _quoted(folder: str) -> str:
    """A mailbox name as an IMAP quoted string (imaplib sends it as given)."""
    return '"' + folder.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _response_int(imap: imaplib.IMAP4, code: str) -> int | None:
    _typ, data = imap.response(code)
    for value in data or []:
        if isinstance(value, bytes) and value.strip().isdigit():
            return int(value)
    return None


def _said(data: object) -> str:
    if isinstance(data, list):
        return " ".join(
            d.decode("utf-8", "replace") if isinstance(d, bytes) else str(d) for d in data
        )
    return str(data)


__all__ = ["Fetched", "FolderState", "ImapError", "MailboxAddress", "ReadOnlyMailbox"]
