/**
 * A client for the egress-operator discovery API: lease a proxy for a site, reuse it, report what the site did,
 * renew and release it. The crawlee integration is `egress-operator-client/crawlee`.
 */

export {
  DEFAULT_FAILOVER_BUDGET_MS,
  DEFAULT_TIMEOUT_MS,
  DiscoveryClient,
  Lease,
  OUTCOMES,
  reportBody,
  type ClientOptions,
  type CooldownInfo,
  type LeasedProxy,
  type ProxyCredentials,
  type LeaseOptions,
  type Outcome,
  type Pacing,
  type ProxyInfo,
  type Report,
} from './client.js';
export {
  BadRequest,
  Conflict,
  DecodeError,
  DiscoveryError,
  Forbidden,
  Gone,
  NotFound,
  QuotaExceeded,
  RefusedError,
  TransportError,
  Unauthorized,
  Unavailable,
  errorFor,
  retryAfterSeconds,
  type Problem,
} from './errors.js';
export {
  GATEWAY_REPORTS,
  GatewayError,
  gatewayProxyUrl,
  reportToGateway,
  type GatewayOptions,
  type GatewayReport,
} from './gateway.js';
