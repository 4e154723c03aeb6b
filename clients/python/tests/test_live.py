"""The client against a live operator (started by `bins/operator/tests/clients.rs`, which sets the environment):
real discovery API, real Squids, a local origin. Each test uses sites of its own, so their cooldowns never meet."""

from __future__ import annotations

import asyncio
import datetime
import os

import httpx
import pytest

import egress_client
from egress_client import AsyncDiscoveryClient, DiscoveryClient

URL = os.environ.get("EGRESS_URL", "")
TOKEN = os.environ.get("EGRESS_TOKEN", "")
ORIGIN = os.environ.get("EGRESS_ORIGIN", "")
PROXIES = int(os.environ.get("EGRESS_PROXIES", "0"))

pytestmark = pytest.mark.skipif(
    not URL, reason="needs a live operator: run through `cargo xtask test` (bins/operator/tests/clients.rs)"
)


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def active(client: DiscoveryClient) -> int:
    return sum(proxy.active_leases for proxy in client.proxies())


def test_a_lease_fetches_through_its_proxy_renews_reports_and_releases() -> None:
    with DiscoveryClient(URL, TOKEN) as client:
        assert len(client.proxies()) == PROXIES
        with client.lease("https://www.py-one.example/page", ttl=60) as lease:
            assert lease.target == "py-one.example"
            answer = httpx.get(ORIGIN, proxy=lease.proxy_url, timeout=10)
            assert answer.status_code == 200
            first_id, first_expiry = lease.id, lease.expires_at
            assert lease.renew(ttl=600) is False, "no replacement"
            assert lease.id != first_id and lease.expires_at > first_expiry
            lease.report_counts(ok=40, failed=2)
            listed = {proxy.namespace + "/" + proxy.name: proxy for proxy in client.proxies(target="py-one.example")}
            assert listed[lease.proxy].reported == 42
            assert listed[lease.proxy].success_rate == pytest.approx(40 / 42)
            assert lease.egress_ip is not None and lease.egress_ip == listed[lease.proxy].egress_ip
            assert active(client) == 1
        assert active(client) == 0, "leaving the block released the lease"


def test_a_throttle_waits_for_the_sites_retry_after_and_a_ban_is_listed() -> None:
    with DiscoveryClient(URL, TOKEN) as client:
        lease = client.lease("py-two.example")
        until = lease.report("throttled", status_code=429, retry_after=20)
        assert until is not None and 18 <= (until - now()).total_seconds() <= 21
        with pytest.raises(egress_client.Conflict) as refused:
            client.lease("py-two.example", proxy=lease.proxy)
        assert refused.value.reason == "proxy-cooling-down"
        assert refused.value.retry_after is not None and 18 <= refused.value.retry_after <= 21
        banned_until = lease.report("banned", status_code=403, release=True)
        assert banned_until is not None and banned_until > until
        cooldowns = client.cooldowns("www.py-two.example")
        assert [(c.proxy, c.target, c.streak) for c in cooldowns] == [(lease.proxy, "py-two.example", 1)]
        lease.release()  # already released by the report: does nothing
        assert active(client) == 0


def test_errors_are_typed() -> None:
    with DiscoveryClient(URL, TOKEN) as client:
        with pytest.raises(egress_client.NotFound):
            client.resume("l1.AAAA.AAAA")
        with pytest.raises(egress_client.NotFound):
            client.lease("py-three.example", proxy="nowhere/none")
        with pytest.raises(egress_client.BadRequest) as bad:
            client.lease("py-three.example", selector="re gion=eu")
        assert "selector" in bad.value.detail
        with client.lease("py-three.example") as lease, pytest.raises(ValueError):
            lease.report("meh")
    with DiscoveryClient(URL, "not-a-token") as stranger:
        with pytest.raises(egress_client.Unauthorized):
            stranger.proxies()
    with DiscoveryClient("http://127.0.0.1:9", TOKEN, timeout=2) as nowhere:
        with pytest.raises(egress_client.TransportError):
            nowhere.proxies()


def test_every_proxy_cooling_down_is_unavailable_with_a_retry_after() -> None:
    with DiscoveryClient(URL, TOKEN) as client:
        for _ in range(PROXIES):
            client.lease("py-four.example").report("throttled", retry_after=30, release=True)
        with pytest.raises(egress_client.Unavailable) as refused:
            client.lease("py-four.example")
        assert refused.value.reason == "all-cooling-down"
        assert refused.value.retry_after is not None and 0 < refused.value.retry_after <= 31


def test_a_lease_is_resumed_by_its_id() -> None:
    with DiscoveryClient(URL, TOKEN) as client:
        lease = client.lease("py-five.example", ttl=60)
        resumed = client.resume(lease.id, ttl=120)
        assert (resumed.proxy, resumed.proxy_url) == (lease.proxy, lease.proxy_url)
        resumed.release()
        assert active(client) == 0


def test_the_async_client_does_the_same_without_blocking() -> None:
    async def crawl() -> None:
        async with AsyncDiscoveryClient(URL, TOKEN) as client:
            async with client.lease("py-six.example", ttl=60) as lease:
                async with httpx.AsyncClient(proxy=lease.proxy_url, timeout=10) as http:
                    assert (await http.get(ORIGIN)).status_code == 200
                assert await lease.renew() is False
                await lease.report_counts(ok=3)
                until = await lease.report("throttled", retry_after=15)
                assert until is not None
            assert sum(proxy.active_leases for proxy in await client.proxies()) == 0
            # Several leases at once, concurrently.
            leases = await asyncio.gather(*(client.lease(f"py-seven-{i}.example") for i in range(PROXIES)))
            assert len({lease.proxy for lease in leases}) == PROXIES, "least-loaded: one each"
            await asyncio.gather(*(lease.release() for lease in leases))
            cooldowns = await client.cooldowns("py-six.example")
            assert len(cooldowns) == 1

    asyncio.run(crawl())
