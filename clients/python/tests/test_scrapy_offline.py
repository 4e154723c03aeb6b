"""The Scrapy middleware against httpx's mock transport (no server, no crawl): what it reports for which answer."""

from __future__ import annotations

import asyncio
import datetime
import json

import httpx
from scrapy import Request
from scrapy.exceptions import IgnoreRequest
from scrapy.http import Response
from scrapy.settings import Settings

from egress_client import AsyncDiscoveryClient
from egress_client.scrapy import EgressProxyMiddleware


class Stats:
    def __init__(self) -> None:
        self.values: dict = {}

    def inc_value(self, key: str, count: int = 1) -> None:
        self.values[key] = self.values.get(key, 0) + count


class Crawler:
    def __init__(self) -> None:
        self.stats = Stats()


def lease_answer(lease_id: str, expires_in: float) -> dict:
    expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=expires_in)
    return {
        "id": lease_id,
        "proxy": {"namespace": "crawl", "name": "eu-1", "host": "10.0.0.1", "port": 3128, "url": "http://10.0.0.1:3128"},
        "target": "example.com",
        "expiresAt": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def test_answers_after_a_renew_are_still_reported_through_the_lease() -> None:
    """After a renew the lease has a new ID, which the requests sent from then on carry: a ban answered to one of
    them is reported (and released) on the lease, not dropped as an answer of no lease."""
    reports = []

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST" and path == "/v1/leases":
            # Expiring soon, so the next request renews first.
            return httpx.Response(201, json=lease_answer("l1.first", 1))
        if path.endswith("/renew"):
            return httpx.Response(200, json={**lease_answer("l1.renewed", 600), "replaced": False})
        if path.endswith("/report"):
            reports.append((path, json.loads(request.content)))
            return httpx.Response(200, json={"cooldownUntil": "2026-12-02T12:00:00Z"})
        return httpx.Response(404, json={"detail": "unexpected " + path})

    settings = Settings({"EGRESS_URL": "http://discovery", "EGRESS_TOKEN": "token-1", "EGRESS_LEASE_TTL": 6})
    middleware = EgressProxyMiddleware(Crawler(), settings)
    middleware.client = AsyncDiscoveryClient("http://discovery", "token-1", transport=httpx.MockTransport(handler))

    async def crawl() -> None:
        first = Request("https://example.com/1")
        await middleware.process_request(first)
        assert first.meta["egress_lease"] == "l1.first"
        second = Request("https://example.com/2")
        await middleware.process_request(second)
        assert second.meta["egress_lease"] == "l1.renewed", "renewed before use"
        banned = Response("https://example.com/2", status=403, request=second)
        again = await middleware.process_response(second, banned)
        assert isinstance(again, Request), "the banned request goes again on another lease"

    asyncio.run(crawl())
    assert len(reports) == 1, reports
    path, body = reports[0]
    assert path == "/v1/leases/l1.renewed/report"
    assert (body["outcome"], body["statusCode"], body["release"]) == ("banned", 403, True)
    assert middleware.crawler.stats.values.get("egress/bans") == 1


def test_a_lease_ttl_out_of_range_is_refused_at_start() -> None:
    for ttl in (0, -1, 3601):
        settings = Settings({"EGRESS_URL": "http://discovery", "EGRESS_LEASE_TTL": ttl})
        try:
            EgressProxyMiddleware(Crawler(), settings)
        except ValueError as error:
            assert "EGRESS_LEASE_TTL must be from 1 to 3600 seconds" in str(error)
        else:
            raise AssertionError(f"EGRESS_LEASE_TTL={ttl} was accepted")


async def until(condition, timeout: float = 5.0) -> None:
    """Yields to the loop until `condition()` holds, failing after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.01)


def test_a_request_waiting_for_a_proxy_is_dropped_once_the_spider_closes() -> None:
    """Every proxy cooling down (503 with Retry-After 600): the request waits, without blocking, until the engine
    starts closing the spider, then it is dropped within half a second, so the close does not wait 600 s for it."""
    asked = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(
            503,
            headers={"Retry-After": "600"},
            json={"reason": "all-cooling-down", "detail": "every proxy is cooling down for example.com"},
        )

    class Slot:
        closing = None

    class Engine:
        running = True
        _slot = Slot()

    crawler = Crawler()
    crawler.engine = Engine()
    settings = Settings({"EGRESS_URL": "http://discovery", "EGRESS_TOKEN": "token-1"})
    middleware = EgressProxyMiddleware(crawler, settings)
    middleware.client = AsyncDiscoveryClient("http://discovery", "token-1", transport=httpx.MockTransport(handler))

    async def crawl() -> float:
        waiting = asyncio.ensure_future(middleware.process_request(Request("https://example.com/1")))
        # Refused once and waiting out the Retry-After (the wait is counted before it starts).
        await until(lambda: crawler.stats.values.get("egress/waits/all-cooling-down") == 1 or waiting.done())
        assert not waiting.done(), "it waits for a proxy"
        loop = asyncio.get_running_loop()
        closed_at = loop.time()
        crawler.engine._slot.closing = object()  # what engine.close_spider sets first
        try:
            await asyncio.wait_for(waiting, timeout=5)
        except IgnoreRequest:
            return loop.time() - closed_at
        raise AssertionError("the waiting request was not dropped")

    took = asyncio.run(crawl())
    assert took <= 1.0, f"dropped {took:.2f} s after the close began"
    assert asked == ["/v1/leases"], "asked once, then waited"
    assert crawler.stats.values.get("egress/dropped_closing") == 1
    # Closing already: no lease is asked for at all.
    asked.clear()
    try:
        asyncio.run(middleware.process_request(Request("https://example.com/2")))
    except IgnoreRequest:
        pass
    else:
        raise AssertionError("a request while closing is dropped")
    assert asked == []


def test_hosts_of_one_site_share_one_lease_as_they_share_its_cooldowns() -> None:
    """The server names the site (the registrable domain): after the first lease for `www.shop.example`, requests to
    `img.shop.example` go through the same lease, and a second lease taken at the same time for another host of the
    site is released, not kept beside it."""
    leased, released = [], []

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST" and path == "/v1/leases":
            leased.append(json.loads(request.content)["target"])
            return httpx.Response(201, json={**lease_answer(f"l{len(leased)}.x", 600), "target": "shop.example"})
        if request.method == "DELETE":
            released.append(path)
            return httpx.Response(204)
        return httpx.Response(404, json={"detail": "unexpected " + path})

    settings = Settings({"EGRESS_URL": "http://discovery", "EGRESS_TOKEN": "token-1"})
    middleware = EgressProxyMiddleware(Crawler(), settings)
    middleware.client = AsyncDiscoveryClient("http://discovery", "token-1", transport=httpx.MockTransport(handler))

    async def crawl() -> list:
        # Two hosts at once: each takes a lease before either knows the site.
        first, second = Request("https://www.shop.example/1"), Request("https://cdn.shop.example/2")
        await asyncio.gather(middleware.process_request(first), middleware.process_request(second))
        later = Request("https://img.shop.example/3")
        await middleware.process_request(later)
        return [first.meta["egress_lease"], second.meta["egress_lease"], later.meta["egress_lease"]]

    ids = asyncio.run(crawl())
    assert len(set(ids)) == 1, ids
    # One lease kept; one more only if the two hosts asked at once, and that one released.
    assert len(leased) in (1, 2) and len(released) == len(leased) - 1, (leased, released)
    assert f"/v1/leases/{ids[0]}" not in released
    assert set(middleware.held) == {("shop.example", None)}
    # A host of another site is its own.
    assert middleware._site_of("shop.example.org") == "shop.example.org"
    assert middleware._site_of("a.b.shop.example") == "shop.example"


def test_answers_in_flight_on_a_dropped_lease_are_still_reported_on_it() -> None:
    """Two requests sent on one lease; the first is answered 403, so the lease is reported banned and released, and
    the second then answers 200: that success is counted on the dropped lease and reported there (the server counts
    a report on an ended lease against its proxy), not lost."""
    reports = []
    leases = iter(["l1.first", "l2.second"])

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST" and path == "/v1/leases":
            return httpx.Response(201, json=lease_answer(next(leases), 600))
        if path.endswith("/report"):
            reports.append((path, json.loads(request.content)))
            return httpx.Response(200, json={})
        if request.method == "DELETE":
            return httpx.Response(204)
        return httpx.Response(404, json={"detail": "unexpected " + path})

    crawler = Crawler()
    middleware = EgressProxyMiddleware(crawler, Settings({"EGRESS_URL": "http://discovery", "EGRESS_TOKEN": "t"}))
    middleware.client = AsyncDiscoveryClient("http://discovery", "t", transport=httpx.MockTransport(handler))

    async def crawl() -> None:
        first, second = Request("https://example.com/1"), Request("https://example.com/2")
        await middleware.process_request(first)
        await middleware.process_request(second)
        assert first.meta["egress_lease"] == second.meta["egress_lease"] == "l1.first"
        await middleware.process_response(first, Response("https://example.com/1", status=403, request=first))
        await middleware.process_response(second, Response("https://example.com/2", status=200, request=second))
        await middleware.spider_closed()

    asyncio.run(crawl())
    paths = [(path, body.get("outcome"), body.get("ok")) for path, body in reports]
    assert paths == [("/v1/leases/l1.first/report", "banned", None), ("/v1/leases/l1.first/report", None, 1)], paths
    assert crawler.stats.values.get("egress/answered_after_drop") == 1
