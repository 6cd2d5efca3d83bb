"""A local SMTP sink for the demo: accepts every mail and keeps it as a .eml file, except for
the simulator's addresses (portal/simulator.py), which fail on purpose as its table says.

The run command starts it so that mail sent in the demo really travels over SMTP; open the
files under instance/mail-sink/ (or watch this process's output) to see what went out.
"""

from __future__ import annotations

import argparse
import asyncio
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

from portal import simulator
from portal.simulator import Behaviour


class SinkHandler:
    def __init__(self, directory: Path):
        self.directory = directory
        self.count = 0
        self.lock = threading.Lock()
        # Messages the temporary-once address has refused once (by Message-ID and recipient).
        self.failed_once = simulator.FirstTimes()

    async def handle_RCPT(
        self,
        server: SMTP,
        session: Session,
        envelope: Envelope,
        address: str,
        rcpt_options: list[str],
    ) -> str:
        behaviour = simulator.mail_behaviour(address)
        if behaviour is Behaviour.REFUSED:
            return self._say(address, simulator.REFUSED_REPLY)
        if behaviour is Behaviour.TEMPORARY_ALWAYS:
            return self._say(address, simulator.TEMPORARY_REPLY)
        envelope.rcpt_tos.append(address)
        envelope.rcpt_options.extend(rcpt_options)
        return "250 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        raw = envelope.original_content or b""
        message = message_from_bytes(raw)
        message_id = (message.get("Message-ID") or "").strip("<>")
        behaviours = {
            rcpt: b for rcpt in envelope.rcpt_tos if (b := simulator.mail_behaviour(rcpt))
        }
        for rcpt, behaviour in behaviours.items():
            if behaviour is not Behaviour.TEMPORARY_ONCE:
                continue
            key = (message_id, rcpt.lower())
            if self.failed_once.first(key):
                return self._say(rcpt, simulator.TEMPORARY_REPLY)
            if not message_id:
                # Without a Message-ID every attempt looks alike: fail every other one.
                self.failed_once.forget(key)
        name = self._keep(raw, message_id)
        print(
            f"smtp-sink: {envelope.mail_from} -> {', '.join(envelope.rcpt_tos)}: "
            f"{message.get('Subject', '')!r} ({name})",
            flush=True,
        )
        if Behaviour.NO_ANSWER in behaviours.values():
            print("smtp-sink: simulator: dropping the connection without an answer", flush=True)
            if isinstance(server.transport, asyncio.Transport):
                server.transport.abort()
            # connection_lost() cancels this handler: never answer.
            await asyncio.get_running_loop().create_future()
        if Behaviour.SLOW in behaviours.values():
            await asyncio.sleep(simulator.SLOW_S)
        return "250 2.0.0 OK: kept by the demo sink"

    def _keep(self, raw: bytes, message_id: str) -> str:
        safe = re.sub(r"[^A-Za-z0-9_.@-]", "_", message_id)[:80] or "no-id"
        with self.lock:
            self.count += 1
            name = f"{time.strftime('%Y%m%d-%H%M%S')}-{self.count:06d}-{safe}.eml"
        (self.directory / name).write_bytes(raw)
        return name

    @staticmethod
    def _say(address: str, reply: str) -> str:
        print(f"smtp-sink: simulator: {address}: {reply}", flush=True)
        return reply


def start(host: str, port: int, directory: Path) -> Controller:
    """Serve the sink on ``host:port`` from a background thread, keeping mail in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    # server_hostname skips aiosmtpd's getfqdn(), slow on some hosts.
    controller = Controller(
        SinkHandler(directory),
        hostname=host,
        port=port,
        server_hostname="smtp-sink.local",
    )
    controller.start()
    return controller


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=2525)
    parser.add_argument("--dir", type=Path, default=Path("instance/mail-sink"))
    args = parser.parse_args(argv)
    controller = start(args.host, args.port, args.dir)
    print(
        f"smtp-sink: listening on {args.host}:{args.port}, keeping mail in {args.dir}", flush=True
    )
    print(
        f"smtp-sink: addresses @{simulator.MAIL_DOMAIN} fail on purpose: "
        + ", ".join(entry.address.partition("@")[0] for entry in simulator.MAIL.values()),
        flush=True,
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
