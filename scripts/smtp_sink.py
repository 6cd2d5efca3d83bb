"""A local SMTP sink for the demo: accepts every mail and keeps it as a .eml file.

The run command starts it so that mail sent in the demo really travels over SMTP; open the
files under instance/mail-sink/ (or watch this process's output) to see what went out.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import threading
import time
from email import message_from_bytes
from pathlib import Path
from typing import Any

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, Envelope, Session


class SinkHandler:
    def __init__(self, directory: Path):
        self.directory = directory
        self.count = 0
        self.lock = threading.Lock()

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        raw = envelope.original_content or b""
        message = message_from_bytes(raw)
        message_id = (message.get("Message-ID") or "").strip("<>")
        safe = re.sub(r"[^A-Za-z0-9_.@-]", "_", message_id)[:80] or "no-id"
        with self.lock:
            self.count += 1
            name = f"{time.strftime('%Y%m%d-%H%M%S')}-{self.count:06d}-{safe}.eml"
        (self.directory / name).write_bytes(raw)
        print(
            f"smtp-sink: {envelope.mail_from} -> {', '.join(envelope.rcpt_tos)}: "
            f"{message.get('Subject', '')!r} ({name})",
            flush=True,
        )
        return "250 2.0.0 OK: kept by the demo sink"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=2525)
    parser.add_argument("--dir", type=Path, default=Path("instance/mail-sink"))
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    controller = Controller(SinkHandler(args.dir), hostname=args.host, port=args.port)
    controller.start()
    print(
        f"smtp-sink: listening on {args.host}:{args.port}, keeping mail in {args.dir}", flush=True
    )
    stop = threading.Event()

    def _stop(*_: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    stop.wait()
    controller.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
