/** The discovery API client and the lease it hands out. */

import { isIP } from 'node:net';
import { DecodeError, DiscoveryError, TransportError, Unavailable, errorFor, type Problem } from './errors.js';

/** How long one call may take, unless the client is given another timeout. */
export const DEFAULT_TIMEOUT_MS = 10_000;

/**
 * How long a call keeps retrying while the discovery Service has no serving replica (the operator changing leader:
 * a rolling restart, a drain, a crash): refused or dropped connections and `not-serving` answers. Twice the shipped
 * Lease duration, the bound of a takeover after a leader is killed.
 */
export const DEFAULT_FAILOVER_BUDGET_MS = 30_000;

const FIRST_PAUSE_MS = 50;
const MAX_PAUSE_MS = 250;

/** Socket errors of a Service without a serving replica: refused, or closed or reset before an answer. */
const NO_REPLICA = new Set(['ECONNREFUSED', 'ECONNRESET', 'EPIPE', 'UND_ERR_SOCKET', 'UND_ERR_CLOSED']);

function noReplica(error: unknown): boolean {
  const code = (error as { cause?: { code?: string } }).cause?.code;
  return typeof code === 'string' && NO_REPLICA.has(code);
}

/** Outcomes a report may carry. */
export const OUTCOMES = ['ok', 'banned', 'throttled', 'failed'] as const;
export type Outcome = (typeof OUTCOMES)[number];

/** A proxy's user name and password, not percent-encoded. */
export interface ProxyCredentials {
  username: string;
  password: string;
}

/** The proxy a lease is on. */
export interface LeasedProxy {
  namespace: string;
  name: string;
  host: string;
  port: number;
  /** `http://[user:password@]host:port`: give it to the HTTP client as its proxy. */
  url: string;
  /** The credentials in `url`, as fields: for a client that connects to the proxy itself. */
  credentials?: ProxyCredentials;
  /** The address sites see, once the proxy's probes observed it; proxies sharing it share cooldowns. */
  egressIP?: string;
  /** Its pace for one site, when paced: send one request per lease. */
  pacing?: Pacing;
}

/** A pace per (egress address, site): `burst` leases at once, then one per `intervalMilliseconds`. */
export interface Pacing {
  intervalMilliseconds: number;
  burst: number;
}

/** A proxy as `GET /v1/proxies` lists it. */
export interface ProxyInfo {
  namespace: string;
  name: string;
  host: string;
  port: number;
  url: string;
  labels: Record<string, string>;
  activeLeases: number;
  maxLeases: number;
  /** The address sites see requests through this proxy come from, once its probes observed it. */
  egressIP?: string;
  zone?: string;
  provider?: string;
  /** The ProxyPool it is a member of, in its namespace. */
  pool?: string;
  /** For the asked target: when its cooldown ends. */
  coolingDownUntil?: Date;
  /** For the asked target: the share of reported requests the proxy served, and over how many. */
  successRate?: number;
  reported?: number;
  /** How long a site's ban cools it down: `baseSeconds` after the first ban in a row, times `factor`, at most `maxSeconds`. */
  cooldownPolicy?: { baseSeconds: number; factor: number; maxSeconds: number };
  /** How often its egress address is leased for one site, when paced. */
  pacing?: Pacing;
}

/** A live cooldown: `proxy` is not leased for `target` until `until`. */
export interface CooldownInfo {
  proxy: string;
  target: string;
  until: Date;
  streak: number;
}

export interface LeaseOptions {
  /** A label selector the proxy must match, e.g. `region=eu`. */
  selector?: string;
  /** 1 to 3600 seconds; the server's default is 300. */
  ttlSeconds?: number;
  /** `namespace/name` of a specific proxy. */
  proxy?: string;
  /** A sticky-session key: the same proxy for the same (session, target) while it stays eligible. */
  session?: string;
  /**
   * The longest the session keeps one proxy, 1 to 86400 seconds from the lease that chose it: its first lease after
   * that goes to another proxy. Needs `session`.
   */
  sessionLifetimeSeconds?: number;
  /** The most leases the session takes on one proxy (1 to 1000000) before its next goes to another. Needs `session`. */
  sessionMaxLeases?: number;
  /**
   * Only members of this ProxyPool (its name, or `namespace/name`). A pool getting its first members answers
   * `Unavailable` with reason `scaling-up` and `retryAfter`.
   */
  pool?: string;
  /** Only proxies in this zone (a Proxy's `placement.zone`, as `proxies()` lists it). */
  zone?: string;
  /** Only proxies on this provider (a Managed Proxy's `provider`, as `proxies()` lists it). */
  provider?: string;
}

export interface Report {
  /** What the site did: `banned` for a block, `throttled` for a 429-like answer, `ok`, or `failed`. */
  outcome?: Outcome;
  /** The site's status code (informational). */
  statusCode?: number;
  /** With `throttled` only: the site's own `Retry-After`, in seconds. */
  retryAfterSeconds?: number;
  /** Requests served through the lease since the last report. */
  ok?: number;
  /** Requests that failed through the lease since the last report. */
  failed?: number;
  /** Also end the lease. */
  release?: boolean;
}

export interface ClientOptions {
  /** A bearer token (`lease` scope to lease; `read` can only list). */
  token?: string;
  /** Per call, in milliseconds (default 10 s). */
  timeoutMs?: number;
  /** The `fetch` to use (default: the global one). */
  fetch?: typeof fetch;
  /**
   * How long each call keeps retrying while no replica serves, in milliseconds (default 30 s; 0 turns retrying off).
   * A lease whose answer was lost when its leader was killed stays held, unknown to the caller, until its TTL.
   */
  failoverBudgetMs?: number;
}

type Json = Record<string, unknown>;

const LABEL = /^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$/;

/** Refuses a target that is no host name, IP address or http(s) URL, saying what is wrong, before anything is sent
 * (the server refuses it too). International names are left to the server, which parses them as a browser does. */
function checkTarget(target: unknown): string {
  if (typeof target !== 'string' || target.trim() === '') {
    throw new TypeError('lease: target must be a host, an IP address or a URL');
  }
  const text = target.trim();
  if (text.length > 2048) throw new TypeError('lease: target is longer than 2048 characters');
  const bad = (why: string) => new TypeError(`lease: target ${JSON.stringify(text)}: ${why}`);
  let host: string;
  if (text.includes('://')) {
    let url: URL;
    try {
      url = new URL(text);
    } catch {
      throw bad('not a valid URL');
    }
    if (url.protocol !== 'http:' && url.protocol !== 'https:') throw bad(`only http and https URLs are targets, not ${url.protocol}`);
    host = url.hostname;
  } else {
    const authority = text.split(/[/?#]/, 1)[0];
    if (isIP(authority.replace(/^\[|\]$/g, ''))) return target;
    // Labels as given: the URL parser would turn '-bad-.com' into something else silently.
    host = authority.replace(/:\d*$/, '');
  }
  host = host.replace(/^\[|\]$/g, '');
  if (host === '') throw bad('it has no host');
  if (isIP(host)) return target;
  for (const label of host.replace(/\.$/, '').split('.')) {
    if (/^[\x00-\x7f]*$/.test(label) && !LABEL.test(label)) {
      throw bad(`${JSON.stringify(label)} is not a DNS label (letters, digits, '-' and '_', at most 63, neither starting nor ending with '-')`);
    }
  }
  return target;
}

function isObject(value: unknown): value is Json {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function field<T>(body: Json, key: string, kind: 'string' | 'number', what: string): T {
  const value = body[key];
  if (typeof value !== kind) {
    throw new DecodeError(`not ${what}: \`${key}\` is ${JSON.stringify(value)}, expected a ${kind}`);
  }
  return value as T;
}

function optional<T>(body: Json, key: string, kind: 'string' | 'number', what: string): T | undefined {
  return body[key] == null ? undefined : field<T>(body, key, kind, what);
}

function time(body: Json, key: string, what: string): Date {
  const text = field<string>(body, key, 'string', what);
  const date = new Date(text);
  if (Number.isNaN(date.getTime())) {
    throw new DecodeError(`not ${what}: \`${key}\` ${JSON.stringify(text)} is not an RFC 3339 timestamp`);
  }
  return date;
}

/** The fields a lease's proxy and a listed proxy share. */
function proxyRef(body: Json, what: string): LeasedProxy {
  const proxy: LeasedProxy = {
    namespace: field(body, 'namespace', 'string', what),
    name: field(body, 'name', 'string', what),
    host: field(body, 'host', 'string', what),
    port: field(body, 'port', 'number', what),
    url: field(body, 'url', 'string', what),
  };
  const egressIP = optional<string>(body, 'egressIP', 'string', what);
  if (egressIP !== undefined) proxy.egressIP = egressIP;
  if (body.pacing != null) proxy.pacing = pacing(body.pacing, what);
  return proxy;
}

function pacing(body: unknown, what: string): Pacing {
  if (!isObject(body)) {
    throw new DecodeError(`not ${what}: \`pacing\` is ${JSON.stringify(body)}`);
  }
  const where = `${what}'s pacing`;
  return {
    intervalMilliseconds: field(body, 'intervalMilliseconds', 'number', where),
    burst: field(body, 'burst', 'number', where),
  };
}

function leasedProxy(body: unknown): LeasedProxy {
  if (!isObject(body)) {
    throw new DecodeError(`not a lease: \`proxy\` is ${JSON.stringify(body)}`);
  }
  const proxy = proxyRef(body, 'a lease');
  const credentials = body['credentials'];
  if (credentials != null) {
    if (!isObject(credentials)) {
      throw new DecodeError('not a lease: `proxy.credentials` is not an object');
    }
    proxy.credentials = {
      username: field(credentials, 'username', 'string', "a lease's proxy credentials"),
      password: field(credentials, 'password', 'string', "a lease's proxy credentials"),
    };
  }
  return proxy;
}

interface LeaseState {
  id: string;
  proxy: LeasedProxy;
  target: string;
  expiresAt: Date;
  /** For a session with `sessionLifetimeSeconds`: how long, from the answer, it keeps this proxy. */
  sessionEndsInMilliseconds?: number;
}

function leaseState(body: unknown): LeaseState {
  if (!isObject(body)) {
    throw new DecodeError(`not a lease: ${JSON.stringify(body)}`);
  }
  const state: LeaseState = {
    id: field(body, 'id', 'string', 'a lease'),
    proxy: leasedProxy(body.proxy),
    target: field(body, 'target', 'string', 'a lease'),
    expiresAt: time(body, 'expiresAt', 'a lease'),
  };
  const endsIn = optional<number>(body, 'sessionEndsInMilliseconds', 'number', 'a lease');
  if (endsIn !== undefined) state.sessionEndsInMilliseconds = endsIn;
  return state;
}

function proxyInfo(body: unknown): ProxyInfo {
  if (!isObject(body)) {
    throw new DecodeError(`not a proxy: ${JSON.stringify(body)}`);
  }
  const labels = body.labels ?? {};
  if (!isObject(labels) || Object.values(labels).some((value) => typeof value !== 'string')) {
    throw new DecodeError(`not a proxy: \`labels\` is ${JSON.stringify(labels)}`);
  }
  const info: ProxyInfo = {
    ...proxyRef(body, 'a proxy'),
    labels: labels as Record<string, string>,
    activeLeases: field(body, 'activeLeases', 'number', 'a proxy'),
    maxLeases: field(body, 'maxLeases', 'number', 'a proxy'),
  };
  const zone = optional<string>(body, 'zone', 'string', 'a proxy');
  const provider = optional<string>(body, 'provider', 'string', 'a proxy');
  const pool = optional<string>(body, 'pool', 'string', 'a proxy');
  const successRate = optional<number>(body, 'successRate', 'number', 'a proxy');
  const reported = optional<number>(body, 'reported', 'number', 'a proxy');
  if (zone !== undefined) info.zone = zone;
  if (provider !== undefined) info.provider = provider;
  if (pool !== undefined) info.pool = pool;
  if (body.coolingDownUntil != null) info.coolingDownUntil = time(body, 'coolingDownUntil', 'a proxy');
  if (successRate !== undefined) info.successRate = successRate;
  if (reported !== undefined) info.reported = reported;
  if (body.cooldownPolicy != null) info.cooldownPolicy = cooldownPolicy(body.cooldownPolicy);
  return info;
}

function cooldownPolicy(body: unknown): NonNullable<ProxyInfo['cooldownPolicy']> {
  if (!isObject(body)) {
    throw new DecodeError(`not a proxy: \`cooldownPolicy\` is ${JSON.stringify(body)}`);
  }
  const what = "a proxy's cooldownPolicy";
  return {
    baseSeconds: field(body, 'baseSeconds', 'number', what),
    factor: field(body, 'factor', 'number', what),
    maxSeconds: field(body, 'maxSeconds', 'number', what),
  };
}

function cooldownInfo(body: unknown): CooldownInfo {
  if (!isObject(body)) {
    throw new DecodeError(`not a cooldown: ${JSON.stringify(body)}`);
  }
  return {
    proxy: field(body, 'proxy', 'string', 'a cooldown'),
    target: field(body, 'target', 'string', 'a cooldown'),
    until: time(body, 'until', 'a cooldown'),
    streak: field(body, 'streak', 'number', 'a cooldown'),
  };
}

function list<T>(answer: unknown, key: string, parse: (entry: unknown) => T): T[] {
  const entries = isObject(answer) ? answer[key] : undefined;
  if (!Array.isArray(entries)) {
    throw new DecodeError(`expected {"${key}": [...]}, got ${JSON.stringify(answer)}`);
  }
  return entries.map(parse);
}

function ttl(seconds: number | undefined, where: string): number | undefined {
  if (seconds === undefined) {
    return undefined;
  }
  if (!Number.isFinite(seconds) || seconds <= 0) {
    throw new RangeError(`${where}: ttlSeconds must be a positive number of seconds, not ${seconds}`);
  }
  return Math.max(1, Math.round(seconds));
}

function count(value: number | undefined, name: string): number | undefined {
  if (value === undefined || value === 0) {
    return undefined;
  }
  if (!Number.isInteger(value) || value < 0) {
    throw new RangeError(`report: ${name} must be a count (a non-negative integer), not ${value}`);
  }
  return value;
}

/** The body of a report, checked: what is wrong is said before anything is sent. */
export function reportBody(report: Report): Json {
  const body: Json = {};
  if (report.outcome !== undefined) {
    if (!OUTCOMES.includes(report.outcome)) {
      throw new RangeError(`report: outcome must be one of ${OUTCOMES.join(', ')}, not ${JSON.stringify(report.outcome)}`);
    }
    body.outcome = report.outcome;
  }
  if (report.statusCode !== undefined) {
    if (!Number.isInteger(report.statusCode) || report.statusCode < 100 || report.statusCode > 599) {
      throw new RangeError(`report: statusCode must be an HTTP status (100-599), not ${report.statusCode}`);
    }
    body.statusCode = report.statusCode;
  }
  if (report.retryAfterSeconds !== undefined) {
    if (report.outcome !== 'throttled') {
      throw new RangeError("report: retryAfterSeconds goes only with outcome 'throttled'");
    }
    if (!Number.isFinite(report.retryAfterSeconds) || report.retryAfterSeconds < 0) {
      throw new RangeError(`report: retryAfterSeconds must be a number of seconds, not ${report.retryAfterSeconds}`);
    }
    body.retryAfterSeconds = Math.min(86_400, Math.max(1, Math.round(report.retryAfterSeconds)));
  }
  const ok = count(report.ok, 'ok');
  const failed = count(report.failed, 'failed');
  if (ok !== undefined) body.ok = ok;
  if (failed !== undefined) body.failed = failed;
  if (report.release) body.release = true;
  if (body.outcome === undefined && ok === undefined && failed === undefined) {
    throw new RangeError('report: a report needs an outcome, counts (ok, failed), or both');
  }
  return body;
}

/** A held lease. Reuse it for many requests to its site; `release()` it (or let `withLease` do it) when done. */
export class Lease {
  #client: DiscoveryClient;
  #state: LeaseState;
  #released = false;

  /** @internal */
  constructor(client: DiscoveryClient, state: LeaseState) {
    this.#client = client;
    this.#state = state;
  }

  /** The latest ID of the lease (renewing gives a new one; earlier ones keep naming the same lease). */
  get id(): string {
    return this.#state.id;
  }

  /** `http://[user:password@]host:port`, for the HTTP client's proxy setting. */
  get proxyUrl(): string {
    return this.#state.proxy.url;
  }

  /** The proxy, `namespace/name`. */
  get proxy(): string {
    return `${this.#state.proxy.namespace}/${this.#state.proxy.name}`;
  }

  /** The address sites see requests through the proxy come from (proxies sharing it share cooldowns). */
  get egressIP(): string | undefined {
    return this.#state.proxy.egressIP;
  }

  /** For a session with `sessionLifetimeSeconds`: how long, from the lease's answer, the session keeps this proxy. */
  get sessionEndsInMilliseconds(): number | undefined {
    return this.#state.sessionEndsInMilliseconds;
  }

  /** The proxy's namespace, name, host, port, URL and egress address. */
  get leasedProxy(): LeasedProxy {
    return { ...this.#state.proxy };
  }

  /** The normalised target (site). */
  get target(): string {
    return this.#state.target;
  }

  /** When the lease expires unless renewed. */
  get expiresAt(): Date {
    return this.#state.expiresAt;
  }

  /** Whether `release()` (or a report with `release`) ended it. */
  get released(): boolean {
    return this.#released;
  }

  /**
   * Extends the lease. Resolves to whether the proxy's instance was replaced since this lease last heard of it: then
   * `proxyUrl` changed, and requests must go to the new URL from now on.
   */
  async renew(ttlSeconds?: number): Promise<boolean> {
    const seconds = ttl(ttlSeconds, 'renew');
    const answer = await this.#client.call('POST', `/v1/leases/${encodeURIComponent(this.id)}/renew`, seconds === undefined ? {} : { ttlSeconds: seconds });
    this.#state = leaseState(answer);
    return isObject(answer) && answer.replaced === true;
  }

  /**
   * Reports an outcome, counts of requests since the last report, or both. Resolves to the cooldown's end for a ban or
   * a throttle.
   */
  async report(report: Report): Promise<Date | undefined> {
    const body = reportBody(report);
    const answer = await this.#client.call('POST', `/v1/leases/${encodeURIComponent(this.id)}/report`, body);
    if (report.release) {
      this.#released = true;
    }
    return isObject(answer) && typeof answer.cooldownUntil === 'string' ? time(answer, 'cooldownUntil', 'a report answer') : undefined;
  }

  /** Counts of requests made through the lease since the last report; starts no cooldown. Nothing to send: no call. */
  async reportCounts(ok = 0, failed = 0): Promise<void> {
    if (ok || failed) {
      await this.report({ ok, failed });
    }
  }

  /** Ends the lease now. Releasing twice, or a lease a report already ended, does nothing. */
  async release(): Promise<void> {
    if (this.#released) {
      return;
    }
    this.#released = true;
    await this.#client.call('DELETE', `/v1/leases/${encodeURIComponent(this.id)}`, undefined);
  }

  /** `await using lease = await client.lease(...)` (where the runtime has it) releases on scope exit. */
  async [Symbol.asyncDispose ?? Symbol.for('Symbol.asyncDispose')](): Promise<void> {
    try {
      await this.release();
    } catch (error) {
      // The lease expires by its TTL anyway; leaving the scope must not fail because of it.
      if (!(error instanceof DiscoveryError)) throw error;
    }
  }
}

/** A client for the discovery API, on `fetch`. */
export class DiscoveryClient {
  readonly baseUrl: string;
  #headers: Record<string, string>;
  #timeoutMs: number;
  #failoverBudgetMs: number;
  #fetch: typeof fetch;

  constructor(baseUrl: string, options: ClientOptions = {}) {
    if (!/^https?:\/\//.test(baseUrl)) {
      throw new TypeError(`the discovery URL must be http:// or https://, not ${JSON.stringify(baseUrl)}`);
    }
    this.baseUrl = baseUrl.replace(/\/+$/, '');
    this.#headers = { accept: 'application/json' };
    if (options.token) {
      this.#headers.authorization = `Bearer ${options.token}`;
    }
    this.#timeoutMs = options.timeoutMs ?? DEFAULT_TIMEOUT_MS;
    this.#failoverBudgetMs = options.failoverBudgetMs ?? DEFAULT_FAILOVER_BUDGET_MS;
    if (!Number.isFinite(this.#failoverBudgetMs) || this.#failoverBudgetMs < 0) {
      throw new RangeError(`failoverBudgetMs must be a number of milliseconds, not ${options.failoverBudgetMs}`);
    }
    this.#fetch = options.fetch ?? globalThis.fetch;
    if (typeof this.#fetch !== 'function') {
      throw new TypeError('no fetch: Node 18 or newer has one; pass options.fetch elsewhere');
    }
  }

  /** @internal One call: the JSON of a success, or the typed error of a failure; retried during a change of leader. */
  async call(method: string, path: string, body: Json | undefined, query?: Record<string, string | undefined>): Promise<unknown> {
    const deadline = Date.now() + this.#failoverBudgetMs;
    let pause = FIRST_PAUSE_MS;
    for (;;) {
      try {
        return await this.#callOnce(method, path, body, query);
      } catch (error) {
        const retry = error instanceof TransportError ? noReplica(error.cause) : error instanceof Unavailable && error.reason === 'not-serving';
        if (!retry || Date.now() + pause > deadline) throw error;
      }
      await new Promise((resolve) => setTimeout(resolve, pause));
      pause = Math.min(pause * 2, MAX_PAUSE_MS);
    }
  }

  async #callOnce(method: string, path: string, body: Json | undefined, query?: Record<string, string | undefined>): Promise<unknown> {
    const url = new URL(this.baseUrl + path);
    for (const [key, value] of Object.entries(query ?? {})) {
      if (value) url.searchParams.set(key, value);
    }
    const headers = { ...this.#headers };
    if (body !== undefined) headers['content-type'] = 'application/json';
    let response: Response;
    let text: string;
    try {
      response = await this.#fetch(url, {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        signal: AbortSignal.timeout(this.#timeoutMs),
      });
      text = await response.text();
    } catch (error) {
      const cause = (error as { cause?: { code?: string; message?: string } }).cause;
      const why = cause?.code ?? cause?.message ?? (error as Error).message;
      throw new TransportError(`${method} ${path}: ${why}`, { cause: error });
    }
    if (response.status === 204) {
      return undefined;
    }
    let parsed: unknown;
    try {
      parsed = text === '' ? {} : JSON.parse(text);
    } catch {
      parsed = undefined;
    }
    if (response.ok) {
      if (parsed === undefined) {
        throw new DecodeError(`the answer to ${method} ${path} is not JSON`, { status: response.status });
      }
      return parsed;
    }
    const problem: Problem = isObject(parsed) ? (parsed as Problem) : { detail: text.slice(0, 200) };
    throw errorFor(response.status, problem, response.headers.get('retry-after'));
  }

  /** Leases a proxy for `target` (a host, an IP address or a URL). */
  async lease(target: string, options: LeaseOptions = {}): Promise<Lease> {
    const body: Json = { target: checkTarget(target) };
    if (options.selector) body.selector = options.selector;
    const seconds = ttl(options.ttlSeconds, 'lease');
    if (seconds !== undefined) body.ttlSeconds = seconds;
    if (options.proxy) body.proxy = options.proxy;
    if (options.session) body.session = options.session;
    for (const [key, most] of [['sessionLifetimeSeconds', 86_400], ['sessionMaxLeases', 1_000_000]] as const) {
      const value = options[key];
      if (value === undefined) continue;
      if (!options.session || !Number.isInteger(value) || value < 1 || value > most) {
        throw new RangeError(`lease: ${key} ${value} must be a whole number from 1 to ${most}, with a session`);
      }
      body[key] = value;
    }
    if (options.pool !== undefined) {
      if (typeof options.pool !== 'string' || !/^[^\s/]+(\/[^\s/]+)?$/.test(options.pool)) {
        throw new TypeError(`lease: pool ${JSON.stringify(options.pool)} must be a ProxyPool's name or namespace/name`);
      }
      body.pool = options.pool;
    }
    for (const key of ['zone', 'provider'] as const) {
      const value = options[key];
      if (value === undefined) continue;
      if (typeof value !== 'string' || value.length < 1 || value.length > 253) {
        throw new TypeError(`lease: ${key} ${JSON.stringify(value)} must be 1 to 253 characters`);
      }
      body[key] = value;
    }
    return new Lease(this, leaseState(await this.call('POST', '/v1/leases', body)));
  }

  /** Leases a proxy, runs `use` with the lease, and releases it however `use` ends. */
  async withLease<T>(target: string, options: LeaseOptions, use: (lease: Lease) => Promise<T>): Promise<T> {
    const lease = await this.lease(target, options);
    try {
      return await use(lease);
    } finally {
      try {
        await lease.release();
      } catch (error) {
        // The lease expires by its TTL anyway; an error from `use` must not be hidden by this one.
        if (!(error instanceof DiscoveryError)) throw error;
      }
    }
  }

  /** Picks a lease up by its ID (kept across the crawler's own restart): renews it and returns it. */
  async resume(leaseId: string, ttlSeconds?: number): Promise<Lease> {
    const seconds = ttl(ttlSeconds, 'resume');
    const answer = await this.call('POST', `/v1/leases/${encodeURIComponent(leaseId)}/renew`, seconds === undefined ? {} : { ttlSeconds: seconds });
    return new Lease(this, leaseState(answer));
  }

  /** Healthy proxies matching `selector`; with `target`, each one's cooldown and success rate for it. */
  async proxies(options: { selector?: string; target?: string; pool?: string } = {}): Promise<ProxyInfo[]> {
    const query = { selector: options.selector, target: options.target, pool: options.pool };
    const answer = await this.call('GET', '/v1/proxies', undefined, query);
    return list(answer, 'proxies', proxyInfo);
  }

  /** Live cooldowns, for one target or all. */
  async cooldowns(target?: string): Promise<CooldownInfo[]> {
    return list(await this.call('GET', '/v1/cooldowns', undefined, { target }), 'cooldowns', cooldownInfo);
  }

  /**
   * Ends the cooldowns for `target` now and forgets their streaks (an `admin` token): of `proxy` (`namespace/name`)
   * and the proxies sharing its egress IP, or of every proxy. Returns the ones that were running.
   */
  async clearCooldowns(target: string, options: { proxy?: string } = {}): Promise<CooldownInfo[]> {
    const answer = await this.call('DELETE', '/v1/cooldowns', undefined, { target, proxy: options.proxy });
    return list(answer, 'cleared', cooldownInfo);
  }
}
