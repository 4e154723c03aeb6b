"""A real Scrapy crawl of a local site of 200 pages through the operator's proxies, with the Scrapy middleware. The
site bans one proxy's address outright (403) and rate-limits every other address (429 with Retry-After: 2 on every
twentieth request from it); the crawl must still fetch every page, never through a proxy while it was cooling down for
the site, bring throttled proxies back after the Retry-After, and reuse its leases."""

from __future__ import annotations

import http.server
import os
import ssl
import subprocess
import tempfile
import threading
import time

import pytest
from livecrawl import answer, api_requests, crawl, metric

from egress_client import DiscoveryClient

URL = os.environ.get("EGRESS_URL", "")
TOKEN = os.environ.get("EGRESS_TOKEN", "")
PAGES = 200
RETRY_AFTER = 2

pytestmark = pytest.mark.skipif(not URL, reason="needs a live operator: run through `cargo xtask test`")


def tls_context() -> ssl.SSLContext:
    """A server context with a fresh self-signed certificate for 127.0.0.1 (made by the openssl command)."""
    with tempfile.TemporaryDirectory() as tmp:
        key, cert = os.path.join(tmp, "key.pem"), os.path.join(tmp, "cert.pem")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1"],
            check=True,
            capture_output=True,
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
    return context


class Site:
    """The origin: an index linking every page, each page answered according to who fetched it."""

    def __init__(
        self, banned: str, links: str = "/page/", tls: bool = False, pages: int = PAGES, throttle_first: int = 0
    ):
        """`throttle_first`: each address's first page request gets 429 with that Retry-After (seconds)."""
        self.banned = banned
        self.log: list = []  # (time, client address, path, status)
        self.lock = threading.Lock()
        self.served: dict = {}
        self.throttled: set = set()
        site = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                client = self.client_address[0]
                # Who fetched it, for a crawler that cannot see which proxy its tunnel went through.
                status, headers = 200, {"X-Seen-From": client}
                with site.lock:
                    if client == site.banned:
                        status = 403
                    elif throttle_first and self.path != "/" and client not in site.throttled:
                        site.throttled.add(client)
                        status, headers = 429, {**headers, "Retry-After": str(throttle_first)}
                    else:
                        site.served[client] = site.served.get(client, 0) + 1
                        if site.served[client] % 20 == 0:
                            status, headers = 429, {**headers, "Retry-After": str(RETRY_AFTER)}
                    site.log.append((time.monotonic(), client, self.path, status))
                if self.path == "/":
                    body = "".join(f'<a href="{links}{i}">{i}</a>' for i in range(pages))
                else:
                    body = f"<p>{self.path}</p>" if status == 200 else "no"
                answer(self, status, headers, body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls:
            # The handshake happens in the handler's thread, at its first read, not in the accepting one.
            self.server.socket = tls_context().wrap_socket(
                self.server.socket, server_side=True, do_handshake_on_connect=False
            )
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_scrapy_crawl_fetches_every_page_and_never_through_a_cooling_proxy() -> None:
    with DiscoveryClient(URL, TOKEN) as client:
        addresses = sorted(proxy.egress_ip for proxy in client.proxies())
    assert len(set(addresses)) >= 3 and None not in addresses, addresses
    site = Site(banned=addresses[0])
    before = api_requests()
    result = crawl(site.url)
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


def test_a_crawl_waiting_for_proxies_closes_within_5_s_of_closespider_timeout_and_releases_its_leases() -> None:
    """Every proxy cooling down for `closing.test` (banned there 10 minutes), so its pages wait for a lease; the
    index came through a lease of its own site. CLOSESPIDER_TIMEOUT must still close the spider at once, and every
    lease the crawl held be released."""
    target = "http://closing.test/"
    with DiscoveryClient(URL, TOKEN) as client:
        for proxy in client.proxies():
            with client.lease(target, proxy=f"{proxy.namespace}/{proxy.name}") as lease:
                lease.report(outcome="banned", status_code=403)
        assert all(proxy.cooling_down_until is not None for proxy in client.proxies(target=target)), "every proxy cools down"
    site = Site(banned="none", links=target + "page/")
    timeout = 3
    result = crawl(site.url, {"CLOSESPIDER_TIMEOUT": timeout}, timeout=120)
    site.server.shutdown()
    stats = result["stats"]
    took = result["closed_after"] - timeout
    print(
        f"scrapy close: {result['reason']} {took:.2f} s after CLOSESPIDER_TIMEOUT, "
        f"{stats.get('egress/dropped_closing', 0)} waiting requests dropped, {stats.get('egress/leases', 0)} leases, "
        "leases released"
    )
    assert result["reason"] == "closespider_timeout", result["reason"]
    assert took <= 5, f"closed {took:.1f} s after the timeout"
    assert stats.get("egress/leases", 0) >= 1 and stats.get("egress/dropped_closing", 0) >= 1, stats
    assert [page["url"] for page in result["pages"]] == [site.url], "only the index was fetched"
    # Nothing else holds a lease now (the tests run one at a time, and each releases its own). The gauge is
    # refreshed every second or so: once it reads 0 after the crawl's grants, none of them is held.
    deadline = time.monotonic() + 10
    while metric("egress_discovery_leases_active") != 0:
        assert time.monotonic() < deadline, "every lease the crawl held was released"
        time.sleep(0.2)


def test_requests_queued_behind_a_wait_for_a_proxy_leave_the_download_delay_apart() -> None:
    """Every proxy's first page request is throttled (429, Retry-After 4): the crawl runs out of proxies for the site
    and waits for one while Scrapy lets a request into the download handler every DOWNLOAD_DELAY. When the wait
    ends, those requests must keep DOWNLOAD_DELAY between them at the site, not all leave at once."""
    delay, pages = 0.4, 16
    site = Site(banned="none", pages=pages, throttle_first=4)
    settings = {"DOWNLOAD_DELAY": delay, "DOWNLOAD_DELAY_JITTER": 0, "EGRESS_MAX_RETRIES": 20}
    result = crawl(site.url, settings, sessions=2, timeout=180)
    site.server.shutdown()
    stats = result["stats"]
    fetched = {page["url"] for page in result["pages"] if page["status"] == 200}
    times = sorted(t for t, _, path, _ in site.log)
    gaps = [later - earlier for earlier, later in zip(times, times[1:])]
    waits = sum(value for key, value in stats.items() if key.startswith("egress/waits/"))
    close = [gap for gap in gaps if gap < delay * 0.8]
    print(
        f"scrapy pacing: {len(fetched)} pages, {len(site.log)} requests, {waits} waits for a proxy, "
        f"{stats.get('egress/paced', 0)} requests paced, smallest gap {min(gaps):.3f} s (delay {delay} s), "
        f"{len(close)} gaps under {delay * 0.8:.2f} s"
    )
    assert len(fetched) == pages + 1, f"{len(fetched)} pages; stats {stats}"
    assert waits >= 1, f"the crawl never waited for a proxy: {stats}"
    assert not close, f"requests left closer than the download delay: {sorted(close)[:10]}"
