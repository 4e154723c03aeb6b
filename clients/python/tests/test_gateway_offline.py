"""The gateway helpers without a gateway: the proxy URLs they build, what they refuse, and the report request they
send (to a local HTTP server standing in for the gateway's `POST /report`)."""

from __future__ import annotations

import asyncio
import base64
import http.server
import json
import threading
import urllib.parse
from typing import Any, Dict, List

import pytest

from egress_client import GatewayError, areport_to_gateway, gateway_proxy_url, report_to_gateway


def test_the_proxy_url_carries_the_options_and_an_encoded_token() -> None:
    # No options: the user name `rotate` (requests and Scrapy send no credentials for an empty one).
    assert gateway_proxy_url("http://gw:8088", "t0ken") == "http://rotate:t0ken@gw:8088"
    url = gateway_proxy_url(
        "gw.example:8088", "a/b:c@d", session="s-1", sticky=60, pool="crawl.eu", zone="eu-1a", labels={"tier": "dc"}
    )
    parts = urllib.parse.urlsplit(url)
    assert urllib.parse.unquote(parts.username or "") == "session-s-1,sticky-60,pool-crawl.eu,zone-eu-1a,label-tier=dc"
    assert urllib.parse.unquote(parts.password or "") == "a/b:c@d"
    assert (parts.hostname, parts.port) == ("gw.example", 8088)
    limited = gateway_proxy_url("gw:8088", "t", session="s", lifetime=300, requests=20)
    assert urllib.parse.unquote(urllib.parse.urlsplit(limited).username or "") == "session-s,lifetime-300,requests-20"


@pytest.mark.parametrize(
    "gateway, token, options, why",
    [
        ("https://gw:8088", "t", {}, "http://host:port"),
        ("http://u:p@gw:8088", "t", {}, "without credentials"),
        ("http://gw:8088", "", {}, "token"),
        ("http://gw:8088", "t", {"session": "a b"}, "session"),
        ("http://gw:8088", "t", {"session": "x" * 129}, "session"),
        ("http://gw:8088", "t", {"sticky": 60}, "with a session"),
        ("http://gw:8088", "t", {"session": "s", "sticky": 0}, "1-86400"),
        ("http://gw:8088", "t", {"lifetime": 60}, "with a session"),
        ("http://gw:8088", "t", {"session": "s", "lifetime": 86_401}, "1-86400"),
        ("http://gw:8088", "t", {"requests": 5}, "with a session"),
        ("http://gw:8088", "t", {"session": "s", "requests": 0}, "1-1000000"),
        ("http://gw:8088", "t", {"pool": "a,b"}, "comma"),
        ("http://gw:8088", "t", {"labels": {"k=": "v"}}, "label"),
    ],
)
def test_options_the_gateway_would_refuse_are_refused_here(gateway: str, token: str, options: Any, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        gateway_proxy_url(gateway, token, **options)


class Gateway:
    """Answers `POST /report` as told, and keeps what it was sent."""

    def __init__(self, status: int = 200):
        self.seen: List[Dict[str, Any]] = []
        gateway = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                gateway.seen.append({"path": self.path, "headers": dict(self.headers)})
                body = json.dumps({"proxy": "crawl/eu-1", "target": "shop.example"}).encode()
                self.send_response(status)
                if status != 200:
                    self.send_header("Proxy-Status", 'egress-gateway; error=http_request_error; details="no session"')
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_report_is_a_post_to_the_gateway_with_the_sessions_credentials() -> None:
    gateway = Gateway()
    proxy = gateway_proxy_url(gateway.address, "t0ken", session="a1")
    assert report_to_gateway(proxy, "https://Shop.example:8443/item?x=1", "throttled", retry_after=2.4) == "crawl/eu-1"
    assert asyncio.run(areport_to_gateway(proxy, "shop.example", "banned")) == "crawl/eu-1"
    gateway.server.shutdown()
    first, second = gateway.seen
    assert first["path"] == "/report?target=shop.example%3A8443"
    assert second["path"] == "/report?target=shop.example"
    assert first["headers"]["X-Egress-Report"] == "throttled; retry-after=2"
    assert second["headers"]["X-Egress-Report"] == "banned"
    credentials = base64.b64decode(first["headers"]["Proxy-Authorization"].removeprefix("Basic "))
    assert credentials == b"session-a1:t0ken"


def test_a_refused_or_unreachable_report_raises_with_the_reason() -> None:
    gateway = Gateway(status=400)
    proxy = gateway_proxy_url(gateway.address, "t0ken", session="a1")
    with pytest.raises(GatewayError, match="no session") as refused:
        report_to_gateway(proxy, "shop.example", "banned")
    assert refused.value.status == 400
    gateway.server.shutdown()
    gateway.server.server_close()
    with pytest.raises(GatewayError, match="could not be reached"):
        report_to_gateway(proxy, "shop.example", "banned", timeout=2)
    with pytest.raises(ValueError, match="session-<id>"):
        report_to_gateway(gateway_proxy_url(gateway.address, "t0ken"), "shop.example", "banned")
    with pytest.raises(ValueError, match="one of banned, throttled"):
        report_to_gateway(proxy, "shop.example", "blocked")


class Stats:
    def __init__(self) -> None:
        self.values: Dict[str, int] = {}

    def inc_value(self, key: str, count: int = 1) -> None:
        self.values[key] = self.values.get(key, 0) + count


class Crawler:
    def __init__(self) -> None:
        self.stats = Stats()


def test_the_scrapy_gateway_middleware_reports_refusals_in_tunnels_and_schedules_the_request_again() -> None:
    from scrapy import Request
    from scrapy.exceptions import NotConfigured
    from scrapy.http import Response
    from scrapy.settings import Settings

    from egress_client.scrapy import RETRIES_META, EgressGatewayMiddleware

    gateway = Gateway()
    crawler = Crawler()
    values = {"EGRESS_GATEWAY": f"http://{gateway.address}", "EGRESS_TOKEN": "t0ken", "EGRESS_MAX_RETRIES": 1}
    middleware = EgressGatewayMiddleware(crawler, Settings(values))
    tunnelled = Request("https://shop.example/1", meta={"egress_session": "s1"})
    plain = Request("http://shop.example/2", meta={"egress_session": "s1"})
    rotating = Request("https://shop.example/3")
    own = Request("https://shop.example/4", meta={"proxy": "http://elsewhere:3128"})
    for request in (tunnelled, plain, rotating, own):
        middleware.process_request(request)
    assert urllib.parse.unquote(urllib.parse.urlsplit(tunnelled.meta["proxy"]).username or "") == "session-s1"
    # Without a session: `rotate`, for which Scrapy sends the token (for an empty user name it sends nothing).
    assert urllib.parse.urlsplit(rotating.meta["proxy"]).username == "rotate"
    assert own.meta["proxy"] == "http://elsewhere:3128", "a request's own proxy is left alone"

    async def answer(request: Request, status: int) -> Any:
        return await middleware.process_response(request, Response(request.url, status=status, request=request))

    again = asyncio.run(answer(tunnelled, 403))
    assert isinstance(again, Request) and again.dont_filter and again.meta[RETRIES_META] == 1
    assert gateway.seen[-1]["headers"]["X-Egress-Report"] == "banned"
    # Plain HTTP is the gateway's to report; a request without a session has no proxy to report; a 200 is a page.
    for request, status in ((plain, 403), (rotating, 429), (tunnelled, 200)):
        assert isinstance(asyncio.run(answer(request, status)), Response)
    # Past EGRESS_MAX_RETRIES the refusal is reported and passed on.
    assert isinstance(asyncio.run(answer(again, 429)), Response)
    assert len(gateway.seen) == 2
    assert crawler.stats.values == {
        "egress_gateway/reported/banned": 1,
        "egress_gateway/reported/throttled": 1,
        "egress_gateway/retries": 1,
        "egress_gateway/retries_exhausted": 1,
    }
    gateway.server.shutdown()
    with pytest.raises(NotConfigured, match="EGRESS_GATEWAY"):
        EgressGatewayMiddleware(crawler, Settings({"EGRESS_TOKEN": "t0ken"}))
    with pytest.raises(ValueError, match="pool"):
        EgressGatewayMiddleware(crawler, Settings({**values, "EGRESS_GATEWAY_OPTIONS": {"pool": "a,b"}}))
