"""Real Scrapy crawls of the 200-page test site through the gateway: over plain HTTP with nothing egress-specific but
the proxy URL (no add-on, Scrapy's default settings, `meta["proxy"] = "http://session-<n>:<token>@<gateway>"`), and
over HTTPS (CONNECT tunnels) with the gateway middleware, which reports the refusals it sees inside the tunnels. The site bans one
proxy's address outright (403) and rate-limits every other address (429 with Retry-After: 2 on every twentieth request
from it). The gateway reports those, retries elsewhere and waits out short cooldowns, so the crawl must fetch every
page with a 200, never through a proxy while it was cooling down for the site, and each session must keep its proxy
unless a refusal moved it."""

from __future__ import annotations

import os
import time

import pytest
from livecrawl import crawl
from test_scrapy import PAGES, RETRY_AFTER, Site

from egress_client import DiscoveryClient

URL = os.environ.get("EGRESS_URL", "")
TOKEN = os.environ.get("EGRESS_TOKEN", "")
GATEWAY = os.environ.get("EGRESS_GATEWAY", "")
SESSIONS = 4

pytestmark = pytest.mark.skipif(not (URL and GATEWAY), reason="needs a live operator and gateway: run through `cargo xtask test`")


def cooling_violations(log: list, banned: str) -> list:
    """Requests that reached the site through a proxy cooling down for it: after the banned address's first 403 (plus
    a second for requests already in flight), and inside a throttle's Retry-After (after a second in flight)."""
    first_ban = min((t for t, ip, _, s in log if ip == banned and s == 403), default=None)
    late = [entry for entry in log if first_ban is not None and entry[1] == banned and entry[0] > first_ban + 1.0]
    inside = []
    for address in set(ip for _, ip, _, _ in log) - {banned}:
        throttles = [t for t, ip, _, s in log if ip == address and s == 429]
        inside += [
            entry for entry in log if entry[1] == address and any(t + 1.0 < entry[0] < t + RETRY_AFTER - 0.2 for t in throttles)
        ]
    return late + inside


def fleet_addresses() -> list:
    """The egress addresses of the fleet's proxies, sorted: the site bans the first."""
    with DiscoveryClient(URL, TOKEN) as client:
        addresses = sorted(proxy.egress_ip for proxy in client.proxies())
    assert len(set(addresses)) >= 3 and None not in addresses, addresses
    return addresses


def leases_come_back() -> None:
    """Idle sessions let their leases go (the test gateway's stickiness is 3 s): the fleet is as the next test
    expects."""
    deadline = time.monotonic() + 30
    with DiscoveryClient(URL, TOKEN) as client:
        while any(proxy.active_leases for proxy in client.proxies()):
            assert time.monotonic() < deadline, "the gateway released its sessions' leases once they idled"
            time.sleep(0.25)


def crawl_through_gateway(label: str, env: dict, tls: bool = False) -> tuple:
    """Crawls the site (over TLS with `tls`) through the gateway with `env` for crawl.py, checks what every gateway
    crawl must show, prints the figures, and returns the pages, Scrapy's stats and the site's refusals."""
    site = Site(banned=fleet_addresses()[0], tls=tls)
    result = crawl(site.url, {"CONCURRENT_REQUESTS": 8}, sessions=SESSIONS, env=env)
    site.server.shutdown()
    pages = [page for page in result["pages"] if page["status"] == 200]
    stats = result["stats"]
    log = site.log
    refusals = sum(1 for _, _, _, status in log if status in (403, 429))
    # Every page (and the index) was fetched, each with a 200.
    assert len({page["url"] for page in pages}) == PAGES + 1, f"{len(pages)} pages; stats {stats}"
    violations = cooling_violations(log, site.banned)
    # A session moves only when a refusal moves it: each (session, proxy) pair beyond one per session is a move.
    pairs = {(page["session"], page["proxy"]) for page in pages if page["session"] != "index"}
    moves = len(pairs) - SESSIONS
    print(
        f"{label}: {len(pages)} pages, {len(log)} requests at the site, {refusals} refusals, {SESSIONS} sessions on "
        f"{len(pairs)} (session, proxy) pairs, through a cooling proxy {len(violations)}"
    )
    assert not violations, f"{len(violations)} requests through a proxy cooling down for the site: {violations[:5]}"
    assert refusals >= 2, "the site refused some requests (a ban and throttles)"
    assert all(page["proxy"] for page in pages), "every answer names its proxy (X-Egress-Proxy) or address"
    assert 0 <= moves <= refusals, f"{moves} session moves for {refusals} refusals: sessions do not stick"
    leases_come_back()
    return pages, stats, refusals


def test_a_plain_scrapy_crawl_through_the_gateway_fetches_every_page_and_sessions_stick() -> None:
    proxy = f"http://session-{{session}}:{TOKEN}@{GATEWAY}"
    _, stats, _ = crawl_through_gateway("scrapy through the gateway", {"CRAWL_PROXY": proxy})
    # Scrapy saw no refusal it had to retry: the gateway retried them.
    print(f"scrapy through the gateway: Scrapy retries {stats.get('retry/count', 0)}")


def test_scrapy_with_http_proxy_and_requests_rotate_through_the_gateway_as_rotate() -> None:
    """The rotating form as plain Scrapy (`http_proxy` in the environment, nothing else) and python-requests use it:
    the user name `rotate`. Regression: both send no credentials for `http://:TOKEN@gateway` and got 407."""
    import requests

    proxy = f"http://rotate:{TOKEN}@{GATEWAY}"
    site = Site(banned=fleet_addresses()[0])
    try:
        answers = [requests.get(site.url, proxies={"http": proxy}, timeout=30) for _ in range(6)]
        assert [answer.status_code for answer in answers] == [200] * 6, [answer.status_code for answer in answers]
        bare = requests.get(site.url, proxies={"http": f"http://:{TOKEN}@{GATEWAY}"}, timeout=30)
        assert bare.status_code == 407, "requests sends no credentials for an empty user name"
        result = crawl(site.url, {"CONCURRENT_REQUESTS": 8}, env={"CRAWL_PLAIN": "1", "http_proxy": proxy})
    finally:
        site.server.shutdown()
    pages = [page for page in result["pages"] if page["status"] == 200]
    assert len({page["url"] for page in pages}) == PAGES + 1, f"{len(pages)} pages; stats {result['stats']}"
    rotated = {page["proxy"] for page in pages}
    violations = cooling_violations(site.log, site.banned)
    print(
        f"scrapy with http_proxy as rotate: {len(pages)} pages over {len(rotated)} proxies, {len(site.log)} requests "
        f"at the site, through a cooling proxy {len(violations)}; requests 6/6"
    )
    assert len(rotated) >= 2, f"requests without a session rotate: {rotated}"
    assert not violations, f"{len(violations)} requests through a proxy cooling down for the site: {violations[:5]}"
    leases_come_back()


def test_an_https_scrapy_crawl_through_the_gateway_middleware_reports_what_it_sees_in_tunnels() -> None:
    pages, stats, refusals = crawl_through_gateway(
        "scrapy through the gateway over CONNECT", {"CRAWL_GATEWAY": GATEWAY}, tls=True
    )
    reported = stats.get("egress_gateway/reported/banned", 0) + stats.get("egress_gateway/reported/throttled", 0)
    print(
        f"scrapy through the gateway over CONNECT: {reported} reported by the middleware, "
        f"{stats.get('egress_gateway/report_failed', 0)} reports failed"
    )
    assert all(page["url"].startswith("https://") for page in pages), "every page came through a tunnel"
    assert reported == refusals, f"every refusal in a tunnel was reported: {reported} of {refusals}; stats {stats}"
