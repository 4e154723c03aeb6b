"""The Scrapy middleware against httpx's mock transport (no server, no crawl): what it reports for which answer."""

from __future__ import annotations

import asyncio
import base64
import datetime
import json

import httpx
from scrapy import Request
from scrapy.exceptions import IgnoreRequest
from scrapy.http import Response
from scrapy.settings import Settings

from egress_client import AsyncDiscoveryClient
from egress_client.scrapy import EgressAddon, EgressDownloadHandler, EgressProxyMiddleware, ban


class Stats:
    def __init__(self) -> None:
        self.values: dict = {}

    def inc_value(self, key: str, count: int = 1) -> None:
        self.values[key] = self.values.get(key, 0) + count


class Crawler:
    def __init__(self) -> None:
        self.stats = Stats()


def settings(**values) -> Settings:
    """Settings as the add-on leaves them, with `values` on top."""
    result = Settings({"EGRESS_URL": "http://discovery", "EGRESS_TOKEN": "token-1", **values})
    EgressAddon().update_settings(result)
    return result


def lease_answer(lease_id: str, expires_in: float) -> dict:
    expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=expires_in)
    return {
        "id": lease_id,
        "proxy": {"namespace": "crawl", "name": "eu-1", "host": "10.0.0.1", "port": 3128, "url": "http://10.0.0.1:3128"},
        "target": "example.com",
        "expiresAt": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def discovery(lease_ids: list, reports: list):
    """A discovery API granting `lease_ids` in turn (each for 600 s), recording each report's (path, body) in
    `reports`, and answering releases."""
    leases = iter(lease_ids)

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

    return handler


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

    middleware = EgressProxyMiddleware(Crawler(), settings(EGRESS_LEASE_TTL=6))
    middleware.client = AsyncDiscoveryClient("http://discovery", "token-1", transport=httpx.MockTransport(handler))

    async def crawl() -> None:
        first = Request("https://example.com/1")
        await middleware.bind(first)
        assert first.meta["egress_lease"] == "l1.first"
        second = Request("https://example.com/2")
        await middleware.bind(second)
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
        try:
            EgressProxyMiddleware(Crawler(), settings(EGRESS_LEASE_TTL=ttl))
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
    middleware = EgressProxyMiddleware(crawler, settings())
    middleware.client = AsyncDiscoveryClient("http://discovery", "token-1", transport=httpx.MockTransport(handler))

    async def crawl() -> float:
        waiting = asyncio.ensure_future(middleware.bind(Request("https://example.com/1")))
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
        asyncio.run(middleware.bind(Request("https://example.com/2")))
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

    middleware = EgressProxyMiddleware(Crawler(), settings())
    middleware.client = AsyncDiscoveryClient("http://discovery", "token-1", transport=httpx.MockTransport(handler))

    async def crawl() -> list:
        # Two hosts at once: each takes a lease before either knows the site.
        first, second = Request("https://www.shop.example/1"), Request("https://cdn.shop.example/2")
        await asyncio.gather(middleware.bind(first), middleware.bind(second))
        later = Request("https://img.shop.example/3")
        await middleware.bind(later)
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
    reports: list = []
    handler = discovery(["l1.first", "l2.second"], reports)

    crawler = Crawler()
    middleware = EgressProxyMiddleware(crawler, settings(EGRESS_TOKEN="t"))
    middleware.client = AsyncDiscoveryClient("http://discovery", "t", transport=httpx.MockTransport(handler))

    async def crawl() -> None:
        first, second = Request("https://example.com/1"), Request("https://example.com/2")
        await middleware.bind(first)
        await middleware.bind(second)
        assert first.meta["egress_lease"] == second.meta["egress_lease"] == "l1.first"
        await middleware.process_response(first, Response("https://example.com/1", status=403, request=first))
        await middleware.process_response(second, Response("https://example.com/2", status=200, request=second))
        await middleware.spider_closed()

    asyncio.run(crawl())
    paths = [(path, body.get("outcome"), body.get("ok")) for path, body in reports]
    assert paths == [("/v1/leases/l1.first/report", "banned", None), ("/v1/leases/l1.first/report", None, 1)], paths
    assert crawler.stats.values.get("egress/answered_after_drop") == 1


def test_the_middleware_refuses_to_start_without_its_download_handler() -> None:
    """Without the handler no request would be bound to a proxy: they would leave from the crawler's own address."""
    plain = Settings({"EGRESS_URL": "http://discovery", "EGRESS_TOKEN": "t"})
    try:
        EgressProxyMiddleware(Crawler(), plain)
    except ValueError as error:
        assert "egress_client.scrapy.EgressDownloadHandler" in str(error) and "EgressAddon" in str(error), error
        assert "http and https" in str(error), error
    else:
        raise AssertionError("the middleware started without its download handler")


def test_the_add_on_wraps_the_handlers_already_configured() -> None:
    custom = Settings({"DOWNLOAD_HANDLERS": {"https": "my.handlers.Browser"}})
    EgressAddon().update_settings(custom)
    handlers = custom.getwithbase("DOWNLOAD_HANDLERS")
    assert handlers["http"] == handlers["https"] == "egress_client.scrapy.EgressDownloadHandler"
    wrapped = custom.getdict("EGRESS_DOWNLOAD_HANDLERS")
    assert wrapped["https"] == "my.handlers.Browser", wrapped
    assert wrapped["http"].endswith("HTTP11DownloadHandler"), wrapped
    assert EgressProxyMiddleware in custom.getdict("DOWNLOADER_MIDDLEWARES").keys() or any(
        str(key).endswith("EgressProxyMiddleware") for key in custom.getdict("DOWNLOADER_MIDDLEWARES")
    )
    # Twice changes nothing: the handler never wraps itself.
    EgressAddon().update_settings(custom)
    assert custom.getdict("EGRESS_DOWNLOAD_HANDLERS") == wrapped


def test_a_request_queued_behind_a_ban_leaves_through_the_new_lease() -> None:
    """The proxy is bound when the handler sends the request, not when it enters the download slot's queue: a
    request queued while its site banned the lease's proxy goes out through the next lease, with that proxy's
    credentials, and what the handler below it receives says so."""
    leases = iter([("l1.first", "eu-1", "u1:p%401"), ("l2.second", "eu-2", "u2:p2")])

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST" and path == "/v1/leases":
            lease_id, name, credentials = next(leases)
            answer = lease_answer(lease_id, 600)
            answer["proxy"] = {**answer["proxy"], "name": name, "url": f"http://{credentials}@10.0.0.{name[-1]}:3128"}
            return httpx.Response(201, json=answer)
        if path.endswith("/report"):
            return httpx.Response(200, json={})
        if request.method == "DELETE":
            return httpx.Response(204)
        return httpx.Response(404, json={"detail": "unexpected " + path})

    sent = []

    class Inner:
        async def download_request(self, request: Request) -> Response:
            sent.append((request.url, request.meta["proxy"], request.headers.get(b"Proxy-Authorization")))
            status = 403 if request.url.endswith("/1") else 200
            return Response(request.url, status=status, request=request)

    crawler = Crawler()
    crawler.settings = settings()
    middleware = EgressProxyMiddleware(crawler, crawler.settings)
    middleware.client = AsyncDiscoveryClient("http://discovery", "token-1", transport=httpx.MockTransport(handler))
    from egress_client import scrapy as module

    module._MIDDLEWARES[crawler] = middleware
    download = EgressDownloadHandler(crawler)
    download.inner = {"https": Inner()}

    async def crawl() -> None:
        first, queued = Request("https://example.com/1"), Request("https://example.com/2")
        answer = await download.download_request(first)
        assert answer.status == 403
        again = await middleware.process_response(first, answer)
        assert isinstance(again, Request) and "proxy" not in again.meta
        # The queued request was created (and passed the middlewares) before the ban; it leaves only now.
        await download.download_request(queued)
        await middleware.process_response(queued, Response(queued.url, status=200, request=queued))

    asyncio.run(crawl())
    assert sent == [
        ("https://example.com/1", "http://10.0.0.1:3128", b"Basic " + base64.b64encode(b"u1:p@1")),
        ("https://example.com/2", "http://10.0.0.2:3128", b"Basic " + base64.b64encode(b"u2:p2")),
    ], sent


def test_a_block_page_answered_200_is_reported_as_a_ban_from_the_callback() -> None:
    reports: list = []
    handler = discovery(["l1.first"], reports)

    crawler = Crawler()
    middleware = EgressProxyMiddleware(crawler, settings())
    middleware.client = AsyncDiscoveryClient("http://discovery", "token-1", transport=httpx.MockTransport(handler))
    from egress_client import scrapy as module

    module._MIDDLEWARES.clear()  # other tests' crawls: only this one runs
    module._MIDDLEWARES[crawler] = middleware

    async def crawl() -> Request:
        served, blocked = Request("https://example.com/1"), Request("https://example.com/2")
        for request in (served, blocked):
            await middleware.bind(request)
            await middleware.process_response(request, Response(request.url, status=200, request=request))
        # The spider sees a CAPTCHA in the second page.
        again = ban(Response(blocked.url, status=200, request=blocked))
        await middleware.spider_closed()
        return again

    again = asyncio.run(crawl())
    assert isinstance(again, Request) and again.url == "https://example.com/2" and again.dont_filter
    assert [(path, body.get("outcome"), body.get("ok"), body.get("release")) for path, body in reports] == [
        ("/v1/leases/l1.first/report", "banned", 1, True)
    ], reports
    assert crawler.stats.values.get("egress/bans") == 1
    # A response that came through no lease says so.
    try:
        ban(Response("https://example.com/3", status=200, request=Request("https://example.com/3")))
    except ValueError as error:
        assert "did not come through an egress-operator lease" in str(error)
    else:
        raise AssertionError("a response of no lease was reported")


def test_a_ban_answered_on_a_dropped_lease_is_reported_on_it() -> None:
    """Two requests in flight on one lease both answer 403: the second is reported on the dropped lease too (the
    server counts one client's repeated reports on a running cooldown once), so every refusal reaches the server."""
    reports: list = []
    handler = discovery(["l1.first", "l2.second"], reports)

    crawler = Crawler()
    middleware = EgressProxyMiddleware(crawler, settings())
    middleware.client = AsyncDiscoveryClient("http://discovery", "token-1", transport=httpx.MockTransport(handler))

    async def crawl() -> None:
        first, second = Request("https://example.com/1"), Request("https://example.com/2")
        await middleware.bind(first)
        await middleware.bind(second)
        for request in (first, second):
            await middleware.process_response(request, Response(request.url, status=403, request=request))

    asyncio.run(crawl())
    assert [(path, body.get("outcome"), body.get("release")) for path, body in reports] == [
        ("/v1/leases/l1.first/report", "banned", True),
        ("/v1/leases/l1.first/report", "banned", None),
    ], reports
    assert crawler.stats.values.get("egress/bans") == 2


def test_a_lease_granted_while_a_refusal_is_being_reported_is_given_back() -> None:
    """Session 0's request is answered 403 through eu-1; while that report is on its way, session 1 is granted a
    lease on eu-1 (the server does not know yet): the middleware gives it back and sends through the next one."""
    granted = iter([("l1.a", "eu-1"), ("l2.b", "eu-1"), ("l3.b", "eu-2")])
    released = []
    gate: dict = {}

    async def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST" and path == "/v1/leases":
            lease_id, name = next(granted)
            answer = lease_answer(lease_id, 600)
            answer["proxy"] = {**answer["proxy"], "name": name, "url": f"http://10.0.0.{name[-1]}:3128"}
            return httpx.Response(201, json=answer)
        if path.endswith("/report"):
            await gate["open"].wait()
            return httpx.Response(200, json={})
        if request.method == "DELETE":
            released.append(path)
            return httpx.Response(204)
        return httpx.Response(404, json={"detail": "unexpected " + path})

    crawler = Crawler()
    middleware = EgressProxyMiddleware(crawler, settings())
    middleware.client = AsyncDiscoveryClient("http://discovery", "token-1", transport=httpx.MockTransport(handler))

    async def crawl() -> Request:
        gate["open"] = asyncio.Event()
        first = Request("https://example.com/1", meta={"egress_session": "0"})
        await middleware.bind(first)
        refusing = asyncio.ensure_future(
            middleware.process_response(first, Response(first.url, status=403, request=first))
        )
        await until(lambda: ("example.com", "proxy:crawl/eu-1") in middleware.refused)
        other = Request("https://example.com/2", meta={"egress_session": "1"})
        await middleware.bind(other)
        gate["open"].set()
        await refusing
        return other

    other = asyncio.run(crawl())
    assert other.meta["proxy"] == "http://10.0.0.2:3128", other.meta
    assert released == ["/v1/leases/l2.b"], released
    assert crawler.stats.values.get("egress/leases_returned") == 1
    assert middleware.refused == {}, "forgotten once the report is in"
