"""A client for the egress-operator discovery API: lease proxies for a site, reuse them, report what the site did,
and release them. Sync (`DiscoveryClient`) and async (`AsyncDiscoveryClient`), on httpx. Through the gateway
instead: `gateway_proxy_url` and `report_to_gateway` (module `egress_client.gateway`)."""

from ._client import DEFAULT_FAILOVER_BUDGET, AsyncDiscoveryClient, AsyncLease, DiscoveryClient, Lease
from ._errors import (
    BadRequest,
    Conflict,
    DecodeError,
    DiscoveryError,
    Forbidden,
    Gone,
    NotFound,
    QuotaExceeded,
    TransportError,
    Unauthorized,
    Unavailable,
)
from ._models import OUTCOMES, CooldownInfo, LeasedProxy, ProxyCredentials, ProxyInfo
from .gateway import GatewayError, areport_to_gateway, gateway_proxy_url, report_to_gateway

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_FAILOVER_BUDGET",
    "OUTCOMES",
    "AsyncDiscoveryClient",
    "AsyncLease",
    "BadRequest",
    "Conflict",
    "CooldownInfo",
    "DecodeError",
    "DiscoveryClient",
    "DiscoveryError",
    "Forbidden",
    "GatewayError",
    "Gone",
    "Lease",
    "LeasedProxy",
    "NotFound",
    "ProxyCredentials",
    "ProxyInfo",
    "QuotaExceeded",
    "TransportError",
    "Unauthorized",
    "Unavailable",
    "areport_to_gateway",
    "gateway_proxy_url",
    "report_to_gateway",
]
