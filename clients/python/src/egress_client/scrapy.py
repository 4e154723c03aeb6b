"""A Scrapy downloader middleware that sends every request through a proxy leased from egress-operator.

Settings (only `EGRESS_URL` is required)::

    DOWNLOADER_MIDDLEWARES = {"egress_client.scrapy.EgressProxyMiddleware": 700}  # before HttpProxyMiddleware (750)
    EGRESS_URL = "http://egress-discovery.egress-system:8090"
    EGRESS_TOKEN = "..."
    EGRESS_SELECTOR = "region=eu"          # optional label selector
    EGRESS_POOL = "eu"                     # optional: only members of this ProxyPool (name or namespace/name)
    EGRESS_BAN_CODES = [403]               # reported `banned`: the proxy cools down for the site, a new one is leased
    EGRESS_THROTTLE_CODES = [429]          # reported `throttled` with the answer's Retry-After
    EGRESS_SESSION_META = "egress_session" # request.meta key: one lease per (site, session)

One lease is kept per (site, session), the site as the server names it (the registrable domain: `www.shop.example`
and `img.shop.example` share one lease, as they share cooldowns), and reused for every request to that site until
it nears its expiry (then it is renewed; a renew that says the proxy's instance was replaced switches to the new
URL) or the site bans or throttles it. `meta['download_slot']` is the proxy, so Scrapy's per-slot concurrency caps the load on each proxy.
Served requests are reported in batches (`EGRESS_REPORT_EVERY`, default 20). On a ban or throttle the request is
scheduled again on a new lease (`dont_filter`, at most `EGRESS_MAX_RETRIES` times, default 5). When no proxy can
be leased now (503 with Retry-After) the request waits that long, without blocking the reactor, instead of failing
(at most `EGRESS_MAX_WAIT` seconds in all, default 600); once the spider starts closing (`CLOSESPIDER_TIMEOUT`, a
signal, `engine.close_spider`) a waiting request is dropped within half a second (`IgnoreRequest`, counted in
`egress/dropped_closing`), so the crawl can close. Exceptions are reported as `failed`. Every lease is reported and
released when the spider closes. Needs Scrapy 2.13 or newer on its (default) asyncio reactor.
"""

from __future__ import annotations

import asyncio
import datetime
import urllib.parse
from typing import Any, Dict, Optional, Tuple

from scrapy import Request, signals
from scrapy.exceptions import IgnoreRequest, NotConfigured
from scrapy.http import Response

from ._client import AsyncDiscoveryClient, AsyncLease
from ._errors import DiscoveryError, Gone, NotFound, Unavailable

#: The request.meta key holding the ID of the lease a request went through.
LEASE_META = "egress_lease"
#: The request.meta key counting the middleware's own reschedules of a request.
RETRIES_META = "egress_retries"

_Key = Tuple[str, Optional[str]]


class _Held:
    """A lease in use for one (site, session), with what it has not reported yet."""

    def __init__(self, lease: AsyncLease):
        self.lease = lease
        self.ok = 0
        self.failed = 0


class EgressProxyMiddleware:
    """See the module's documentation."""

    def __init__(self, crawler: Any, settings: Any):
        url = settings.get("EGRESS_URL")
        if not url:
            raise NotConfigured("EGRESS_URL is not set: the egress-operator discovery API's URL")
        self.crawler = crawler
        self.stats = crawler.stats
        self.client = AsyncDiscoveryClient(url, settings.get("EGRESS_TOKEN"))
        self.selector: Optional[str] = settings.get("EGRESS_SELECTOR")
        self.pool: Optional[str] = settings.get("EGRESS_POOL") or None
        self.ban_codes = {int(code) for code in settings.getlist("EGRESS_BAN_CODES", [403])}
        self.throttle_codes = {int(code) for code in settings.getlist("EGRESS_THROTTLE_CODES", [429])}
        self.session_meta: str = settings.get("EGRESS_SESSION_META", "egress_session")
        self.report_every = max(1, settings.getint("EGRESS_REPORT_EVERY", 20))
        self.max_retries = settings.getint("EGRESS_MAX_RETRIES", 5)
        self.max_wait = settings.getfloat("EGRESS_MAX_WAIT", 600.0)
        self.ttl = settings.getint("EGRESS_LEASE_TTL", 300)
        if not 1 <= self.ttl <= 3600:
            raise ValueError(f"EGRESS_LEASE_TTL must be from 1 to 3600 seconds, not {self.ttl}")
        self.held: Dict[_Key, _Held] = {}
        self.by_id: Dict[str, _Key] = {}
        #: Leases dropped (after a ban or throttle) while requests were still in flight on them, by each of their
        #: IDs: what those requests answer is still counted and reported on the dropped lease (the server counts a
        #: report on an ended lease against its proxy until the lease would have expired).
        self.dropped: Dict[str, _Held] = {}
        self.locks: Dict[_Key, asyncio.Lock] = {}
        #: Host name -> the site the server says it belongs to (its registrable domain, or the host itself in the
        #: operator's exact-host mode), learned from the first lease for the host: `www.shop.example` and
        #: `img.shop.example` share one lease, as they share the server's cooldowns.
        self.sites: Dict[str, str] = {}

    @classmethod
    def from_crawler(cls, crawler: Any) -> "EgressProxyMiddleware":
        middleware = cls(crawler, crawler.settings)
        crawler.signals.connect(middleware.spider_closed, signal=signals.spider_closed)
        return middleware

    def _key(self, request: Request) -> _Key:
        host = urllib.parse.urlsplit(request.url).hostname or ""
        session = request.meta.get(self.session_meta)
        return (self._site_of(host), str(session) if session is not None else None)

    def _site_of(self, host: str) -> str:
        """The site `host` belongs to, as far as the server has said: learned for this host, or a site the server
        named for another host that this one is a subdomain of (a registrable domain's subdomains share it)."""
        site = self.sites.get(host)
        if site is None:
            named = set(self.sites.values())
            parts = host.split(".")
            site = next((".".join(parts[i:]) for i in range(1, len(parts)) if ".".join(parts[i:]) in named), host)
        return site

    async def _lease_for(self, key: _Key, url: str) -> _Held:
        lock = self.locks.setdefault(key, asyncio.Lock())
        async with lock:
            held = self.held.get(key)
            now = datetime.datetime.now(datetime.timezone.utc)
            if held is not None and (held.lease.expires_at - now).total_seconds() < self.ttl / 3:
                try:
                    if await held.lease.renew(self.ttl):
                        self.stats.inc_value("egress/replaced")
                    # A renew answers a new ID for the same lease: requests sent from now on carry it, and their
                    # answers must still find the lease (requests in flight carry the earlier IDs, which stay mapped).
                    self.by_id[held.lease.id] = key
                except (NotFound, Gone):
                    self._forget(key)
                    held = None
            if held is not None:
                return held
            waited = 0.0
            while True:
                if self._closing():
                    self.stats.inc_value("egress/dropped_closing")
                    raise IgnoreRequest("the spider is closing: no new lease is taken")
                try:
                    lease = await self.client.lease(
                        url, selector=self.selector, ttl=self.ttl, session=key[1], pool=self.pool
                    )
                    break
                except Unavailable as refused:
                    wait = refused.retry_after if refused.retry_after is not None else 5.0
                    if waited + wait > self.max_wait:
                        raise
                    self.stats.inc_value(f"egress/waits/{refused.reason or 'unavailable'}")
                    await self._wait_unless_closing(wait)
                    waited += wait
            self.stats.inc_value("egress/leases")
            site = lease.target
            if site != key[0]:
                # The host belongs to a site the server names otherwise: keep the lease under the site, and use the
                # one already held there, if any, instead of a second.
                self.sites[key[0]] = site
                key = (site, key[1])
                if key in self.held:
                    await lease.release()
                    return self.held[key]
            held = _Held(lease)
            self.held[key] = held
            self.by_id[lease.id] = key
            return held

    def _closing(self) -> bool:
        """Whether the engine has started closing the spider: it waits for every request in progress, ours too."""
        engine = getattr(self.crawler, "engine", None)
        if engine is None:
            return False
        slot = getattr(engine, "_slot", None)
        return getattr(slot, "closing", None) is not None or getattr(engine, "running", True) is False

    async def _wait_unless_closing(self, seconds: float) -> None:
        """Sleeps `seconds`, looking every half second whether the spider is closing; then drops the request."""
        loop = asyncio.get_running_loop()
        until = loop.time() + seconds
        while True:
            if self._closing():
                self.stats.inc_value("egress/dropped_closing")
                raise IgnoreRequest("the spider is closing: no proxy is waited for any more")
            left = until - loop.time()
            if left <= 0:
                return
            await asyncio.sleep(min(0.5, left))

    def _forget(self, key: _Key, in_flight: bool = False) -> Optional[_Held]:
        """Stops using the lease of `key`; with `in_flight`, keeps counting what requests already sent on it answer."""
        held = self.held.pop(key, None)
        if held is not None:
            if in_flight:
                now = datetime.datetime.now(datetime.timezone.utc)
                self.dropped = {i: h for i, h in self.dropped.items() if h.lease.expires_at > now}
                self.dropped.update({i: held for i, k in self.by_id.items() if k == key})
            self.by_id = {lease_id: k for lease_id, k in self.by_id.items() if k != key}
        return held

    def _held_of(self, request: Request) -> Optional[Tuple[_Key, _Held]]:
        key = self.by_id.get(request.meta.get(LEASE_META, ""))
        held = self.held.get(key) if key is not None else None
        return (key, held) if key is not None and held is not None else None

    async def process_request(self, request: Request, spider: Any = None) -> None:
        if request.meta.get("egress_skip"):
            return None
        held = await self._lease_for(self._key(request), request.url)
        request.meta["proxy"] = held.lease.proxy_url
        request.meta["download_slot"] = held.lease.proxy
        request.meta[LEASE_META] = held.lease.id
        return None

    async def _flush(self, held: _Held, release: bool = False, **extra: Any) -> Optional[datetime.datetime]:
        """Reports what `held` has not reported yet (and `extra`: an outcome); with `release`, also ends it."""
        ok, failed = held.ok, held.failed
        held.ok = held.failed = 0
        try:
            if ok or failed or extra:
                return await held.lease.report(ok=ok or None, failed=failed or None, release=release, **extra)
            if release:
                await held.lease.release()
        except DiscoveryError:
            self.stats.inc_value("egress/report_errors")
        return None

    def _again(self, request: Request) -> Optional[Request]:
        retries = int(request.meta.get(RETRIES_META, 0))
        if retries >= self.max_retries:
            self.stats.inc_value("egress/retries_exhausted")
            return None
        meta = {k: v for k, v in request.meta.items() if k not in ("proxy", "download_slot", LEASE_META)}
        meta[RETRIES_META] = retries + 1
        return request.replace(meta=meta, dont_filter=True)

    async def process_response(self, request: Request, response: Response, spider: Any = None) -> Any:
        if LEASE_META not in request.meta:
            return response
        found = self._held_of(request)
        if response.status in self.ban_codes or response.status in self.throttle_codes:
            # The lease is done: the site refused this proxy. Reported once (requests already in flight on it
            # answer the same), and every such request goes again on another lease.
            if found is not None:
                key, held = found
                self._forget(key, in_flight=True)
                if response.status in self.ban_codes:
                    outcome, extra = "banned", {}
                    self.stats.inc_value("egress/bans")
                else:
                    outcome, extra = "throttled", {"retry_after": _retry_after(response)}
                    self.stats.inc_value("egress/throttles")
                await self._flush(held, outcome=outcome, status_code=response.status, release=True, **extra)
                # Other sessions' leases on the same proxy for the same site are refused too: the site refused
                # the proxy (or its address, which other proxies may share), not the session. They are released,
                # and their sessions lease anew.
                for other in [k for k, h in self.held.items() if k[0] == key[0] and _same_exit(h.lease, held.lease)]:
                    sibling = self._forget(other, in_flight=True)
                    if sibling is not None:
                        await self._flush(sibling, release=True)
            again = self._again(request)
            return again if again is not None else response
        if found is None:
            # An answer on a lease dropped while it was in flight: counted on that lease all the same.
            held = self.dropped.get(request.meta.get(LEASE_META, ""))
            if held is None:
                return response
            self.stats.inc_value("egress/answered_after_drop")
        else:
            held = found[1]
        held.ok += 1
        if held.ok + held.failed >= self.report_every:
            await self._flush(held)
        return response

    async def process_exception(self, request: Request, exception: BaseException, spider: Any = None) -> None:
        found = self._held_of(request)
        held = found[1] if found is not None else self.dropped.get(request.meta.get(LEASE_META, ""))
        if held is not None:
            held.failed += 1
            self.stats.inc_value("egress/failed")
        return None

    async def spider_closed(self, spider: Any = None) -> None:
        for key in list(self.held):
            held = self._forget(key)
            if held is None:
                continue
            await self._flush(held, release=True)
        # What answered on dropped leases since their last report (each lease once, under any of its IDs).
        for held in {id(h): h for h in self.dropped.values()}.values():
            if held.ok or held.failed:
                await self._flush(held)
        self.dropped.clear()
        await self.client.aclose()


def _same_exit(one: AsyncLease, other: AsyncLease) -> bool:
    """Whether a site sees the two leases' requests as the same client: the same proxy, or the same egress address
    (the server cools down every proxy behind an address together)."""
    return one.proxy == other.proxy or (one.egress_ip is not None and one.egress_ip == other.egress_ip)


def _retry_after(response: Response) -> Optional[float]:
    value = response.headers.get(b"Retry-After")
    if not value:
        return None
    try:
        return max(1.0, float(value.decode("latin-1").strip()))
    except ValueError:
        return None
