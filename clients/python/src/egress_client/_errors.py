"""Typed errors, one per kind of answer the discovery API gives (the Rust client's `ClientError`, in Python)."""

from __future__ import annotations

from typing import Any, Mapping, Optional


class DiscoveryError(Exception):
    """Anything that went wrong with a call to the discovery API."""

    def __init__(self, detail: str, *, status: Optional[int] = None, problem: Optional[Mapping[str, Any]] = None):
        super().__init__(detail)
        self.detail = detail
        self.status = status
        self.problem: Mapping[str, Any] = problem or {}


class _WithReason(DiscoveryError):
    def __init__(
        self,
        detail: str,
        *,
        reason: str,
        retry_after: Optional[float],
        status: Optional[int] = None,
        problem: Optional[Mapping[str, Any]] = None,
    ):
        super().__init__(detail, status=status, problem=problem)
        self.reason = reason
        #: Seconds to wait before trying again, from `Retry-After` (or the problem's `retryAfterSeconds`).
        self.retry_after = retry_after


class Unavailable(_WithReason):
    """503: no proxy can be leased now (`none-healthy`, `all-at-capacity`, `all-cooling-down`), or the server is not
    serving (`not-serving`, during a change of leader). `retry_after` says when to try again."""


class Conflict(_WithReason):
    """409: the named proxy is cooling down for the target (`proxy-cooling-down`), or full, drained or unhealthy
    (`proxy-unavailable`)."""


class QuotaExceeded(_WithReason):
    """429: the tenant's quota is used up (`quota-max-leases`: it holds as many leases as it may; release one;
    `quota-reports-per-minute`). `retry_after` says when to try again."""


class NotFound(DiscoveryError):
    """404: no such lease for this token (expired, released, never granted to it), or no such proxy."""


class Gone(DiscoveryError):
    """410: the lease was revoked: its proxy turned unhealthy or went away. Take a new one."""


class Unauthorized(DiscoveryError):
    """401: the token is missing or unknown."""


class Forbidden(DiscoveryError):
    """403: the token's scope is too small (a `read` token asked for a lease)."""


class BadRequest(DiscoveryError):
    """400: the request was invalid; `detail` says what and where."""


class TransportError(DiscoveryError):
    """The request did not complete (connection refused, reset, timed out)."""


class DecodeError(DiscoveryError):
    """The answer was not what the API promises."""


def error_for(status: int, problem: Mapping[str, Any], retry_after_header: Optional[str]) -> DiscoveryError:
    """The typed error for an error answer."""
    detail = str(problem.get("detail") or problem.get("title") or f"HTTP {status}")
    reason = str(problem.get("reason") or "")
    retry_after = _retry_after(retry_after_header, problem)
    if status == 503:
        return Unavailable(detail, reason=reason, retry_after=retry_after, status=status, problem=problem)
    if status == 409:
        return Conflict(detail, reason=reason, retry_after=retry_after, status=status, problem=problem)
    if status == 429:
        return QuotaExceeded(detail, reason=reason, retry_after=retry_after, status=status, problem=problem)
    kinds = {404: NotFound, 410: Gone, 401: Unauthorized, 403: Forbidden, 400: BadRequest}
    kind = kinds.get(status, DiscoveryError)
    return kind(detail, status=status, problem=problem)


def _retry_after(header: Optional[str], problem: Mapping[str, Any]) -> Optional[float]:
    # A paced slot is finer than Retry-After's whole seconds: the problem gives it to the millisecond.
    millis = problem.get("retryAfterMilliseconds")
    if isinstance(millis, (int, float)) and not isinstance(millis, bool):
        return max(0.0, float(millis) / 1000)
    if header is not None:
        try:
            return max(0.0, float(header))
        except ValueError:
            pass
    seconds = problem.get("retryAfterSeconds")
    return float(seconds) if isinstance(seconds, (int, float)) else None
