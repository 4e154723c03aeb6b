"""The sync and the async client, and the lease guards they hand out."""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import Any, Dict, Generator, List, Mapping, Optional, Tuple

import httpx

from ._errors import DecodeError, DiscoveryError, TransportError, error_for
from ._models import CooldownInfo, LeaseState, ProxyInfo, lease_body, parse_time, quoted, report_body, ttl_body

#: How long one call may take, unless the client is given another timeout.
DEFAULT_TIMEOUT = 10.0

#: How long a call keeps retrying while the discovery Service has no serving replica (the operator changing leader:
#: a rolling restart, a drain, a crash): refused or dropped connections and `not-serving` answers. Twice the shipped
#: Lease duration, the bound of a takeover after a leader is killed.
DEFAULT_FAILOVER_BUDGET = 30.0

_FIRST_PAUSE = 0.05
_MAX_PAUSE = 0.25


def _no_replica(error: httpx.HTTPError) -> bool:
    """The request met a Service without a serving replica: refused, or closed or reset before an answer."""
    return isinstance(error, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError))


def _not_serving(response: httpx.Response) -> bool:
    """A follower's or a handing-over leader's refusal: the next connection goes to the leader."""
    if response.status_code != 503:
        return False
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("reason") == "not-serving"


class _Retry:
    """The retry schedule of one call during a change of leader."""

    def __init__(self, budget: float):
        self._deadline = time.monotonic() + budget
        self.pause = _FIRST_PAUSE

    def next_pause(self) -> Optional[float]:
        """The pause before the next attempt, or None when the budget is spent."""
        if time.monotonic() + self.pause > self._deadline:
            return None
        pause, self.pause = self.pause, min(self.pause * 2, _MAX_PAUSE)
        return pause


def _headers(token: Optional[str]) -> Dict[str, str]:
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _check_base(base_url: str) -> str:
    if not base_url.startswith("http://") and not base_url.startswith("https://"):
        raise ValueError(f"the discovery URL must be http:// or https://, not {base_url!r}")
    return base_url.rstrip("/")


def _answer(response: httpx.Response) -> Any:
    """The JSON body of a success, or the typed error of a failure."""
    if response.status_code == 204:
        return None
    try:
        body = response.json() if response.content else {}
    except ValueError:
        body = None
    if response.is_success:
        if body is None:
            raise DecodeError(f"the answer to {response.request.url} is not JSON", status=response.status_code)
        return body
    problem: Mapping[str, Any] = body if isinstance(body, dict) else {"detail": response.text[:200]}
    raise error_for(response.status_code, problem, response.headers.get("retry-after"))


def _query(**values: Optional[str]) -> Dict[str, str]:
    return {key: value for key, value in values.items() if value}


def _cooldown_until(body: Mapping[str, Any]) -> Optional[datetime.datetime]:
    until = body.get("cooldownUntil")
    return parse_time(until) if until is not None else None


class _LeaseView:
    """What a lease says about itself, from the server's last answer: shared by the sync and async leases."""

    _state: LeaseState

    @property
    def id(self) -> str:
        """The latest ID of the lease (renewing gives a new one; earlier ones keep naming the same lease)."""
        return self._state.id

    @property
    def proxy_url(self) -> str:
        """`http://[user:password@]host:port`, for the HTTP client's proxy setting."""
        return self._state.proxy.url

    @property
    def proxy(self) -> str:
        """The proxy, `namespace/name`."""
        return self._state.proxy.id

    @property
    def egress_ip(self) -> Optional[str]:
        """The address sites see requests through the proxy come from (proxies sharing it share cooldowns)."""
        return self._state.proxy.egress_ip

    @property
    def target(self) -> str:
        """The normalised target (site)."""
        return self._state.target

    @property
    def expires_at(self) -> datetime.datetime:
        """When the lease expires unless renewed."""
        return self._state.expires_at



class Lease(_LeaseView):
    """A held lease (sync). Use it as a context manager to release it on exit, or call `release()`."""

    def __init__(self, client: "DiscoveryClient", state: LeaseState):
        self._client = client
        self._state = state
        self._released = False

    def renew(self, ttl: Optional[float] = None) -> bool:
        """Extends the lease. Returns whether the proxy's instance was replaced since this lease last heard of it:
        then `proxy_url` changed, and requests must go to the new URL from now on."""
        body = ttl_body(ttl)
        answer = self._client._call("POST", f"/v1/leases/{quoted(self.id)}/renew", body)
        self._state = LeaseState.from_json(answer)
        return bool(answer.get("replaced", False))

    def report(
        self,
        outcome: Optional[str] = None,
        *,
        status_code: Optional[int] = None,
        retry_after: Optional[float] = None,
        ok: Optional[int] = None,
        failed: Optional[int] = None,
        release: bool = False,
    ) -> Optional[datetime.datetime]:
        """Reports an outcome (`ok`, `banned`, `throttled` with the site's `retry_after`, `failed`), counts of
        requests since the last report, or both. Returns the cooldown's end for a ban or a throttle."""
        body = report_body(
            outcome, status_code=status_code, retry_after=retry_after, ok=ok, failed=failed, release=release
        )
        answer = self._client._call("POST", f"/v1/leases/{quoted(self.id)}/report", body)
        if release:
            self._released = True
        return _cooldown_until(answer)

    def report_counts(self, ok: int = 0, failed: int = 0) -> None:
        """Counts of requests made through the lease since the last report; starts no cooldown."""
        if ok or failed:
            self.report(ok=ok, failed=failed)

    def release(self) -> None:
        """Ends the lease now. Releasing twice, or a lease already ended by `report(release=True)`, does nothing."""
        if self._released:
            return
        self._released = True
        self._client._call("DELETE", f"/v1/leases/{quoted(self.id)}", None)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *_exc: Any) -> None:
        try:
            self.release()
        except DiscoveryError:
            # The lease expires by its TTL anyway; an exception leaving the block must not be hidden by this one.
            pass


class DiscoveryClient:
    """A client for the discovery API (blocking calls, on `httpx.Client`)."""

    def __init__(
        self,
        base_url: str,
        token: Optional[str] = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        transport: Optional[httpx.BaseTransport] = None,
        failover_budget: float = DEFAULT_FAILOVER_BUDGET,
    ):
        """`failover_budget`: seconds each call keeps retrying while no replica serves (0 turns retrying off); a
        lease whose answer was lost when its leader was killed stays held, unknown to the caller, until its TTL."""
        self._http = httpx.Client(
            base_url=_check_base(base_url), headers=_headers(token), timeout=timeout, transport=transport
        )
        self._failover_budget = failover_budget

    def close(self) -> None:
        """Closes the connections."""
        self._http.close()

    def __enter__(self) -> "DiscoveryClient":
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()

    def _call(self, method: str, path: str, body: Optional[Dict[str, Any]], params: Optional[Dict[str, str]] = None) -> Any:
        retry = _Retry(self._failover_budget)
        while True:
            try:
                response = self._http.request(method, path, json=body, params=params)
            except httpx.HTTPError as error:
                pause = retry.next_pause() if _no_replica(error) else None
                if pause is None:
                    raise TransportError(f"{method} {path}: {error}") from error
                time.sleep(pause)
                continue
            pause = retry.next_pause() if _not_serving(response) else None
            if pause is None:
                return _answer(response)
            time.sleep(pause)

    def lease(
        self,
        target: str,
        *,
        selector: Optional[str] = None,
        ttl: Optional[float] = None,
        proxy: Optional[str] = None,
        session: Optional[str] = None,
        pool: Optional[str] = None,
        zone: Optional[str] = None,
        provider: Optional[str] = None,
        session_lifetime: Optional[int] = None,
        session_max_leases: Optional[int] = None,
    ) -> Lease:
        """Leases a proxy for `target` (a host, an IP address or a URL). Use the result with `with` to release it.

        With `pool` (a ProxyPool's name, or namespace/name) only its members are leased; a pool getting its first
        members raises `Unavailable` with reason `scaling-up` and `retry_after`. `zone` and `provider` keep to
        proxies with that zone or provider (as `proxies()` lists them: a Proxy's placement.zone and provider).
        `session_lifetime` (seconds) and `session_max_leases` move the session to another proxy once it has kept one
        that long, or leased it that many times."""
        body = lease_body(
            target,
            selector=selector,
            ttl=ttl,
            proxy=proxy,
            session=session,
            pool=pool,
            zone=zone,
            provider=provider,
            session_lifetime=session_lifetime,
            session_max_leases=session_max_leases,
        )
        return Lease(self, LeaseState.from_json(self._call("POST", "/v1/leases", body)))

    def resume(self, lease_id: str, ttl: Optional[float] = None) -> Lease:
        """Picks a lease up by its ID (kept across the crawler's own restart): renews it and returns it."""
        body = ttl_body(ttl)
        answer = self._call("POST", f"/v1/leases/{quoted(lease_id)}/renew", body)
        return Lease(self, LeaseState.from_json(answer))

    def proxies(
        self, selector: Optional[str] = None, target: Optional[str] = None, pool: Optional[str] = None
    ) -> List[ProxyInfo]:
        """Healthy proxies matching `selector` (members of `pool`, when given); with `target`, each one's cooldown and
        success rate for it."""
        answer = self._call("GET", "/v1/proxies", None, _query(selector=selector, target=target, pool=pool))
        return [ProxyInfo.from_json(entry) for entry in _list(answer, "proxies")]

    def cooldowns(self, target: Optional[str] = None) -> List[CooldownInfo]:
        """Live cooldowns your tenant's reports made (an admin token: every one), for one target or all."""
        answer = self._call("GET", "/v1/cooldowns", None, _query(target=target))
        return [CooldownInfo.from_json(entry) for entry in _list(answer, "cooldowns")]

    def clear_cooldowns(self, target: str, proxy: Optional[str] = None) -> List[CooldownInfo]:
        """Ends the cooldowns for `target` now and forgets their streaks (an `admin` token): of `proxy`
        (`namespace/name`) and the proxies sharing its egress IP, or of every proxy. Returns the ones that were
        running."""
        answer = self._call("DELETE", "/v1/cooldowns", None, _query(target=target, proxy=proxy))
        return [CooldownInfo.from_json(entry) for entry in _list(answer, "cleared")]


def _list(answer: Any, key: str) -> List[Mapping[str, Any]]:
    entries = answer.get(key) if isinstance(answer, dict) else None
    if not isinstance(entries, list):
        raise DecodeError(f"expected {{{key!r}: [...]}}, got {answer!r}")
    return entries


class AsyncLease(_LeaseView):
    """A held lease (async). `async with` releases it on exit."""

    def __init__(self, client: "AsyncDiscoveryClient", state: LeaseState):
        self._client = client
        self._state = state
        self._released = False

    async def renew(self, ttl: Optional[float] = None) -> bool:
        """Extends the lease; `True` when the proxy's instance was replaced (`proxy_url` changed)."""
        body = ttl_body(ttl)
        answer = await self._client._call("POST", f"/v1/leases/{quoted(self.id)}/renew", body)
        self._state = LeaseState.from_json(answer)
        return bool(answer.get("replaced", False))

    async def report(
        self,
        outcome: Optional[str] = None,
        *,
        status_code: Optional[int] = None,
        retry_after: Optional[float] = None,
        ok: Optional[int] = None,
        failed: Optional[int] = None,
        release: bool = False,
    ) -> Optional[datetime.datetime]:
        """As `Lease.report`."""
        body = report_body(
            outcome, status_code=status_code, retry_after=retry_after, ok=ok, failed=failed, release=release
        )
        answer = await self._client._call("POST", f"/v1/leases/{quoted(self.id)}/report", body)
        if release:
            self._released = True
        return _cooldown_until(answer)

    async def report_counts(self, ok: int = 0, failed: int = 0) -> None:
        """As `Lease.report_counts`."""
        if ok or failed:
            await self.report(ok=ok, failed=failed)

    async def release(self) -> None:
        """Ends the lease now (once)."""
        if self._released:
            return
        self._released = True
        await self._client._call("DELETE", f"/v1/leases/{quoted(self.id)}", None)

    async def __aenter__(self) -> "AsyncLease":
        return self

    async def __aexit__(self, *_exc: Any) -> None:
        try:
            await self.release()
        except DiscoveryError:
            pass


class _PendingLease:
    """`await client.lease(...)` gives the lease; `async with client.lease(...) as lease:` also releases it."""

    def __init__(self, client: "AsyncDiscoveryClient", body: Dict[str, Any]):
        self._client = client
        self._body = body
        self._lease: Optional[AsyncLease] = None

    async def _take(self) -> AsyncLease:
        answer = await self._client._call("POST", "/v1/leases", self._body)
        return AsyncLease(self._client, LeaseState.from_json(answer))

    def __await__(self) -> Generator[Any, None, AsyncLease]:
        return self._take().__await__()

    async def __aenter__(self) -> AsyncLease:
        self._lease = await self._take()
        return self._lease

    async def __aexit__(self, *exc: Any) -> None:
        if self._lease is not None:
            await self._lease.__aexit__(*exc)


class AsyncDiscoveryClient:
    """A client for the discovery API for asyncio (on `httpx.AsyncClient`): never blocks the event loop."""

    def __init__(
        self,
        base_url: str,
        token: Optional[str] = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        transport: Optional[httpx.AsyncBaseTransport] = None,
        failover_budget: float = DEFAULT_FAILOVER_BUDGET,
    ):
        """`failover_budget` as for the sync client."""
        self._http = httpx.AsyncClient(
            base_url=_check_base(base_url), headers=_headers(token), timeout=timeout, transport=transport
        )
        self._failover_budget = failover_budget

    async def aclose(self) -> None:
        """Closes the connections."""
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncDiscoveryClient":
        return self

    async def __aexit__(self, *_exc: Any) -> None:
        await self.aclose()

    async def _call(
        self, method: str, path: str, body: Optional[Dict[str, Any]], params: Optional[Dict[str, str]] = None
    ) -> Any:
        retry = _Retry(self._failover_budget)
        while True:
            try:
                response = await self._http.request(method, path, json=body, params=params)
            except httpx.HTTPError as error:
                pause = retry.next_pause() if _no_replica(error) else None
                if pause is None:
                    raise TransportError(f"{method} {path}: {error}") from error
                await asyncio.sleep(pause)
                continue
            pause = retry.next_pause() if _not_serving(response) else None
            if pause is None:
                return _answer(response)
            await asyncio.sleep(pause)

    def lease(
        self,
        target: str,
        *,
        selector: Optional[str] = None,
        ttl: Optional[float] = None,
        proxy: Optional[str] = None,
        session: Optional[str] = None,
        pool: Optional[str] = None,
        zone: Optional[str] = None,
        provider: Optional[str] = None,
        session_lifetime: Optional[int] = None,
        session_max_leases: Optional[int] = None,
    ) -> _PendingLease:
        """Leases a proxy for `target`: `await` it, or `async with` it to release on exit. `pool`, `zone`,
        `provider`, `session_lifetime` and `session_max_leases` as for the sync client."""
        body = lease_body(
            target,
            selector=selector,
            ttl=ttl,
            proxy=proxy,
            session=session,
            pool=pool,
            zone=zone,
            provider=provider,
            session_lifetime=session_lifetime,
            session_max_leases=session_max_leases,
        )
        return _PendingLease(self, body)

    async def resume(self, lease_id: str, ttl: Optional[float] = None) -> AsyncLease:
        """Picks a lease up by its ID: renews it and returns it."""
        body = ttl_body(ttl)
        answer = await self._call("POST", f"/v1/leases/{quoted(lease_id)}/renew", body)
        return AsyncLease(self, LeaseState.from_json(answer))

    async def proxies(
        self, selector: Optional[str] = None, target: Optional[str] = None, pool: Optional[str] = None
    ) -> List[ProxyInfo]:
        """As `DiscoveryClient.proxies`."""
        answer = await self._call("GET", "/v1/proxies", None, _query(selector=selector, target=target, pool=pool))
        return [ProxyInfo.from_json(entry) for entry in _list(answer, "proxies")]

    async def cooldowns(self, target: Optional[str] = None) -> List[CooldownInfo]:
        """As `DiscoveryClient.cooldowns`."""
        answer = await self._call("GET", "/v1/cooldowns", None, _query(target=target))
        return [CooldownInfo.from_json(entry) for entry in _list(answer, "cooldowns")]

    async def clear_cooldowns(self, target: str, proxy: Optional[str] = None) -> List[CooldownInfo]:
        """As `DiscoveryClient.clear_cooldowns`."""
        answer = await self._call("DELETE", "/v1/cooldowns", None, _query(target=target, proxy=proxy))
        return [CooldownInfo.from_json(entry) for entry in _list(answer, "cleared")]


__all__: Tuple[str, ...] = ("AsyncDiscoveryClient", "AsyncLease", "DiscoveryClient", "Lease")
