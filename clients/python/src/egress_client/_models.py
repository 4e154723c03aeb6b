"""What the discovery API answers, as typed values."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import math
import re
import urllib.parse
from typing import Any, Dict, Mapping, Optional

from ._errors import DecodeError

#: Outcomes a report may carry.
OUTCOMES = ("ok", "banned", "throttled", "failed")


def parse_time(text: Any) -> datetime.datetime:
    """An RFC 3339 timestamp as an aware datetime."""
    if not isinstance(text, str):
        raise DecodeError(f"expected an RFC 3339 timestamp, got {text!r}")
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as error:
        raise DecodeError(f"{text!r} is not an RFC 3339 timestamp") from error


@dataclasses.dataclass(frozen=True)
class ProxyCredentials:
    """A proxy's user name and password, not percent-encoded."""

    username: str
    #: Left out of `repr`, so a logged lease does not show it.
    password: str = dataclasses.field(repr=False)


def credentials_of(body: Any) -> Optional[ProxyCredentials]:
    """A lease's `proxy.credentials`, when the answer has them."""
    if body is None:
        return None
    if not isinstance(body, Mapping):
        raise TypeError(f"proxy.credentials is {body!r}, not an object")
    return ProxyCredentials(username=str(body["username"]), password=str(body["password"]))


@dataclasses.dataclass(frozen=True)
class LeasedProxy:
    """The proxy a lease is on."""

    namespace: str
    name: str
    host: str
    port: int
    #: `http://[user:password@]host:port`: give it to the HTTP client as its proxy.
    url: str
    #: The credentials in `url`, as fields: for a client that connects to the proxy itself.
    credentials: Optional[ProxyCredentials] = None
    #: The address sites see, once the proxy's probes observed it; proxies sharing it share cooldowns.
    egress_ip: Optional[str] = None
    #: Its pace for one site, when paced (`{"intervalMilliseconds", "burst"}`): send one request per lease.
    pacing: Optional[Dict[str, int]] = None

    @property
    def id(self) -> str:
        """`namespace/name`."""
        return f"{self.namespace}/{self.name}"


@dataclasses.dataclass(frozen=True)
class LeaseState:
    """A lease as the server last described it."""

    id: str
    proxy: LeasedProxy
    target: str
    expires_at: datetime.datetime
    #: For a session with `session_lifetime`: how long, from the answer, it keeps this proxy (its next lease goes
    #: elsewhere after that).
    session_ends_in_milliseconds: Optional[int] = None

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> "LeaseState":
        try:
            proxy = body["proxy"]
            return cls(
                id=str(body["id"]),
                proxy=LeasedProxy(
                    namespace=str(proxy["namespace"]),
                    name=str(proxy["name"]),
                    host=str(proxy["host"]),
                    port=int(proxy["port"]),
                    url=str(proxy["url"]),
                    credentials=credentials_of(proxy.get("credentials")),
                    egress_ip=proxy.get("egressIP"),
                    pacing=proxy.get("pacing"),
                ),
                target=str(body["target"]),
                expires_at=parse_time(body["expiresAt"]),
                session_ends_in_milliseconds=body.get("sessionEndsInMilliseconds"),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise DecodeError(f"not a lease: {body!r}") from error


@dataclasses.dataclass(frozen=True)
class ProxyInfo:
    """A proxy as `GET /v1/proxies` lists it."""

    namespace: str
    name: str
    host: str
    port: int
    url: str
    labels: Dict[str, str]
    active_leases: int
    max_leases: int
    egress_ip: Optional[str] = None
    zone: Optional[str] = None
    provider: Optional[str] = None
    #: The ProxyPool it is a member of, in its namespace.
    pool: Optional[str] = None
    cooling_down_until: Optional[datetime.datetime] = None
    #: For the asked target: the share of reported requests the proxy served, and over how many.
    success_rate: Optional[float] = None
    reported: Optional[int] = None
    #: How long a site's ban cools it down: `{"baseSeconds", "factor", "maxSeconds"}`.
    cooldown_policy: Optional[Dict[str, int]] = None
    #: How often its egress address is leased for one site, when paced: `{"intervalMilliseconds", "burst"}`.
    pacing: Optional[Dict[str, int]] = None

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> "ProxyInfo":
        try:
            cooling = body.get("coolingDownUntil")
            return cls(
                namespace=str(body["namespace"]),
                name=str(body["name"]),
                host=str(body["host"]),
                port=int(body["port"]),
                url=str(body["url"]),
                labels=dict(body.get("labels") or {}),
                active_leases=int(body["activeLeases"]),
                max_leases=int(body["maxLeases"]),
                egress_ip=body.get("egressIP"),
                zone=body.get("zone"),
                provider=body.get("provider"),
                pool=body.get("pool"),
                cooling_down_until=parse_time(cooling) if cooling is not None else None,
                success_rate=body.get("successRate"),
                reported=body.get("reported"),
                cooldown_policy=body.get("cooldownPolicy"),
                pacing=body.get("pacing"),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise DecodeError(f"not a proxy: {body!r}") from error


@dataclasses.dataclass(frozen=True)
class CooldownInfo:
    """A live cooldown: `proxy` is not leased for `target` until `until`."""

    proxy: str
    target: str
    until: datetime.datetime
    streak: int

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> "CooldownInfo":
        try:
            return cls(
                proxy=str(body["proxy"]),
                target=str(body["target"]),
                until=parse_time(body["until"]),
                streak=int(body["streak"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise DecodeError(f"not a cooldown: {body!r}") from error


def ttl_body(ttl: Optional[float]) -> Dict[str, Any]:
    """`{"ttlSeconds": n}` for a TTL in seconds (rounded, at least 1), `{}` for none; a TTL that is not a positive,
    finite number of seconds is refused before anything is sent (it used to become 1 s silently)."""
    if ttl is None:
        return {}
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or ttl <= 0:
        raise ValueError(f"ttl must be a positive number of seconds, not {ttl!r}")
    return {"ttlSeconds": max(1, round(ttl))}


_LABEL = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


def check_target(target: Any) -> str:
    """`target` as given, when it is a host name, an IP address or an http(s) URL; anything else is refused before
    it is sent, with what is wrong (the server refuses it too, but a crawler should hear of a bad URL at once).
    International names are left to the server, which parses them as a browser does."""
    if not isinstance(target, str) or not target.strip():
        raise ValueError(f"target must be a host name, an IP address or an http(s) URL, not {target!r}")
    text = target.strip()
    if len(text) > 2048:
        raise ValueError(f"target {text[:40]!r}... is longer than 2048 characters")
    if "://" in text:
        parts = urllib.parse.urlsplit(text)
        if parts.scheme.lower() not in ("http", "https"):
            raise ValueError(f"target {text!r}: only http and https URLs are targets, not {parts.scheme}:")
        host = parts.hostname or ""
    else:
        authority = re.split(r"[/?#]", text, maxsplit=1)[0]
        try:
            ipaddress.ip_address(authority.strip("[]"))
            return target
        except ValueError:
            pass
        host = urllib.parse.urlsplit(f"http://{authority}").hostname or ""
    if not host:
        raise ValueError(f"target {text!r} has no host")
    try:
        ipaddress.ip_address(host.strip("[]"))
        return target
    except ValueError:
        pass
    for label in host.rstrip(".").split("."):
        if label.isascii() and not _LABEL.match(label):
            raise ValueError(
                f"target {text!r}: {label!r} is not a DNS label (letters, digits, '-' and '_', at most 63, "
                "neither starting nor ending with '-')"
            )
    return target


def lease_body(
    target: str,
    *,
    selector: Optional[str],
    ttl: Optional[float],
    proxy: Optional[str],
    session: Optional[str],
    pool: Optional[str] = None,
    zone: Optional[str] = None,
    provider: Optional[str] = None,
    session_lifetime: Optional[int] = None,
    session_max_leases: Optional[int] = None,
) -> Dict[str, Any]:
    body: Dict[str, Any] = {"target": check_target(target)}
    if selector:
        body["selector"] = selector
    body.update(ttl_body(ttl))
    if proxy:
        body["proxy"] = proxy
    if session:
        body["session"] = session
    for field, limit, most in (
        ("sessionLifetimeSeconds", session_lifetime, 86_400),
        ("sessionMaxLeases", session_max_leases, 1_000_000),
    ):
        if limit is not None:
            if not session or isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= most:
                raise ValueError(f"{field} {limit!r}: a whole number from 1 to {most}, with a session")
            body[field] = limit
    if pool is not None:
        if not pool or pool.count("/") > 1 or any(character.isspace() for character in pool):
            raise ValueError(f"pool {pool!r} must be a ProxyPool's name or namespace/name")
        body["pool"] = pool
    for key, value in (("zone", zone), ("provider", provider)):
        if value is not None:
            if not value or len(value) > 253:
                raise ValueError(f"{key} {value!r} must be 1 to 253 characters")
            body[key] = value
    return body


def report_body(
    outcome: Optional[str],
    *,
    status_code: Optional[int],
    retry_after: Optional[float],
    ok: Optional[int],
    failed: Optional[int],
    release: bool,
) -> Dict[str, Any]:
    if outcome is not None and outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}, not {outcome!r}")
    if retry_after is not None and outcome != "throttled":
        raise ValueError("retry_after goes only with outcome 'throttled'")
    body: Dict[str, Any] = {}
    if outcome is not None:
        body["outcome"] = outcome
    if status_code is not None:
        body["statusCode"] = int(status_code)
    if retry_after is not None:
        body["retryAfterSeconds"] = min(86_400, max(1, int(round(retry_after))))
    if ok:
        body["ok"] = int(ok)
    if failed:
        body["failed"] = int(failed)
    if release:
        body["release"] = True
    if not any(key in body for key in ("outcome", "ok", "failed")):
        raise ValueError("a report needs an outcome, counts (ok, failed), or both")
    return body


def quoted(lease_id: str) -> str:
    """A lease ID as a path segment."""
    return urllib.parse.quote(lease_id, safe="")
