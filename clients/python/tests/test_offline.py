"""What the client does with each kind of answer, against httpx's mock transport (no server)."""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List

import httpx
import pytest

import egress_client
from egress_client import DiscoveryClient

LEASE = {
    "id": "l1.AAA.BBB",
    "proxy": {
        "namespace": "crawl",
        "name": "eu-1",
        "host": "10.0.0.1",
        "port": 3128,
        "url": "http://10.0.0.1:3128",
        "egressIP": "203.0.113.7",
    },
    "target": "example.com",
    "expiresAt": "2026-12-01T12:00:00Z",
}


def client_answering(status: int, body: object, headers: dict = {}) -> tuple:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.method == "POST" and request.url.path == "/v1/leases":
            return httpx.Response(201, json=LEASE)
        return httpx.Response(status, json=body, headers=headers)

    return DiscoveryClient("http://discovery", "token-1", transport=httpx.MockTransport(handler)), seen


@pytest.mark.parametrize(
    "status, kind",
    [
        (400, egress_client.BadRequest),
        (401, egress_client.Unauthorized),
        (403, egress_client.Forbidden),
        (404, egress_client.NotFound),
        (410, egress_client.Gone),
        (409, egress_client.Conflict),
        (503, egress_client.Unavailable),
        (429, egress_client.QuotaExceeded),
        (500, egress_client.DiscoveryError),
    ],
)
def test_each_status_is_its_own_error(status: int, kind: type) -> None:
    problem = {"type": "urn:x", "title": "t", "status": status, "detail": "what went wrong", "reason": "r"}
    client, _ = client_answering(status, problem, {"retry-after": "7"})
    with pytest.raises(kind) as raised:
        client.lease("example.com").renew()
    assert raised.value.detail == "what went wrong" and raised.value.status == status
    if status in (409, 429, 503):
        assert (raised.value.reason, raised.value.retry_after) == ("r", 7.0)


def test_a_paced_refusal_gives_its_slot_to_the_millisecond() -> None:
    problem = {"status": 503, "detail": "paced", "reason": "paced", "retryAfterMilliseconds": 1250}
    client, _ = client_answering(503, problem, {"retry-after": "2"})
    with pytest.raises(egress_client.Unavailable) as raised:
        client.lease("example.com").renew()
    assert (raised.value.reason, raised.value.retry_after) == ("paced", 1.25)


def test_requests_carry_the_token_and_the_bodies_the_api_wants() -> None:
    client, seen = client_answering(200, {"cooldownUntil": "2026-12-01T12:10:00Z"})
    lease = client.lease("example.com", ttl=90.5, selector="region=eu", session="s-1")
    until = lease.report("throttled", status_code=429, retry_after=12.4)
    assert until is not None and until.minute == 10
    lease.report_counts(ok=5)
    first, throttle, counts = seen
    assert first.headers["authorization"] == "Bearer token-1"
    assert json.loads(first.content) == {"target": "example.com", "ttlSeconds": 90, "selector": "region=eu", "session": "s-1"}
    assert throttle.url.path == "/v1/leases/l1.AAA.BBB/report"
    assert json.loads(throttle.content) == {"outcome": "throttled", "statusCode": 429, "retryAfterSeconds": 12}
    assert json.loads(counts.content) == {"ok": 5}
    assert lease.egress_ip == "203.0.113.7"


def test_a_sessions_lifetime_goes_in_the_lease_body_and_is_checked_first() -> None:
    client, seen = client_answering(200, {})
    client.lease("example.com", session="s-1", session_lifetime=300, session_max_leases=20)
    assert json.loads(seen[0].content) == {
        "target": "example.com",
        "session": "s-1",
        "sessionLifetimeSeconds": 300,
        "sessionMaxLeases": 20,
    }
    refused: List[Dict[str, Any]] = [
        {"session_lifetime": 60},
        {"session": "s", "session_lifetime": 0},
        {"session": "s", "session_max_leases": 1_000_001},
    ]
    for options in refused:
        with pytest.raises(ValueError, match="with a session"):
            client.lease("example.com", **options)
    assert len(seen) == 1


def test_bad_reports_are_refused_before_any_request() -> None:
    client, seen = client_answering(200, {})
    lease = client.lease("example.com")
    for bad in [dict(outcome="meh"), dict(outcome="banned", retry_after=3), dict()]:
        with pytest.raises(ValueError):
            lease.report(**bad)
    assert len(seen) == 1, "only the lease went out"
    with pytest.raises(ValueError):
        DiscoveryClient("discovery:8090")
    # A TTL that is no positive number of seconds is refused, not turned into 1 s.
    for bad_ttl in [0, -5, float("nan"), float("inf")]:
        with pytest.raises(ValueError, match="ttl must be a positive number of seconds"):
            client.lease("example.com", ttl=bad_ttl)
        with pytest.raises(ValueError, match="ttl must be a positive number of seconds"):
            lease.renew(ttl=bad_ttl)
    assert len(seen) == 1, "nothing more went out"
    client.lease("example.com", ttl=0.6)
    assert json.loads(seen[-1].content)["ttlSeconds"] == 1
    # A target that is no host name, IP address or http(s) URL is refused with what is wrong, before sending.
    sent = len(seen)
    for bad_target, why in [
        ("-bad-.com", "'-bad-' is not a DNS label"),
        ("http://a..com/", "'' is not a DNS label"),
        ("ftp://example.com/", "only http and https URLs"),
        ("", "must be a host name"),
        ("http:///path", "has no host"),
    ]:
        with pytest.raises(ValueError, match=re.escape(why)):
            client.lease(bad_target)
    assert len(seen) == sent, "nothing went out"
    for good in ["https://www.shop.example.co.uk/item?x=1", "127.0.0.1:8080", "[::1]:443", "::1", "bücher.example",
                 "_dmarc.example.com", "Example.COM."]:
        client.lease(good)
    assert len(seen) == sent + 7


def test_an_answer_that_is_not_the_api_is_a_decode_error() -> None:
    client, _ = client_answering(200, {"id": "x"})
    with pytest.raises(egress_client.DecodeError):
        client.lease("example.com").renew()


def test_a_pool_is_asked_for_by_name_and_a_scaling_pool_says_when_to_come_back() -> None:
    client, seen = client_answering(200, {"proxies": [dict(LEASE["proxy"], labels={}, activeLeases=0, maxLeases=5, pool="eu")]})
    client.lease("example.com", pool="crawl/eu")
    listed = client.proxies(pool="eu")
    assert json.loads(seen[0].content) == {"target": "example.com", "pool": "crawl/eu"}
    assert seen[1].url.params["pool"] == "eu"
    assert listed[0].pool == "eu"
    for bad in ["", "a/b/c", "e u"]:
        with pytest.raises(ValueError):
            client.lease("example.com", pool=bad)
    assert len(seen) == 2, "a bad pool is refused before any request"
    problem = {"type": "urn:x", "title": "t", "status": 503, "detail": "pool crawl/night has no Ready member", "reason": "scaling-up"}
    transport = httpx.MockTransport(lambda request: httpx.Response(503, json=problem, headers={"retry-after": "42"}))
    scaling = DiscoveryClient("http://discovery", "token-1", transport=transport)
    with pytest.raises(egress_client.Unavailable) as raised:
        scaling.lease("example.com", pool="night")
    assert (raised.value.reason, raised.value.retry_after) == ("scaling-up", 42.0)


def test_an_admin_clears_cooldowns_by_target_and_proxy() -> None:
    cleared = {"cleared": [{"proxy": "crawl/eu-1", "target": "example.com", "until": "2026-12-02T12:00:00Z", "streak": 2}]}
    client, seen = client_answering(200, cleared)
    entries = client.clear_cooldowns("www.example.com", proxy="crawl/eu-1")
    assert [(entry.proxy, entry.target, entry.streak) for entry in entries] == [("crawl/eu-1", "example.com", 2)]
    request = seen[-1]
    assert request.method == "DELETE" and request.url.path == "/v1/cooldowns"
    assert dict(request.url.params) == {"target": "www.example.com", "proxy": "crawl/eu-1"}


def _changing_leader(answers: list) -> tuple:
    """A transport that plays `answers` in turn: an exception to raise, or a (status, body) to answer."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = answers[min(len(seen), len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        status, body = answer
        return httpx.Response(status, json=body)

    return httpx.MockTransport(handler), seen


NOT_SERVING = (503, {"status": 503, "reason": "not-serving", "detail": "handing over"})


def test_a_change_of_leader_is_waited_out_within_the_budget() -> None:
    refused = httpx.ConnectError("connection refused")
    dropped = httpx.RemoteProtocolError("Server disconnected without sending a response.")
    transport, seen = _changing_leader([refused, dropped, NOT_SERVING, (201, LEASE)])
    lease = DiscoveryClient("http://discovery", "t", transport=transport).lease("example.com")
    assert lease.id == LEASE["id"] and len(seen) == 4


def test_past_the_budget_or_for_other_answers_the_error_is_raised() -> None:
    transport, seen = _changing_leader([NOT_SERVING])
    with pytest.raises(egress_client.Unavailable) as raised:
        DiscoveryClient("http://discovery", "t", transport=transport, failover_budget=0.3).lease("example.com")
    assert raised.value.reason == "not-serving" and len(seen) >= 3
    transport, seen = _changing_leader([httpx.ConnectError("refused")])
    with pytest.raises(egress_client.TransportError):
        DiscoveryClient("http://discovery", "t", transport=transport, failover_budget=0).lease("example.com")
    assert len(seen) == 1
    none_healthy = (503, {"status": 503, "reason": "none-healthy", "detail": "no proxy"})
    transport, seen = _changing_leader([none_healthy, (201, LEASE)])
    with pytest.raises(egress_client.Unavailable):
        DiscoveryClient("http://discovery", "t", transport=transport).lease("example.com")
    assert len(seen) == 1, "an answer about the fleet is the caller's to act on"


def test_the_async_client_waits_out_a_change_of_leader_too() -> None:
    import asyncio

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) == 1:
            raise httpx.ConnectError("refused")
        if len(seen) == 2:
            return httpx.Response(NOT_SERVING[0], json=NOT_SERVING[1])
        return httpx.Response(201, json=LEASE)

    async def lease() -> str:
        client = egress_client.AsyncDiscoveryClient("http://discovery", "t", transport=httpx.MockTransport(handler))
        taken = await client.lease("example.com")
        await client.aclose()
        return taken.id

    assert asyncio.run(lease()) == LEASE["id"] and len(seen) == 3
