/** Typed errors, one per kind of answer the discovery API gives (the Rust client's `ClientError`, in TypeScript). */

/** An RFC 9457 problem document as the API sends it. */
export interface Problem {
  type?: string;
  title?: string;
  status?: number;
  detail?: string;
  reason?: string;
  retryAfterSeconds?: number;
  retryAfterMilliseconds?: number;
  [key: string]: unknown;
}

/** Anything that went wrong with a call to the discovery API. */
export class DiscoveryError extends Error {
  /** The HTTP status, when the server answered. */
  readonly status: number | undefined;
  /** The problem document the server sent (empty when it sent none). */
  readonly problem: Problem;

  constructor(message: string, options: { status?: number; problem?: Problem; cause?: unknown } = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = new.target.name;
    this.status = options.status;
    this.problem = options.problem ?? {};
  }
}

/** A refusal that says why (`reason`) and when to try again (`retryAfter`, seconds). */
export class RefusedError extends DiscoveryError {
  readonly reason: string;
  /** Seconds to wait before trying again, from `Retry-After` (or the problem's `retryAfterSeconds`). */
  readonly retryAfter: number | undefined;

  constructor(message: string, options: { status?: number; problem?: Problem; reason: string; retryAfter?: number }) {
    super(message, options);
    this.reason = options.reason;
    this.retryAfter = options.retryAfter;
  }
}

/**
 * 503: no proxy can be leased now (`none-healthy`, `all-at-capacity`, `all-cooling-down`), or the server is not
 * serving (`not-serving`, during a change of leader). `retryAfter` says when to try again.
 */
export class Unavailable extends RefusedError {}

/** 409: the named proxy is cooling down for the target (`proxy-cooling-down`), or full, drained or unhealthy. */
export class Conflict extends RefusedError {}

/**
 * 429: the tenant's quota is used up (`quota-max-leases`: it holds as many leases as it may, release one;
 * `quota-reports-per-minute`). `retryAfter` says when to try again.
 */
export class QuotaExceeded extends RefusedError {}

/** 404: no such lease for this token (expired, released, never granted to it), or no such proxy. */
export class NotFound extends DiscoveryError {}

/** 410: the lease was revoked: its proxy turned unhealthy or went away. Take a new one. */
export class Gone extends DiscoveryError {}

/** 401: the token is missing or unknown. */
export class Unauthorized extends DiscoveryError {}

/** 403: the token's scope is too small (a `read` token asked for a lease). */
export class Forbidden extends DiscoveryError {}

/** 400: the request was invalid; the message says what and where. */
export class BadRequest extends DiscoveryError {}

/** The request did not complete (connection refused, reset, timed out). */
export class TransportError extends DiscoveryError {}

/** The answer was not what the API promises. */
export class DecodeError extends DiscoveryError {}

/**
 * Seconds from the problem's `retryAfterMilliseconds` (a paced slot), else a `Retry-After` header (delta-seconds or
 * an HTTP date), else the problem's `retryAfterSeconds`.
 */
export function retryAfterSeconds(header: string | null | undefined, problem: Problem, now = Date.now()): number | undefined {
  // A paced slot is finer than Retry-After's whole seconds: the problem gives it to the millisecond.
  if (typeof problem.retryAfterMilliseconds === 'number') return problem.retryAfterMilliseconds / 1000;
  if (header != null && header.trim() !== '') {
    const text = header.trim();
    if (/^\d+(\.\d+)?$/.test(text)) {
      return Number(text);
    }
    const date = Date.parse(text);
    if (!Number.isNaN(date)) {
      return Math.max(0, (date - now) / 1000);
    }
  }
  return typeof problem.retryAfterSeconds === 'number' ? problem.retryAfterSeconds : undefined;
}

/** The typed error for an error answer. */
export function errorFor(status: number, problem: Problem, retryAfterHeader: string | null): DiscoveryError {
  const message = String(problem.detail ?? problem.title ?? `HTTP ${status}`);
  const reason = typeof problem.reason === 'string' ? problem.reason : '';
  const retryAfter = retryAfterSeconds(retryAfterHeader, problem);
  switch (status) {
    case 503:
      return new Unavailable(message, { status, problem, reason, retryAfter });
    case 409:
      return new Conflict(message, { status, problem, reason, retryAfter });
    case 429:
      return new QuotaExceeded(message, { status, problem, reason, retryAfter });
    case 404:
      return new NotFound(message, { status, problem });
    case 410:
      return new Gone(message, { status, problem });
    case 401:
      return new Unauthorized(message, { status, problem });
    case 403:
      return new Forbidden(message, { status, problem });
    case 400:
      return new BadRequest(message, { status, problem });
    default:
      return new DiscoveryError(message, { status, problem });
  }
}
