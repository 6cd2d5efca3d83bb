"""Where a tier's configuration may make us connect: one policy for every outbound connection
(status callbacks, SMS providers of every kind, SMTP servers, bounce mailboxes, and the Test
buttons of each).

A target's host is resolved once per connection; every address it gives is checked against the
refused ranges (private, loopback, link-local, multicast, reserved and IANA's special-purpose
blocks, with the IPv4 address inside a mapped, NAT64, 6to4 or Teredo address checked as well);
the connection then goes to the address that was checked, never through a second lookup (TLS
still checks the host name, and HTTP keeps it as Host). The platform tier may reach private
addresses when ``OUTBOUND_PLATFORM_ALLOW_PRIVATE`` says so (the default: operators run their
own servers on private networks); tenants only when ``OUTBOUND_TENANT_ALLOW_PRIVATE`` does.

What a refused or failing target said never reaches a tenant: a refusal is a fixed sentence
that names neither the address nor any reply.

Test buttons hold a web thread while a server answers, so they are capped
(``test_slot``): per tier and in total across the portal's processes (counters in Redis with
an expiry, so a crashed process frees its slots), and per process (a semaphore), each Test
with a short timeout.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import redis

from portal.config import Settings
from portal.tenancy import PLATFORM_TENANT_ID

log = logging.getLogger("portal.outbound")

MAX_URL_CHARS = 2000
REFUSED_ADDRESS = "it points at a private or reserved address, which this service may not reach"


class Refused(Exception):
    """The target may not be reached (scheme, host, or an address in a refused range)."""


class Unresolved(Refused):
    """The host has no address now (DNS may be late or down): a network failure, not a
    refusal of the configuration."""


Resolver = Callable[[str, int], Sequence[str]]


def system_resolver(host: str, port: int) -> list[str]:
    """Every address the system resolver gives for ``host`` (one lookup)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def allows_private(settings: Settings, tenant_id: int | None) -> bool:
    """Whether a config of ``tenant_id``'s tier may reach private and reserved addresses."""
    if tenant_id == PLATFORM_TENANT_ID:
        return settings.outbound_platform_allow_private
    return settings.outbound_tenant_allow_private


# --- the refused ranges -------------------------------------------------------------------------

# Besides what ipaddress flags (not global, private, loopback, link-local, multicast, reserved,
# unspecified): IANA's special-purpose blocks that some Python versions call global.
_REFUSED = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",  # "this network"
        "100.64.0.0/10",  # shared address space (carrier-grade NAT)
        "192.0.0.0/24",  # IETF protocol assignments
        "192.0.2.0/24",  # documentation
        "192.88.99.0/24",  # deprecated 6to4 relay anycast
        "198.18.0.0/15",  # benchmarking
        "198.51.100.0/24",  # documentation
        "203.0.113.0/24",  # documentation
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, broadcast
        "::/96",  # IPv4-compatible (deprecated), unspecified and loopback among them
        "64:ff9b::/96",  # NAT64 well-known prefix: reaches any IPv4 address through a gateway
        "64:ff9b:1::/48",  # local-use NAT64
        "100::/64",  # discard-only
        "2001::/23",  # IETF protocol assignments (Teredo's 2001::/32 among them)
        "2001:db8::/32",  # documentation
        "3fff::/20",  # documentation
        "5f00::/16",  # segment routing SIDs
        "fc00::/7",  # unique local
        "fe80::/10",  # link-local
        "fec0::/10",  # site-local (deprecated)
        "ff00::/8",  # multicast
    )
)

# IPv6 blocks whose last 32 bits are an IPv4 address: IPv4-compatible, NAT64 (both).
_CARRIES_IPV4 = tuple(ipaddress.IPv6Network(n) for n in ("::/96", "64:ff9b::/96", "64:ff9b:1::/48"))


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries (mapped, NAT64, 6to4, Teredo)."""
    inner: list[ipaddress.IPv4Address] = []
    if ip.ipv4_mapped is not None:
        inner.append(ip.ipv4_mapped)
    if ip.sixtofour is not None:
        inner.append(ip.sixtofour)
    if ip.teredo is not None:
        inner.extend(ip.teredo)
    if any(ip in net for net in _CARRIES_IPV4):
        inner.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return inner


def _flagged(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return (
        not ip.is_global
        or ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or any(ip.version == net.version and ip in net for net in _REFUSED)
    )


def forbidden(address: str) -> bool:
    """Whether ``address`` is in a range a tier's configuration may not reach (an IPv6 address
    that carries a refused IPv4 address included); an unreadable address is refused too."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return True
    if isinstance(ip, ipaddress.IPv6Address):
        mapped = ip.ipv4_mapped
        if mapped is not None:
            return _flagged(mapped)
        if any(_flagged(inner) for inner in _embedded_ipv4(ip)):
            return True
    return _flagged(ip)


# --- hosts --------------------------------------------------------------------------------------


def resolve_host(
    host: str, port: int, *, allow_private: bool, resolver: Resolver = system_resolver
) -> str:
    """The checked address to connect to for ``host``: every address it resolves to must be
    allowed. Raises Refused (an unresolvable name too)."""
    bare = host.strip().strip("[]")
    if not bare:
        raise Refused("no host is set")
    try:
        ipaddress.ip_address(bare.split("%", 1)[0])
        addresses: Sequence[str] = [bare]
    except ValueError:
        try:
            addresses = resolver(bare, port)
        except (OSError, UnicodeError):
            raise Unresolved(f"{bare} cannot be resolved") from None
        if not addresses:
            raise Unresolved(f"{bare} has no address") from None
    if not allow_private and any(forbidden(a) for a in addresses):
        raise Refused(f"{bare}: {REFUSED_ADDRESS}")
    return addresses[0]


def host_problem(
    host: str, port: int, *, allow_private: bool, resolver: Resolver = system_resolver
) -> str | None:
    """Why ``host`` cannot be saved, or None. A name that does not resolve now is accepted (DNS
    may be late); every connection checks it again."""
    try:
        resolve_host(host, port, allow_private=allow_private, resolver=resolver)
    except Refused as exc:
        return None if isinstance(exc, Unresolved) else str(exc)
    return None


def connect(
    host: str,
    port: int,
    timeout_s: float | None,
    *,
    allow_private: bool,
    resolver: Resolver = system_resolver,
) -> socket.socket:
    """A TCP connection to the checked address of ``host``. Raises Refused, or OSError (a name
    that does not resolve too, as a network failure)."""
    try:
        address = resolve_host(host, port, allow_private=allow_private, resolver=resolver)
    except Unresolved as exc:
        raise socket.gaierror(f"{exc}: name or service not known") from None
    return socket.create_connection((address, port), timeout_s)


# --- URLs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where one request connects: the checked address, with the URL's host for Host/SNI."""

    scheme: str
    host: str
    port: int
    address: str
    path: str

    @property
    def connect_url(self) -> str:
        literal = f"[{self.address}]" if ":" in self.address else self.address
        return f"{self.scheme}://{literal}:{self.port}{self.path}"

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        name = f"[{self.host}]" if ":" in self.host else self.host
        return name if self.port == default else f"{name}:{self.port}"


def url_problem(url: str) -> str | None:
    """What is wrong with ``url`` as a target URL, before any lookup ("must be ...")."""
    if not url or len(url) > MAX_URL_CHARS:
        return f"must be an http(s) URL of at most {MAX_URL_CHARS} characters"
    if any(ch.isspace() for ch in url):
        return "must not contain spaces"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        return "is not a valid URL"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must start with http:// or https:// and name a host"
    if parts.username or parts.password:
        return "must not carry a user name or password"
    if parts.fragment:
        return "must not have a #fragment"
    return None


def resolve(url: str, *, allow_private: bool, resolver: Resolver = system_resolver) -> Target:
    """Check ``url`` and its addresses; the Target to connect to. Raises Refused."""
    problem = url_problem(url)
    if problem:
        raise Refused(f"the URL {problem}")
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = resolve_host(host, port, allow_private=allow_private, resolver=resolver)
    path = parts.path or "/"
    if parts.query:
        path += f"?{parts.query}"
    return Target(parts.scheme, host, port, address, path)


def url_problem_at_save(
    url: str, *, allow_private: bool, resolver: Resolver = system_resolver
) -> str | None:
    """Why ``url`` cannot be saved, or None (a name that does not resolve now is accepted)."""
    problem = url_problem(url)
    if problem:
        return f"URL {problem}"
    try:
        resolve(url, allow_private=allow_private, resolver=resolver)
    except Refused as exc:
        return None if isinstance(exc, Unresolved) else str(exc)
    return None


def pinned_request(
    client: httpx.Client,
    method: str,
    url: str,
    *,
    allow_private: bool,
    resolver: Resolver = system_resolver,
    headers: dict[str, str] | None = None,
    **kwargs: Any,
) -> httpx.Request:
    """A request to the checked address of ``url``'s host, with its name kept as Host and as
    the TLS server name (which the certificate is checked against). Raises Refused."""
    target = resolve(url, allow_private=allow_private, resolver=resolver)
    extensions: dict[str, Any] = {}
    if target.scheme == "https":
        extensions["sni_hostname"] = target.host
    return client.build_request(
        method,
        target.connect_url,
        headers={**(headers or {}), "host": target.host_header},
        extensions=extensions,
        **kwargs,
    )


# --- Test buttons -------------------------------------------------------------------------------


class Busy(Exception):
    """Too many Test connections are running; try again after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


_local_lock = threading.Lock()
_local_running: dict[str, int] = {}


def _take_local(key: str, limit: int) -> bool:
    with _local_lock:
        if _local_running.get(key, 0) >= limit:
            return False
        _local_running[key] = _local_running.get(key, 0) + 1
        return True


def _give_local(key: str) -> None:
    with _local_lock:
        _local_running[key] = max(_local_running.get(key, 1) - 1, 0)


def _counter_keys(tenant_id: int) -> tuple[str, str]:
    return f"postroom:outbound-tests:tier:{tenant_id}", "postroom:outbound-tests:all"


def _take_shared(client: redis.Redis, settings: Settings, tenant_id: int) -> str | None:
    """Count one Test in Redis; why it may not run (None: it may)."""
    tier_key, all_key = _counter_keys(tenant_id)
    ttl = max(int(settings.outbound_test_timeout_s * 4) + 5, 10)
    pipe = client.pipeline()
    pipe.incr(tier_key)
    pipe.expire(tier_key, ttl)
    pipe.incr(all_key)
    pipe.expire(all_key, ttl)
    tier_count, _, all_count, _ = pipe.execute()
    if int(tier_count) > settings.outbound_test_per_tier:
        _give_shared(client, tenant_id)
        return "tier"
    if int(all_count) > settings.outbound_test_total:
        _give_shared(client, tenant_id)
        return "all"
    return None


def _give_shared(client: redis.Redis, tenant_id: int) -> None:
    tier_key, all_key = _counter_keys(tenant_id)
    pipe = client.pipeline()
    pipe.decr(tier_key)
    pipe.decr(all_key)
    pipe.execute()


@contextmanager
def test_slot(settings: Settings, tenant_id: int) -> Iterator[None]:
    """Run one Test connection for ``tenant_id``'s tier, or raise Busy when its tier, this
    process or the whole portal already runs as many as allowed."""
    from portal import redis_store

    retry = max(int(settings.outbound_test_timeout_s) + 1, 1)
    if not _take_local("process", settings.outbound_test_per_process):
        raise Busy("Too many connection tests are running. Try again in a few seconds.", retry)
    shared: redis.Redis | None = None
    try:
        try:
            shared = redis_store.connect(settings.redis_url)
            over = _take_shared(shared, settings, tenant_id)
        except redis.RedisError as exc:  # Redis away: the per-process cap still holds
            log.warning("connection-test counters unavailable (%s)", exc)
            shared, over = None, None
        if over == "tier":
            raise Busy(
                "Connection tests of this account are already running. "
                "Wait for them, then try again.",
                retry,
            )
        if over is not None:
            raise Busy("Too many connection tests are running. Try again in a few seconds.", retry)
        try:
            yield
        finally:
            if shared is not None:
                try:
                    _give_shared(shared, tenant_id)
                except redis.RedisError as exc:  # the keys expire on their own
                    log.warning("connection-test counters not released (%s)", exc)
    finally:
        _give_local("process")


# pytest would otherwise try to collect the function above when a test imports it by name.
test_slot.__test__ = False  # type: ignore[attr-defined]


def _built_once(build: Callable[[bool], ssl.SSLContext]) -> Callable[[bool], ssl.SSLContext]:
    """``functools.cache`` for a TLS context that builds each one once even when threads ask
    for it together: a pool's workers start at the same moment, and with a plain cache each
    of them built its own (a worker process's ten SMS workers and its callback thread spent
    half a second of CPU at start on eleven copies of one context)."""
    built: dict[bool, ssl.SSLContext] = {}
    lock = threading.Lock()

    @functools.wraps(build)
    def once(flag: bool) -> ssl.SSLContext:
        context = built.get(flag)
        if context is None:
            with lock:
                context = built.get(flag)
                if context is None:
                    context = built[flag] = build(flag)
        return context

    return once


@_built_once
def tls_context(verify: bool) -> ssl.SSLContext:
    """The TLS context of a connection a configuration causes over SMTP or IMAP: certificates
    and host names checked, unless the operator marked the server as self-signed (``verify``
    false). One per process and kind: loading the trusted certificates costs 10-20 ms of CPU,
    which every new SMTP session would otherwise pay."""
    context = ssl.create_default_context()
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


@_built_once
def _http_tls_context(trust_env: bool) -> ssl.SSLContext:
    # What httpx builds for each new client (certifi's roots, or SSL_CERT_FILE / SSL_CERT_DIR
    # where the client trusts the environment), built once per process instead.
    return httpx.create_ssl_context(trust_env=trust_env)


def http_client(*, trust_env: bool = True, **options: Any) -> httpx.Client:
    """An HTTP client for a connection a configuration causes (SMS providers, status callbacks,
    their Test buttons). It trusts what httpx would, on one TLS context per process: httpx
    loads the trusted certificates again for every new client (10-20 ms of CPU per SMS worker,
    callback thread and Test click)."""
    return httpx.Client(verify=_http_tls_context(trust_env), trust_env=trust_env, **options)
