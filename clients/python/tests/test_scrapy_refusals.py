"""The Scrapy crawl of docs/clients.md's promise, on a fleet of its own (three proxies with a 10 s first-ban
cooldown, started by `bins/operator/tests/clients.rs`): a site of 200 pages that refuses 8 % of requests (every 25th
answered 403, every 25th in between 429 with Retry-After: 2), crawled with `EGRESS_LEASE_TTL=6` (a renew every few
seconds) and `DOWNLOAD_DELAY=0.2`. Every refusal must reach the server, no request leave through a proxy inside a
cooldown the site gave it, and at least 98 % of the pages served be reported."""

from __future__ import annotations

import http.server
import os
import threading
import time

import pytest
from livecrawl import answer, crawl, outcome

URL = os.environ.get("EGRESS_URL", "")
PAGES = 200
BASE_COOLDOWN = 10
RETRY_AFTER = 2

pytestmark = pytest.mark.skipif(
    not os.environ.get("EGRESS_REFUSALS_FLEET"), reason="needs its own fleet: run through `cargo xtask test`"
)


class RefusingSite:
    """An index linking every page; the site's n-th request answered 403 when n % 25 == 10, 429 when n % 25 == 20."""

    def __init__(self) -> None:
        self.log: list = []  # (time the answer was sent, client address, path, status)
        self.lock = threading.Lock()
        self.count = 0
        site = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                with site.lock:
                    site.count += 1
                    n = site.count
                status, headers = 200, {}
                if n % 25 == 10:
                    status = 403
                elif n % 25 == 20:
                    status, headers = 429, {"Retry-After": str(RETRY_AFTER)}
                if self.path == "/" and status == 200:
                    body = "".join(f'<a href="/page/{i}">{i}</a>' for i in range(PAGES))
                else:
                    body = f"<p>{self.path}</p>" if status == 200 else "no"
                answer(self, status, headers, body)
                with site.lock:
                    site.log.append((time.monotonic(), self.client_address[0], self.path, status))

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_crawl_of_a_site_refusing_8_percent_reports_every_refusal_and_never_sends_through_a_refused_proxy() -> None:
    site = RefusingSite()
    before = {name: outcome(name) for name in ("ok", "banned", "throttled")}
    started = time.monotonic()
    result = crawl(
        site.url,
        {"EGRESS_LEASE_TTL": 6, "DOWNLOAD_DELAY": 0.2, "EGRESS_REPORT_EVERY": 20, "EGRESS_MAX_RETRIES": 10},
        timeout=600,
    )
    took = time.monotonic() - started
    site.server.shutdown()
    reported = {name: outcome(name) - value for name, value in before.items()}
    log = sorted(site.log)
    pages = {page["url"] for page in result["pages"] if page["status"] == 200}
    served = sum(1 for entry in log if entry[3] == 200)
    refusals = [entry for entry in log if entry[3] in (403, 429)]
    # A request reaching the site through a proxy inside a cooldown the site gave it: after a 403 was sent, for
    # the first-ban cooldown; after a 429, for its Retry-After.
    inside = [
        later
        for refusal in refusals
        for later in log
        if later[1] == refusal[1]
        and refusal[0] < later[0] < refusal[0] + (BASE_COOLDOWN if refusal[3] == 403 else RETRY_AFTER)
    ]
    stats = result["stats"]
    print(
        f"scrapy refusals: {len(pages)} pages in {took:.1f} s, {len(log)} requests, "
        f"{sum(1 for e in refusals if e[3] == 403)} answered 403 and {sum(1 for e in refusals if e[3] == 429)} 429, "
        f"reported {reported['banned']:.0f} banned and {reported['throttled']:.0f} throttled, "
        f"{reported['ok']:.0f} of {served} served reported ({100 * reported['ok'] / max(1, served):.1f} %), "
        f"{stats.get('egress/leases', 0)} leases ({stats.get('egress/leases_returned', 0)} given back), "
        f"{stats.get('egress/answered_after_drop', 0)} answers on dropped leases, "
        f"through a refused proxy {len(inside)}"
    )
    assert len(pages) == PAGES + 1, f"{len(pages)} pages; stats {stats}"
    assert not inside, f"{len(inside)} requests through a proxy inside its cooldown: {inside[:5]}"
    assert reported["banned"] == sum(1 for e in refusals if e[3] == 403), (reported, len(refusals))
    assert reported["throttled"] == sum(1 for e in refusals if e[3] == 429), (reported, len(refusals))
    assert reported["ok"] >= 0.98 * served, f"{reported['ok']} of {served} served requests reported"
    assert reported["ok"] <= served, f"{reported['ok']} reported served, the site served {served}"
