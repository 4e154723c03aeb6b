"""Gateway helpers: the proxy URL for a session, and reporting a refusal the gateway could not see.

The gateway (`egress-operator gateway`, docs/gateway.md) is one forward-proxy URL for the whole fleet; its user name
carries options (`session-<id>`, `pool-<name>`, `zone-<z>`, `provider-<p>`, `label-<k>=<v>`, `sticky-<seconds>`,
`lifetime-<seconds>`, `requests-<count>`)
and its password is a discovery token. Plain `http://` answers are the gateway's to judge; inside a `CONNECT` tunnel
(every `https://` URL) only the crawler sees the site's answer, so it reports a ban or a throttle itself::

    proxy = gateway_proxy_url("http://egress-gateway.egress-system:8088", token, session="a1")
    httpx.get("https://shop.example.com/", proxy=proxy)           # 403 from the site, inside the tunnel
    report_to_gateway(proxy, "https://shop.example.com/", "banned")

The report cools the session's proxy down for the site (for the tenant), closes the tunnels the gateway holds
through it to that site, and the session's next request goes through another proxy.
"""

from __future__ import annotations

import base64
import re
import urllib.parse
from typing import Any, Dict, Mapping, Optional, Tuple

import httpx

#: The report outcomes the gateway takes.
REPORTS = ("banned", "throttled")

_SESSION = re.compile(r"[A-Za-z0-9._~-]{1,128}")


class GatewayError(Exception):
    """The gateway refused a report (or could not be reached: `status` is None then)."""

    def __init__(self, detail: str, *, status: Optional[int] = None):
        super().__init__(detail)
        self.detail = detail
        self.status = status


def gateway_proxy_url(
    gateway: str,
    token: str,
    *,
    session: Optional[str] = None,
    sticky: Optional[int] = None,
    lifetime: Optional[int] = None,
    requests: Optional[int] = None,
    pool: Optional[str] = None,
    zone: Optional[str] = None,
    provider: Optional[str] = None,
    labels: Optional[Mapping[str, str]] = None,
) -> str:
    """The proxy URL that sends requests through `gateway` (`http://host:port`, or `host:port`) as `token`, with the
    options in the user name. Raises ValueError for an option the gateway would refuse."""
    split = urllib.parse.urlsplit(gateway if "://" in gateway else f"http://{gateway}")
    if split.scheme != "http" or not split.hostname or split.username or split.password:
        raise ValueError(f"the gateway is http://host:port, without credentials (got {gateway!r})")
    if not token:
        raise ValueError("the token (the proxy password) is empty")
    options = []
    if session is not None:
        if not _SESSION.fullmatch(session):
            raise ValueError(f"session {session!r}: 1-128 of A-Z a-z 0-9 . _ ~ -")
        options.append(f"session-{session}")
    for key, limit, most, unit in (
        ("sticky", sticky, 86_400, " seconds"),
        ("lifetime", lifetime, 86_400, " seconds"),
        ("requests", requests, 1_000_000, ""),
    ):
        if limit is not None:
            if session is None or not 1 <= limit <= most:
                raise ValueError(f"{key} {limit!r}: 1-{most}{unit}, with a session")
            options.append(f"{key}-{limit}")
    for key, value in (("pool", pool), ("zone", zone), ("provider", provider)):
        if value is not None:
            if not value or "," in value:
                raise ValueError(f"{key} {value!r}: not empty and without a comma")
            options.append(f"{key}-{value}")
    for key, value in sorted((labels or {}).items()):
        if not key or not value or "," in key + value or "=" in key:
            raise ValueError(f"label {key}={value}: a label key and value, without commas")
        options.append(f"label-{key}={value}")
    # No options is the user name `rotate`: for an empty one, requests and Scrapy send no credentials at all.
    user = urllib.parse.quote(",".join(options) or "rotate", safe="")
    password = urllib.parse.quote(token, safe="")
    return f"http://{user}:{password}@{split.netloc}"


def _report_request(
    proxy_url: str, target: str, outcome: str, retry_after: Optional[float]
) -> Tuple[str, Dict[str, str], Dict[str, str]]:
    """The URL, headers and query of the report of `outcome` on the session of `proxy_url` for `target`."""
    if outcome not in REPORTS:
        raise ValueError(f"outcome {outcome!r}: one of {', '.join(REPORTS)}")
    split = urllib.parse.urlsplit(proxy_url)
    if split.scheme != "http" or not split.hostname or split.password is None:
        raise ValueError("proxy_url is the gateway proxy URL, http://<options>:<token>@host:port")
    user = urllib.parse.unquote(split.username or "")
    if not any(option.startswith("session-") for option in user.split(",")):
        raise ValueError("a report is on a session's proxy: the proxy URL's user name needs session-<id>")
    site = urllib.parse.urlsplit(target if "://" in target else f"//{target}")
    if not site.hostname:
        raise ValueError(f"target {target!r}: a URL or host[:port]")
    host = f"[{site.hostname}]" if ":" in site.hostname else site.hostname
    authority = f"{host}:{site.port}" if site.port else host
    value = outcome
    if retry_after is not None and outcome == "throttled":
        value += f"; retry-after={max(1, min(86_400, int(round(retry_after))))}"
    credentials = f"{user}:{urllib.parse.unquote(split.password)}".encode()
    headers = {
        "Proxy-Authorization": "Basic " + base64.b64encode(credentials).decode(),
        "X-Egress-Report": value,
    }
    port = split.port or 80
    return f"http://{split.hostname}:{port}/report", headers, {"target": authority}


def _answer(response: httpx.Response) -> str:
    if response.status_code != 200:
        why = response.headers.get("proxy-status", "") or response.text[:200]
        raise GatewayError(f"the gateway refused the report ({response.status_code}): {why}", status=response.status_code)
    body: Any = response.json()
    return str(body.get("proxy", ""))


def report_to_gateway(
    proxy_url: str, target: str, outcome: str, *, retry_after: Optional[float] = None, timeout: float = 10.0
) -> str:
    """Reports `outcome` (`banned`, or `throttled` with `retry_after` seconds) that `target` (the URL or host the
    site answered) gave the session of `proxy_url` (the gateway proxy URL the request went through, with
    `session-<id>`). Returns the proxy reported (`namespace/name`). Raises GatewayError when the gateway refuses it or
    cannot be reached."""
    url, headers, query = _report_request(proxy_url, target, outcome, retry_after)
    try:
        with httpx.Client(timeout=timeout, trust_env=False) as client:
            return _answer(client.post(url, headers=headers, params=query))
    except httpx.HTTPError as error:
        raise GatewayError(f"the gateway could not be reached: {error}") from error


async def areport_to_gateway(
    proxy_url: str,
    target: str,
    outcome: str,
    *,
    retry_after: Optional[float] = None,
    timeout: float = 10.0,
    client: Optional[httpx.AsyncClient] = None,
) -> str:
    """`report_to_gateway`, async; with `client` (one made with `trust_env=False`) reused when given."""
    url, headers, query = _report_request(proxy_url, target, outcome, retry_after)
    try:
        if client is not None:
            return _answer(await client.post(url, headers=headers, params=query, timeout=timeout))
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as own:
            return _answer(await own.post(url, headers=headers, params=query))
    except httpx.HTTPError as error:
        raise GatewayError(f"the gateway could not be reached: {error}") from error
