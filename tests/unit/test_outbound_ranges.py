"""The outbound policy's refused ranges as a table: every special-purpose block a tenant's
configuration reached in the security review, the ones refused before, and public addresses
that stay allowed (IPv4 inside IPv6 forms checked as IPv4)."""

from __future__ import annotations

import pytest

from portal.config import Settings
from portal.messaging.sending import outbound
from portal.tenancy import PLATFORM_TENANT_ID

REFUSED = [
    # refused before
    "127.0.0.1",
    "10.1.2.3",
    "172.16.0.1",
    "192.168.1.1",
    "169.254.169.254",
    "100.64.0.1",
    "0.0.0.0",
    "224.0.0.1",
    "233.1.1.1",
    "240.0.0.1",
    "255.255.255.255",
    "::",
    "::1",
    "fc00::1",
    "fe80::1",
    "fe80::1%eth0",
    "ff02::1",
    "::ffff:127.0.0.1",
    "::ffff:10.0.0.1",
    # the special-purpose blocks the review reached
    "198.18.0.1",
    "198.19.255.254",
    "192.0.0.8",
    "192.0.2.1",
    "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
    "64:ff9b::808:808",  # NAT64 of a public address: still a gateway hop, refused
    "64:ff9b:1::a00:1",  # local-use NAT64
    "::7f00:1",  # IPv4-compatible 127.0.0.1
    "::808:808",  # IPv4-compatible, public inside: the block is deprecated, refused
    "2002:7f00:1::1",  # 6to4 of 127.0.0.1
    "2002:a00:1::1",  # 6to4 of 10.0.0.1
    "2002:c0a8:101::1",  # 6to4 of 192.168.1.1
    "2001:0:4136:e378:8000:63bf:80ff:fffe",  # Teredo, client 127.0.0.1
    "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo (the block is not global)
    "2001:db8::1",
    "fec0::1",
    "100::1",
    "not an address",
]

ALLOWED = [
    "93.184.216.34",
    "8.8.8.8",
    "1.1.1.1",
    "2606:2800:220:1:248:1893:25c8:1946",
    "2a00:1450:4009:81f::200e",
    "::ffff:93.184.216.34",
    "2002:5db8:d822::1",  # 6to4 of a public address
]


@pytest.mark.parametrize("address", REFUSED)
def test_a_special_purpose_address_is_refused(address: str) -> None:
    assert outbound.forbidden(address), address
    resolver = lambda host, port: [address]  # noqa: E731
    with pytest.raises(outbound.Refused):
        outbound.resolve_host("target.example", 80, allow_private=False, resolver=resolver)


@pytest.mark.parametrize("address", ALLOWED)
def test_a_public_address_is_allowed(address: str) -> None:
    assert not outbound.forbidden(address), address
    resolver = lambda host, port: [address]  # noqa: E731
    assert outbound.resolve_host("t.example", 80, allow_private=False, resolver=resolver) == address


def test_one_refused_address_among_several_refuses_the_host() -> None:
    resolver = lambda host, port: ["93.184.216.34", "127.0.0.1"]  # noqa: E731
    with pytest.raises(outbound.Refused) as refused:
        outbound.resolve_host("mixed.example", 80, allow_private=False, resolver=resolver)
    assert "127.0.0.1" not in str(refused.value)  # the address is never told


def test_an_unresolvable_name_is_accepted_at_save_and_a_network_failure_at_connect() -> None:
    def nothing(host: str, port: int) -> list[str]:
        raise OSError("no such host")

    assert outbound.host_problem("late.example", 25, allow_private=False, resolver=nothing) is None
    with pytest.raises(OSError, match="cannot be resolved"):
        outbound.connect("late.example", 25, 1.0, allow_private=False, resolver=nothing)


def test_the_platform_tier_may_reach_private_addresses_by_default_tenants_may_not() -> None:
    settings = Settings.from_env({})
    assert outbound.allows_private(settings, PLATFORM_TENANT_ID)
    assert not outbound.allows_private(settings, 7)
    strict = Settings.from_env({"OUTBOUND_PLATFORM_ALLOW_PRIVATE": "false"})
    assert not outbound.allows_private(strict, PLATFORM_TENANT_ID)
    assert outbound.allows_private(Settings.from_env({"OUTBOUND_TENANT_ALLOW_PRIVATE": "1"}), 7)
    # The callbacks' older setting still allows tenants' private targets (the demo sets it).
    assert outbound.allows_private(Settings.from_env({"CALLBACK_ALLOW_PRIVATE": "true"}), 7)
