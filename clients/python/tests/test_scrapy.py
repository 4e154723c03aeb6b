"""A real Scrapy crawl of a local site of 200 pages through the operator's proxies, with the Scrapy middleware. The
site bans one proxy's address outright (403) and rate-limits every other address (429 with Retry-After: 2 on every
twentieth request from it); the crawl must still fetch every page, never through a proxy while it was cooling down for
the site, bring throttled proxies back after the Retry-After, and reuse its leases."""

from __future__ import annotations

import http.server
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from egress_client import DiscoveryClient

URL = os.environ.get("EGRESS_URL", "")
TOKEN = os.environ.get("EGRESS_TOKEN", "")
METRICS = os.environ.get("EGRESS_METRICS", "")
PAGES = 200
RETRY_AFTER = 2

pytestmark = pytest.mark.skipif(not URL, reason="needs a live operator: run through `cargo xtask test`")


def api_requests() -> float:
    """Every request the discovery API has answered, from the operator's own metrics."""
    text = httpx.get(f"{METRICS}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("egress_discovery_requests_total{")
    )


class Site:
    """The origin: an index linking every page, each page answered according to who fetched it."""

    def __init__(self, banned: str):
        self.banned = banned
        self.log: list = []  # (time, client address, path, status)
        self.lock = threading.Lock()
        self.served: dict = {}
        site = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                client = self.client_address[0]
                status, headers = 200, {}
                with site.lock:
                    if client == site.banned:
                        status = 403
                    else:
                        site.served[client] = site.served.get(client, 0) + 1
                        if site.served[client] % 20 == 0:
                            status, headers = 429, {"Retry-After": str(RETRY_AFTER)}
                    site.log.append((time.monotonic(), client, self.path, status))
                if self.path == "/":
                    body = "".join(f'<a href="/page/{i}">{i}</a>' for i in range(PAGES))
                else:
                    body = f"<p>{self.path}</p>" if status == 200 else "no"
                data = f"<html><body>{body}</body></html>".encode()
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_scrapy_crawl_fetches_every_page_and_never_through_a_cooling_proxy() -> None:
    with DiscoveryClient(URL, TOKEN) as client:
        addresses = sorted(proxy.egress_ip for proxy in client.proxies())
    assert len(set(addresses)) >= 3 and None not in addresses, addresses
    site = Site(banned=addresses[0])
    before = api_requests()
    with tempfile.TemporaryDirectory() as tmp:
        output = pathlib.Path(tmp) / "crawl.json"
        here = pathlib.Path(__file__).parent
        done = subprocess.run(
            [sys.executable, str(here / "crawl.py"), site.url, str(output)],
            env={**os.environ, "PYTHONPATH": str(here.parent / "src")},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        result = json.loads(output.read_text())
    site.server.shutdown()
    api_calls = api_requests() - before
    pages = {page["url"] for page in result["pages"] if page["status"] == 200}
    stats = result["stats"]
    log = site.log
    # Every page (and the index) was fetched.
    assert len(pages) == PAGES + 1, f"{len(pages)} pages; stats {stats}"
    # No request reached the site through a proxy while it was cooling down for it: after the banned address's
    # first 403 (plus a second for requests already in flight), and inside a throttle's Retry-After.
    first_ban = min((t for t, ip, _, s in log if ip == site.banned and s == 403), default=None)
    late = [entry for entry in log if first_ban is not None and entry[1] == site.banned and entry[0] > first_ban + 1.0]
    inside, back = [], {}
    for address in set(ip for _, ip, _, _ in log) - {site.banned}:
        throttles = [t for t, ip, _, s in log if ip == address and s == 429]
        inside += [
            entry for entry in log if entry[1] == address and any(t + 1.0 < entry[0] < t + RETRY_AFTER - 0.2 for t in throttles)
        ]
        if throttles:
            back[address] = any(ip == address and s == 200 and t > throttles[0] + RETRY_AFTER for t, ip, _, s in log)
    leases = stats.get("egress/leases", 0)
    calls_per_page = api_calls / PAGES
    print(
        f"scrapy crawl: {len(pages)} pages, {len(log)} requests, {leases} leases, "
        f"{stats.get('egress/bans', 0)} bans, {stats.get('egress/throttles', 0)} throttles, "
        f"lease calls per page {leases / PAGES:.3f}, API calls per page {calls_per_page:.3f}, "
        f"through a cooling proxy {len(late) + len(inside)}"
    )
    assert not late, f"{len(late)} requests through the banned proxy after its ban"
    assert not inside, f"{len(inside)} requests through a throttled proxy inside its Retry-After"
    assert leases / PAGES < 0.3, f"{leases} leases for {PAGES} pages: leases are not reused"
    assert stats.get("egress/bans", 0) >= 1 and stats.get("egress/throttles", 0) >= 1, stats
    assert back and all(back.values()), f"throttled proxies came back after the Retry-After: {back}"
    assert calls_per_page < 1, f"{api_calls} discovery API calls for {PAGES} pages"
