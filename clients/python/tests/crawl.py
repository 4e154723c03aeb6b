"""A Scrapy crawl through egress-operator proxies, run in a process of its own by test_scrapy.py (Twisted's reactor
starts once per process): `python crawl.py <start URL> <pages> <output JSON>`. Settings come from the environment."""

from __future__ import annotations

import json
import os
import sys

import scrapy
from scrapy.crawler import CrawlerProcess


class SiteSpider(scrapy.Spider):
    name = "site"

    def __init__(self, start: str, **kwargs):
        super().__init__(**kwargs)
        self.start_urls = [start]
        self.pages: list = []

    def parse(self, response):
        self.pages.append({"url": response.url, "status": response.status, "proxy": response.meta.get("download_slot")})
        # Four crawl sessions, each with a lease of its own per site.
        for index, href in enumerate(response.css("a::attr(href)").getall()):
            yield response.follow(href, self.parse, meta={"egress_session": str(index % 4)})


def main() -> None:
    start, output = sys.argv[1], sys.argv[2]
    process = CrawlerProcess(
        settings={
            "DOWNLOADER_MIDDLEWARES": {"egress_client.scrapy.EgressProxyMiddleware": 700},
            "EGRESS_URL": os.environ["EGRESS_URL"],
            "EGRESS_TOKEN": os.environ["EGRESS_TOKEN"],
            "EGRESS_REPORT_EVERY": 10,
            "CONCURRENT_REQUESTS": 8,
            # Per slot, and a slot is a proxy: long enough that the crawl outlasts the site's Retry-After.
            "DOWNLOAD_DELAY": 0.05,
            "RANDOMIZE_DOWNLOAD_DELAY": False,
            "ROBOTSTXT_OBEY": False,
            "RETRY_HTTP_CODES": [500, 502, 503, 504, 522, 524, 408],
            "LOG_LEVEL": "INFO",
            "TELNETCONSOLE_ENABLED": False,
        }
    )
    crawler = process.create_crawler(SiteSpider)
    process.crawl(crawler, start=start)
    process.start()
    stats = {key: value for key, value in crawler.stats.get_stats().items() if isinstance(value, (int, float, str))}
    with open(output, "w") as out:
        json.dump({"pages": crawler.spider.pages, "stats": stats}, out)


if __name__ == "__main__":
    main()
