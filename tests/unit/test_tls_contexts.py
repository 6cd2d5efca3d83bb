"""The TLS contexts of outbound connections: one per process and kind, built once even when a
pool's workers all ask for it at the same moment."""

from __future__ import annotations

import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from portal.messaging.sending import outbound


def test_threads_asking_together_get_one_context_built_once() -> None:
    builds: list[bool] = []
    start = threading.Barrier(12)

    def build(flag: bool) -> ssl.SSLContext:
        builds.append(flag)
        time.sleep(0.05)  # as loading the trusted certificates takes a while
        return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)

    once = outbound._built_once(build)

    def ask(flag: bool) -> ssl.SSLContext:
        start.wait()
        return once(flag)

    with ThreadPoolExecutor(12) as pool:
        contexts = list(pool.map(ask, [True] * 8 + [False] * 4))
    assert sorted(builds) == [False, True]
    assert len({id(c) for c in contexts[:8]}) == 1
    assert len({id(c) for c in contexts[8:]}) == 1
    assert contexts[0] is not contexts[8]


def test_each_kind_is_kept_and_checks_what_it_says() -> None:
    checked, self_signed = outbound.tls_context(True), outbound.tls_context(False)
    assert outbound.tls_context(True) is checked
    assert checked.verify_mode == ssl.CERT_REQUIRED
    assert checked.check_hostname
    assert self_signed.verify_mode == ssl.CERT_NONE
    assert not self_signed.check_hostname
    assert outbound._http_tls_context(True) is outbound._http_tls_context(True)
    with outbound.http_client() as client, outbound.http_client() as other:
        assert client._transport._pool._ssl_context is other._transport._pool._ssl_context  # type: ignore[attr-defined]
