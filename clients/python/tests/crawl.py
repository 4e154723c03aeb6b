"""A Scrapy crawl through egress-operator proxies, run in a process of its own by the live Scrapy tests (Twisted's
reactor starts once per process): `python crawl.py <start URL> <output JSON>`. Settings come from the environment:
`EGRESS_URL`, `EGRESS_TOKEN`, and `CRAWL_SETTINGS`, a JSON object of Scrapy settings over the defaults below.

With `CRAWL_PROXY` set (a proxy URL with `{session}` in it, such as the gateway's
`http://session-{session}:TOKEN@host:port`), the crawl is plain Scrapy: no egress add-on, Scrapy's own retry
settings, and each request's `meta["proxy"]` that URL for its session; several URLs separated by spaces (the
gateway's replicas) take the requests in turn. With `CRAWL_GATEWAY` set (the gateway's
host:port), the crawl uses the gateway middleware, `egress_client.scrapy.EgressGatewayMiddleware`, instead: each
request's session in `meta["egress_session"]`, refusals inside tunnels reported to the gateway. With `CRAWL_PLAIN`
set, the crawl is plain Scrapy with no proxy of its own: the caller sets `http_proxy` in its environment, which
Scrapy's `HttpProxyMiddleware` reads."""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import scrapy
from scrapy import signals
from scrapy.crawler import CrawlerProcess

from egress_client.scrapy import GATEWAY_MIDDLEWARE, PROXY_META

PROXY = os.environ.get("CRAWL_PROXY", "")
PROXIES = PROXY.split()
TURNS = itertools.count()
GATEWAY = os.environ.get("CRAWL_GATEWAY", "")
PLAIN = bool(os.environ.get("CRAWL_PLAIN"))


class SiteSpider(scrapy.Spider):
    name = "site"

    def __init__(self, start: str, sessions: int, **kwargs):
        super().__init__(**kwargs)
        self.start_urls = [start]
        self.sessions = sessions
        self.pages: list = []
        self.opened = self.closed = 0.0
        self.reason = ""

    @classmethod
    def from_crawler(cls, crawler, *args, **kwargs):
        spider = super().from_crawler(crawler, *args, **kwargs)
        crawler.signals.connect(spider.on_opened, signal=signals.spider_opened)
        crawler.signals.connect(spider.on_closed, signal=signals.spider_closed)
        return spider

    def on_opened(self, spider) -> None:
        self.opened = time.monotonic()

    def on_closed(self, spider, reason) -> None:
        self.closed, self.reason = time.monotonic(), reason

    def meta(self, session: str) -> dict:
        if PLAIN:
            return {}
        if PROXY:
            proxy = PROXIES[next(TURNS) % len(PROXIES)]
            return {"proxy": proxy.format(session=session), "session": session}
        return {"egress_session": session}

    async def start(self):
        for url in self.start_urls:
            yield scrapy.Request(url, dont_filter=True, meta=self.meta("index") if PROXY or GATEWAY else {})

    def parse(self, response):
        proxy = response.meta.get(PROXY_META) or response.headers.get("X-Egress-Proxy", b"").decode()
        # Inside a tunnel the proxy's name is not in sight: the site says which address it saw.
        proxy = proxy or response.headers.get("X-Seen-From", b"").decode()
        session = response.meta.get("session") or response.meta.get("egress_session")
        self.pages.append({"url": response.url, "status": response.status, "proxy": proxy, "session": session})
        # Crawl sessions, each with a lease of its own per site.
        for index, href in enumerate(response.css("a::attr(href)").getall()):
            yield response.follow(href, self.parse, meta=self.meta(str(index % self.sessions)))


def main() -> None:
    start, output = sys.argv[1], sys.argv[2]
    settings = {
        "ADDONS": {"egress_client.scrapy.EgressAddon": 100},
        "EGRESS_URL": os.environ["EGRESS_URL"],
        "EGRESS_TOKEN": os.environ["EGRESS_TOKEN"],
        "EGRESS_REPORT_EVERY": 10,
        "CONCURRENT_REQUESTS": 8,
        # Per site (the host): long enough that the crawl outlasts the site's Retry-After.
        "DOWNLOAD_DELAY": 0.05,
        "RANDOMIZE_DOWNLOAD_DELAY": False,
        "ROBOTSTXT_OBEY": False,
        "RETRY_HTTP_CODES": [500, 502, 503, 504, 522, 524, 408],
        "LOG_LEVEL": "INFO",
        "TELNETCONSOLE_ENABLED": False,
    }
    if PROXY or PLAIN:
        # Plain Scrapy: the proxy URL is all it knows.
        for key in ("ADDONS", "EGRESS_URL", "EGRESS_TOKEN", "EGRESS_REPORT_EVERY", "RETRY_HTTP_CODES"):
            del settings[key]
    elif GATEWAY:
        # Through the gateway with its middleware: no add-on, Scrapy's own retry settings.
        for key in ("ADDONS", "EGRESS_URL", "EGRESS_REPORT_EVERY", "RETRY_HTTP_CODES"):
            del settings[key]
        settings["DOWNLOADER_MIDDLEWARES"] = {GATEWAY_MIDDLEWARE: 600}
        settings["EGRESS_GATEWAY"] = GATEWAY
    settings.update(json.loads(os.environ.get("CRAWL_SETTINGS", "{}")))
    process = CrawlerProcess(settings=settings)
    crawler = process.create_crawler(SiteSpider)
    process.crawl(crawler, start=start, sessions=int(os.environ.get("CRAWL_SESSIONS", "4")))
    process.start()
    stats = {key: value for key, value in crawler.stats.get_stats().items() if isinstance(value, (int, float, str))}
    spider = crawler.spider
    with open(output, "w") as out:
        json.dump(
            {
                "pages": spider.pages,
                "stats": stats,
                "reason": spider.reason,
                "closed_after": spider.closed - spider.opened,
            },
            out,
        )


if __name__ == "__main__":
    main()
