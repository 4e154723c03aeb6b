"""Scrapy integration: every request leaves through a proxy leased from egress-operator, bound just before it is sent.

Settings (only `EGRESS_URL` is required)::

    ADDONS = {"egress_client.scrapy.EgressAddon": 100}   # the middleware and the download handler below
    EGRESS_URL = "http://egress-discovery.egress-system:8090"
    EGRESS_TOKEN = "..."
    EGRESS_SELECTOR = "region=eu"          # optional label selector
    EGRESS_POOL = "eu"                     # optional: only members of this ProxyPool (name or namespace/name)
    EGRESS_BAN_CODES = [403]               # reported `banned`: the proxy cools down for the site, a new one is leased
    EGRESS_THROTTLE_CODES = [429]          # reported `throttled` with the answer's Retry-After
    EGRESS_SESSION_META = "egress_session" # request.meta key: one lease per (site, session)

Two parts work together. `EgressDownloadHandler` wraps Scrapy's HTTP(S) download handler (or the one named in
`EGRESS_DOWNLOAD_HANDLERS`) and binds each request to a lease when the download slot lets it go, not before: a
request that waited out `DOWNLOAD_DELAY` in the slot's queue behind a ban leaves through the site's new lease, never
through the refused proxy, and the slot stays Scrapy's own (the host), so `DOWNLOAD_DELAY` and
`CONCURRENT_REQUESTS_PER_DOMAIN` apply per site as without proxies; requests that queued behind a wait for a lease
leave the slot's delay apart when it ends, not together. `EgressProxyMiddleware` (downloader middleware,
700) reads the answers: served and failed requests are reported in batches (`EGRESS_REPORT_EVERY`, default 20); a
ban or throttle code is reported, its lease dropped, and the request scheduled again on a new lease (`dont_filter`, at
most `EGRESS_MAX_RETRIES` times, default 5). `ban(response)` reports a block page that came back 200 from a spider
callback. The add-on `EgressAddon` configures both.

One lease is kept per (site, session), the site as the server names it (the registrable domain: `www.shop.example`
and `img.shop.example` share one lease, as they share cooldowns), and reused until it nears its expiry (then it is
renewed; a renew that says the proxy's instance was replaced switches to the new URL). When no proxy can be leased
now (503 with Retry-After) the request waits that long, without blocking the reactor, instead of failing (at most
`EGRESS_MAX_WAIT` seconds in all, default 600); once the spider starts closing (`CLOSESPIDER_TIMEOUT`, a signal,
`engine.close_spider`) a waiting request is dropped within half a second (`IgnoreRequest`, counted in
`egress/dropped_closing`), so the crawl can close. Exceptions are reported as `failed`. Every lease is reported and
released when the spider closes. Needs Scrapy 2.14 or newer on its (default) asyncio reactor.

Through the gateway instead (one proxy URL for the fleet, docs/gateway.md), Scrapy needs no add-on for plain
`http://` crawls: `meta["proxy"]` set to the gateway URL is all. For `https://` the site's answer is inside the
tunnel, where only Scrapy sees it: `EgressGatewayMiddleware` sets `meta["proxy"]` per session and reports the
refusals it sees to the gateway (see the class).
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import inspect
import urllib.parse
import weakref
from typing import Any, Dict, Optional, Set, Tuple

from scrapy import Request, signals
from scrapy.exceptions import IgnoreRequest, NotConfigured
from scrapy.http import Response
from scrapy.utils.misc import build_from_crawler, load_object

from ._client import AsyncDiscoveryClient, AsyncLease
from ._errors import DiscoveryError, Gone, NotFound, Unavailable
from .gateway import GatewayError, areport_to_gateway, gateway_proxy_url

#: The request.meta key holding the ID of the lease a request went through.
LEASE_META = "egress_lease"
#: The request.meta key holding the proxy (`namespace/name`) a request went through.
PROXY_META = "egress_proxy"
#: The request.meta key counting the middleware's own reschedules of a request.
RETRIES_META = "egress_retries"
#: The middleware's import path, as `DOWNLOADER_MIDDLEWARES` names it.
MIDDLEWARE = "egress_client.scrapy.EgressProxyMiddleware"
#: The gateway middleware's import path, as `DOWNLOADER_MIDDLEWARES` names it.
GATEWAY_MIDDLEWARE = "egress_client.scrapy.EgressGatewayMiddleware"
#: The download handler's import path, as `DOWNLOAD_HANDLERS` names it.
HANDLER = "egress_client.scrapy.EgressDownloadHandler"

_Key = Tuple[str, Optional[str]]
#: How long a refusal waits for its report at most, before leases through its exit are taken again.
_REPORT_GRACE = 10.0

#: How long binding a request to its lease may take before the request counts as held up (`_pace`): a lease or
#: a renew over the network takes milliseconds; a wait for a proxy or behind another request's lease, longer.
_HELD = 0.05

#: The middleware of each running crawler, for its download handler and `ban()` to find.
_MIDDLEWARES: "weakref.WeakKeyDictionary[Any, EgressProxyMiddleware]" = weakref.WeakKeyDictionary()


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
        unbound = [scheme for scheme in ("http", "https") if not _ours(settings, scheme)]
        if unbound:
            # Without the handler no request would get a proxy: it would leave from the crawler's own address.
            raise ValueError(
                f"{MIDDLEWARE} needs {HANDLER} as the download handler for {' and '.join(unbound)}, which binds each "
                f"request to a lease just before it is sent: add ADDONS = {{\"egress_client.scrapy.EgressAddon\": "
                f"100}} to the settings (it sets both), or set DOWNLOAD_HANDLERS for http and https to {HANDLER} "
                f"(with EGRESS_DOWNLOAD_HANDLERS naming the handlers it should wrap, if not Scrapy's own)"
            )
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
        #: (site, exit) -> loop time until which a lease through that exit is given back at once: a refusal this crawl
        #: answered, until its report is in (a lease granted meanwhile may still be on the refused proxy).
        self.refused: Dict[Tuple[str, str], float] = {}
        #: Download slot key -> loop time its latest request left (or will leave) the download handler: see `_pace`.
        self.paced: Dict[str, float] = {}
        #: Reports started from `ban()` (a spider callback cannot wait for them): awaited when the spider closes.
        self.pending: Set["asyncio.Task[Any]"] = set()

    @classmethod
    def from_crawler(cls, crawler: Any) -> "EgressProxyMiddleware":
        middleware = cls(crawler, crawler.settings)
        crawler.signals.connect(middleware.spider_closed, signal=signals.spider_closed)
        _MIDDLEWARES[crawler] = middleware
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
                    replaced = await held.lease.renew(self.ttl)
                    if replaced:
                        self.stats.inc_value("egress/replaced")
                except (NotFound, Gone):
                    if self.held.get(key) is held:
                        self._forget(key)
                    held = None
                if held is not None and self.held.get(key) is not held:
                    # Dropped while it renewed (the site refused its proxy meanwhile): a new lease, not this one.
                    held = None
                elif held is not None:
                    # A renew answers a new ID for the same lease: requests sent from now on carry it, and their
                    # answers must still find the lease (requests in flight carry the earlier IDs, which stay mapped).
                    self.by_id[held.lease.id] = key
            if held is not None:
                return held
            waited = 0.0
            refusals = 0
            while True:
                if self._closing():
                    self.stats.inc_value("egress/dropped_closing")
                    raise IgnoreRequest("the spider is closing: no new lease is taken")
                try:
                    lease = await self.client.lease(
                        url, selector=self.selector, ttl=self.ttl, session=key[1], pool=self.pool
                    )
                except Unavailable as refused:
                    wait = refused.retry_after if refused.retry_after is not None else 5.0
                    if waited + wait > self.max_wait:
                        raise
                    self.stats.inc_value(f"egress/waits/{refused.reason or 'unavailable'}")
                    await self._wait_unless_closing(wait)
                    waited += wait
                    continue
                if refusals < 3 and self._refused_exit(lease.target, lease):
                    # Granted while this crawl's report of the site's refusal of that proxy was still on its way:
                    # given back, and asked again once the server knows.
                    refusals += 1
                    self.stats.inc_value("egress/leases_returned")
                    await lease.release()
                    await asyncio.sleep(0.05 * refusals)
                    continue
                break
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

    def _refused_exit(self, site: str, lease: AsyncLease) -> bool:
        """Whether this crawl saw `site` refuse the proxy of `lease` (or its egress address), in a cooldown the
        server may not have recorded yet."""
        now = asyncio.get_running_loop().time()
        self.refused = {exit: until for exit, until in self.refused.items() if until > now}
        return any(exit in self.refused for exit in _exits(site, lease))

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

    def _owns(self, request: Request) -> bool:
        """Whether `request` went through a lease this middleware holds or dropped."""
        lease_id = request.meta.get(LEASE_META, "")
        return lease_id in self.by_id or lease_id in self.dropped

    def _held_of(self, request: Request) -> Optional[Tuple[_Key, _Held]]:
        key = self.by_id.get(request.meta.get(LEASE_META, ""))
        held = self.held.get(key) if key is not None else None
        return (key, held) if key is not None and held is not None else None

    async def bind(self, request: Request) -> None:
        """Sends `request` through the lease of its (site, session), taken now if there is none (waiting while no
        proxy can be leased): called by the download handler just before the request leaves. Sets `meta["proxy"]`
        (without credentials), the `Proxy-Authorization` header the proxy's credentials make (or none), and the
        lease's ID and proxy in `meta`; a `meta["egress_skip"]` request is left as it is."""
        if request.meta.get("egress_skip"):
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        held = await self._lease_for(self._key(request), request.url)
        if await self._pace(request, loop.time() - started > _HELD):
            # While the request waited its turn the site may have refused that lease's proxy (the lease is dropped
            # then): the request takes the lease of its (site, session) as it is now.
            held = await self._lease_for(self._key(request), request.url)
        proxy, authorization = _split_credentials(held.lease.proxy_url)
        request.meta["proxy"] = proxy
        # HttpProxyMiddleware's record of which proxy the header belongs to: a retry of this request keeps both.
        request.meta["_auth_proxy"] = proxy
        if authorization is not None:
            request.headers[b"Proxy-Authorization"] = authorization
        else:
            request.headers.pop(b"Proxy-Authorization", None)
        request.meta[LEASE_META] = held.lease.id
        request.meta[PROXY_META] = held.lease.proxy

    async def _pace(self, request: Request, held_up: bool) -> bool:
        """Keeps the download slot's delay between requests that a wait for a lease held up: Scrapy spaced them
        when they left its queue, but those that queued behind one wait (for a proxy, or another request's lease)
        would all leave together once it ends. A request that was held up, or that comes while held-up ones still
        wait their turn, leaves the slot's delay after the slot's latest request. Returns whether it waited (its
        lease may have changed meanwhile)."""
        slot_key, slot = self._download_slot(request)
        if slot is None:
            return False
        loop = asyncio.get_running_loop()
        now = loop.time()
        if len(self.paced) > 1000:
            # Slots of hosts no longer crawled (Scrapy drops its idle slots too).
            self.paced = {key: when for key, when in self.paced.items() if when > now - 60}
        last = self.paced.get(slot_key)
        if last is None or not (held_up or last > now):
            self.paced[slot_key] = now
            return False
        # Behind the held-up requests still waiting their turn too: the slot's other requests count against its
        # concurrency while they wait here, so Scrapy lets no more in than that and the queue stays that short.
        at = max(now, last + slot.download_delay())
        # Taken before sleeping: requests released together line up behind one another.
        self.paced[slot_key] = at
        if at <= now:
            return False
        self.stats.inc_value("egress/paced")
        await self._wait_unless_closing(at - now)
        return True

    def _download_slot(self, request: Request) -> Tuple[str, Any]:
        """The downloader's slot `request` goes through (by its key), or `None` when it has none or no delay."""
        downloader: Any = getattr(getattr(self.crawler, "engine", None), "downloader", None)
        get_slot_key = getattr(downloader, "get_slot_key", None)
        if downloader is None or get_slot_key is None:
            return "", None
        key = get_slot_key(request)
        slot = downloader.slots.get(key)
        if slot is None or not getattr(slot, "delay", 0):
            return key, None
        return key, slot

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
        meta = {k: v for k, v in request.meta.items() if k not in ("proxy", "_auth_proxy", LEASE_META, PROXY_META)}
        meta[RETRIES_META] = retries + 1
        return request.replace(meta=meta, dont_filter=True)

    async def process_response(self, request: Request, response: Response, spider: Any = None) -> Any:
        if LEASE_META not in request.meta:
            return response
        if response.status in self.ban_codes or response.status in self.throttle_codes:
            if response.status in self.ban_codes:
                await self._refused(request, "banned", response.status)
            else:
                await self._refused(request, "throttled", response.status, _retry_after(response))
            again = self._again(request)
            return again if again is not None else response
        found = self._held_of(request)
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

    async def _refused(
        self, request: Request, outcome: str, status: Optional[int], retry_after: Optional[float] = None
    ) -> None:
        """The site refused the proxy `request` went through: its lease is done. The refusal is reported on it (on
        a lease dropped while the request was in flight too: the server counts one client's repeated reports on a
        running cooldown once), and the middleware's other leases for the site through the same exit dropped."""
        found = self._held_of(request)
        extra: Dict[str, Any] = {"retry_after": retry_after} if outcome == "throttled" else {}
        self.stats.inc_value("egress/bans" if outcome == "banned" else "egress/throttles")
        if found is None:
            held = self.dropped.get(request.meta.get(LEASE_META, ""))
            if held is not None:
                self.stats.inc_value("egress/answered_after_drop")
                await self._flush(held, outcome=outcome, status_code=status, **extra)
            return
        key, held = found
        self._forget(key, in_flight=True)
        exits = _exits(key[0], held.lease)
        loop = asyncio.get_running_loop()
        for exit in exits:
            self.refused[exit] = max(self.refused.get(exit, 0.0), loop.time() + _REPORT_GRACE)
        await self._flush(held, outcome=outcome, status_code=status, release=True, **extra)
        # The report is in (or failed): from now on the server refuses leases through the exit itself.
        for exit in exits:
            self.refused.pop(exit, None)
        # Other sessions' leases on the same proxy for the same site are refused too: the site refused the proxy
        # (or its address, which other proxies may share), not the session. They are released, and their sessions
        # lease anew.
        refused = set(exits)
        for other in [k for k, h in self.held.items() if k[0] == key[0] and refused & set(_exits(k[0], h.lease))]:
            sibling = self._forget(other, in_flight=True)
            if sibling is not None:
                await self._flush(sibling, release=True)

    def ban(self, response: Response, outcome: str = "banned", retry_after: Optional[float] = None) -> Optional[Request]:
        """See the module function `ban`."""
        if outcome not in ("banned", "throttled"):
            raise ValueError(f"outcome must be 'banned' or 'throttled', not {outcome!r}")
        if retry_after is not None and outcome != "throttled":
            raise ValueError("retry_after goes only with outcome 'throttled'")
        request = response.request
        if request is None or LEASE_META not in request.meta:
            raise ValueError(f"{response.url} did not come through an egress-operator lease: nothing to report")
        # Counted as served when it came in; taken back unless a batch has reported it already.
        found = self._held_of(request)
        held = found[1] if found is not None else self.dropped.get(request.meta[LEASE_META])
        if held is not None and held.ok > 0:
            held.ok -= 1
        task = asyncio.ensure_future(self._refused(request, outcome, response.status, retry_after))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)
        return self._again(request)

    async def process_exception(self, request: Request, exception: BaseException, spider: Any = None) -> None:
        found = self._held_of(request)
        held = found[1] if found is not None else self.dropped.get(request.meta.get(LEASE_META, ""))
        if held is not None:
            held.failed += 1
            self.stats.inc_value("egress/failed")
        return None

    async def spider_closed(self, spider: Any = None) -> None:
        if self.pending:
            await asyncio.gather(*self.pending, return_exceptions=True)
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


def _exits(site: str, lease: AsyncLease) -> Tuple[Tuple[str, str], ...]:
    """The (site, exit) pairs a site's refusal of `lease` covers: its proxy, and its egress address if known (the
    site sees every proxy behind one address as the same client, and the server cools them down together)."""
    exits: Tuple[Tuple[str, str], ...] = ((site, "proxy:" + lease.proxy),)
    if lease.egress_ip is not None:
        exits += ((site, "address:" + lease.egress_ip),)
    return exits


def _retry_after(response: Response) -> Optional[float]:
    value = response.headers.get(b"Retry-After")
    if not value:
        return None
    try:
        return max(1.0, float(value.decode("latin-1").strip()))
    except ValueError:
        return None


def _split_credentials(proxy_url: str) -> Tuple[str, Optional[bytes]]:
    """The proxy URL without its user and password, and the `Proxy-Authorization` value they make (or `None`)."""
    parts = urllib.parse.urlsplit(proxy_url)
    if parts.username is None:
        return proxy_url, None
    user = urllib.parse.unquote(parts.username)
    password = urllib.parse.unquote(parts.password or "")
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    bare = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return bare, b"Basic " + base64.b64encode(f"{user}:{password}".encode())


def _ours(settings: Any, scheme: str) -> bool:
    """Whether `scheme`'s download handler in `settings` is `EgressDownloadHandler` (or a subclass)."""
    path = settings.getwithbase("DOWNLOAD_HANDLERS").get(scheme)
    if path is None:
        return False
    try:
        handler = load_object(path)
    except (ImportError, NameError, ValueError, AttributeError):
        return False
    return isinstance(handler, type) and issubclass(handler, EgressDownloadHandler)


def ban(response: Response, outcome: str = "banned", retry_after: Optional[float] = None) -> Optional[Request]:
    """Reports from a spider callback that `response` is a refusal the status code did not show (a block page or a
    CAPTCHA answered 200): `banned` (or `throttled`, with the site's `retry_after` in seconds) on the lease it came
    through, which is dropped as for a ban code. The response stops counting as served (unless a batch reported it
    already). Returns the request to schedule again on a new lease (yield it), or `None` once it was retried
    `EGRESS_MAX_RETRIES` times::

        def parse(self, response):
            if response.css("form#captcha"):
                yield from filter(None, [ban(response)])
                return
    """
    request = response.request
    for middleware in list(_MIDDLEWARES.values()):
        if request is not None and middleware._owns(request):
            return middleware.ban(response, outcome, retry_after)
    raise ValueError(f"{response.url} did not come through an egress-operator lease of a running crawl")


class EgressDownloadHandler:
    """Wraps the download handler of a scheme (`EGRESS_DOWNLOAD_HANDLERS[scheme]`, default Scrapy's own in
    `DOWNLOAD_HANDLERS_BASE`) and binds each request to its lease just before handing it over."""

    lazy = False

    def __init__(self, crawler: Any):
        self.crawler = crawler
        self.inner: Dict[str, Any] = {}

    @classmethod
    def from_crawler(cls, crawler: Any) -> "EgressDownloadHandler":
        return cls(crawler)

    def _inner(self, scheme: str) -> Any:
        handler = self.inner.get(scheme)
        if handler is None:
            settings = self.crawler.settings
            path = settings.getdict("EGRESS_DOWNLOAD_HANDLERS").get(scheme) or settings.getdict(
                "DOWNLOAD_HANDLERS_BASE"
            ).get(scheme)
            if path is None:
                raise NotConfigured(f"no download handler for {scheme!r} to send through a proxy")
            cls = load_object(path)
            if isinstance(cls, type) and issubclass(cls, EgressDownloadHandler):
                raise NotConfigured(f"EGRESS_DOWNLOAD_HANDLERS[{scheme!r}] names {HANDLER} itself")
            handler = build_from_crawler(cls, self.crawler)
            self.inner[scheme] = handler
        return handler

    async def download_request(self, request: Request, spider: Any = None) -> Response:
        middleware = _MIDDLEWARES.get(self.crawler)
        if middleware is None:
            raise NotConfigured(f"{HANDLER} sends only through {MIDDLEWARE}, which is not enabled")
        await middleware.bind(request)
        inner = self._inner(urllib.parse.urlsplit(request.url).scheme)
        if inspect.iscoroutinefunction(inner.download_request):
            response: Response = await inner.download_request(request)
            return response
        # A handler of the older, Deferred-based kind.
        from scrapy.utils.defer import maybe_deferred_to_future

        return await maybe_deferred_to_future(inner.download_request(request, self.crawler.spider))

    async def close(self) -> None:
        for handler in self.inner.values():
            closing = getattr(handler, "close", None)
            if closing is None:
                continue
            result = closing()
            if inspect.isawaitable(result):
                await result
            elif result is not None:
                from scrapy.utils.defer import maybe_deferred_to_future

                await maybe_deferred_to_future(result)


class EgressAddon:
    """The Scrapy add-on (`ADDONS = {"egress_client.scrapy.EgressAddon": 100}`): enables `EgressProxyMiddleware` at
    700 and puts `EgressDownloadHandler` in front of the http and https download handlers configured so far (kept
    in `EGRESS_DOWNLOAD_HANDLERS`, which it wraps)."""

    def update_settings(self, settings: Any) -> None:
        settings.setdefault_in_component_priority_dict("DOWNLOADER_MIDDLEWARES", load_object(MIDDLEWARE), 700)
        configured = settings.getwithbase("DOWNLOAD_HANDLERS")
        wrapped = dict(settings.getdict("EGRESS_DOWNLOAD_HANDLERS"))
        handlers = dict(settings.getdict("DOWNLOAD_HANDLERS"))
        for scheme in ("http", "https"):
            current = configured.get(scheme)
            if current is not None and not _ours(settings, scheme):
                wrapped.setdefault(scheme, current)
            handlers[scheme] = HANDLER
        priority = max(settings.getpriority("DOWNLOAD_HANDLERS") or 0, 15)
        settings.set("DOWNLOAD_HANDLERS", handlers, priority)
        settings.set("EGRESS_DOWNLOAD_HANDLERS", wrapped, max(settings.getpriority("EGRESS_DOWNLOAD_HANDLERS") or 0, 15))


class EgressGatewayMiddleware:
    """Scrapy through the egress gateway. Settings::

        DOWNLOADER_MIDDLEWARES = {"egress_client.scrapy.EgressGatewayMiddleware": 600}
        EGRESS_GATEWAY = "http://egress-gateway.egress-system:8088"
        EGRESS_TOKEN = "..."                     # a discovery token that may lease: the proxy password
        EGRESS_GATEWAY_OPTIONS = {"pool": "eu"}  # optional: gateway_proxy_url's keywords (pool, zone, labels, ...)
        EGRESS_SESSION_META = "egress_session"   # request.meta key: the gateway session of a request
        EGRESS_BAN_CODES = [401, 403]            # reported `banned`
        EGRESS_THROTTLE_CODES = [429]            # reported `throttled` with the answer's Retry-After
        EGRESS_MAX_RETRIES = 5                   # reschedules of one request after refusals

    Each request without a `proxy` of its own leaves through the gateway, in the session its meta names (without
    one, each request rotates). A refusal of an `https://` request in a session is reported to the gateway
    (`POST /report`): the proxy cools down for the site, the gateway closes the session's tunnels through it, and
    the request is scheduled again (`dont_filter`), to go through another proxy. Plain `http://` refusals are the
    gateway's own to report and retry; their answers pass through. Runs before `RetryMiddleware` (550), so a 429 is
    reported rather than retried through the same tunnel."""

    def __init__(self, crawler: Any, settings: Any):
        gateway = settings.get("EGRESS_GATEWAY")
        if not gateway:
            raise NotConfigured("EGRESS_GATEWAY is not set: the egress gateway's http://host:port")
        token = settings.get("EGRESS_TOKEN")
        if not token:
            raise ValueError("EGRESS_TOKEN is not set: the gateway takes a discovery token as the proxy password")
        self.gateway, self.token = gateway, token
        self.options: Dict[str, Any] = dict(settings.getdict("EGRESS_GATEWAY_OPTIONS"))
        # Checked now: a bad option is a configuration error, not a 400 per request.
        gateway_proxy_url(gateway, token, **self.options)
        self.stats = crawler.stats
        self.session_meta: str = settings.get("EGRESS_SESSION_META", "egress_session")
        self.ban_codes = {int(code) for code in settings.getlist("EGRESS_BAN_CODES", [401, 403])}
        self.throttle_codes = {int(code) for code in settings.getlist("EGRESS_THROTTLE_CODES", [429])}
        self.max_retries = settings.getint("EGRESS_MAX_RETRIES", 5)
        self.urls: Dict[Optional[str], str] = {}

    @classmethod
    def from_crawler(cls, crawler: Any) -> "EgressGatewayMiddleware":
        return cls(crawler, crawler.settings)

    def _url(self, session: Optional[str]) -> str:
        url = self.urls.get(session)
        if url is None:
            url = self.urls[session] = gateway_proxy_url(self.gateway, self.token, session=session, **self.options)
        return url

    def process_request(self, request: Request, spider: Any = None) -> None:
        if "proxy" not in request.meta:
            session = request.meta.get(self.session_meta)
            request.meta["proxy"] = self._url(None if session is None else str(session))

    async def process_response(self, request: Request, response: Response, spider: Any = None) -> Any:
        refused = response.status in self.ban_codes or response.status in self.throttle_codes
        session = request.meta.get(self.session_meta)
        if not refused or session is None or urllib.parse.urlsplit(request.url).scheme != "https":
            return response
        outcome = "banned" if response.status in self.ban_codes else "throttled"
        try:
            await areport_to_gateway(self._url(str(session)), request.url, outcome, retry_after=_retry_after(response))
            self.stats.inc_value(f"egress_gateway/reported/{outcome}")
        except GatewayError as error:
            # Unreported, the proxy does not cool down: the request is still tried again, on whichever proxy.
            self.stats.inc_value("egress_gateway/report_failed")
            spider_logger = getattr(spider, "logger", None)
            if spider_logger is not None:
                spider_logger.warning("reporting a refusal to the gateway failed: %s", error)
        retries = int(request.meta.get(RETRIES_META, 0))
        if retries >= self.max_retries:
            self.stats.inc_value("egress_gateway/retries_exhausted")
            return response
        self.stats.inc_value("egress_gateway/retries")
        return request.replace(meta={**request.meta, RETRIES_META: retries + 1}, dont_filter=True)
