/**
 * crawlee integration: a `ProxyConfiguration` that leases every request's proxy from egress-operator, and the hooks
 * that tell egress-operator what the site did.
 *
 * ```ts
 * const egress = new EgressProxyConfiguration({ url: 'http://egress-discovery.egress-system:8090', token });
 * const crawler = new CheerioCrawler({ ...egress.crawlerOptions(), sessionPoolOptions: { maxPoolSize: 8 }, requestHandler });
 * await crawler.run(['https://shop.example.com/']);
 * await egress.close();
 * ```
 *
 * One lease is kept per (site, crawlee session) and reused for every request of that session to that site: renewed
 * before it expires (a renew that says the proxy's instance was replaced switches to the new URL), released when the
 * session retires. So the session pool's size is how many proxies one site gets at once. The post-navigation hook
 * reads every answer: a ban code (403, and any other status the session pool retires sessions on) is reported
 * `banned` and a throttle code (429) `throttled` with the site's `Retry-After`, the lease (and every other lease for
 * that site on that proxy, or on one leaving through the same address) is dropped, and the request is retried: a ban
 * as a crawlee `SessionError` (the session retires, the request goes again on a new session and a new lease), a
 * throttle as a `RetryRequestError` (same session, new lease, at most `maxRetries` times). Other answers are counted
 * `ok` and requests that got no answer `failed`, reported in batches of `reportEvery`. A `SessionError` from
 * elsewhere (crawlee's own block detection, or your handler) is reported `banned` by the error handlers. When no proxy
 * can be leased now (503 with Retry-After), the request waits that long, up to `maxWaitSeconds` in all.
 */

import { ProxyConfiguration, RetryRequestError, SessionError, type Request, type Session } from '@crawlee/core';

import { DiscoveryClient, type Lease, type Report } from './client.js';
import { DiscoveryError, Gone, NotFound, Unavailable, retryAfterSeconds } from './errors.js';
import { gatewayProxyUrl, reportToGateway, type GatewayOptions } from './gateway.js';

export interface EgressProxyConfigurationOptions {
  /** The discovery API's URL (or pass `client`). */
  url?: string;
  /** A `lease`-scope token. */
  token?: string;
  /** A client to use instead of `url` and `token`. */
  client?: DiscoveryClient;
  /** A label selector every proxy must match, e.g. `region=eu`. */
  selector?: string;
  /** Only members of this ProxyPool (its name, or `namespace/name`); while it scales up, requests wait. */
  pool?: string;
  /** Answers reported `banned` (default `[403]`). */
  banCodes?: number[];
  /** Answers reported `throttled` with their `Retry-After` (default `[429]`). */
  throttleCodes?: number[];
  /** Lease TTL in seconds (default 300); leases are renewed when a third of it is left. */
  ttlSeconds?: number;
  /** Report counts after this many requests through a lease (default 20). */
  reportEvery?: number;
  /** How long one request may wait in all for a proxy when none can be leased now (default 600 s). */
  maxWaitSeconds?: number;
  /** How often one request is retried after throttles (default 5); then it fails like any other error. */
  maxRetries?: number;
}

/** What the adapter did, for logs and assertions. */
export interface EgressStats {
  leases: number;
  renewals: number;
  replaced: number;
  released: number;
  ok: number;
  failed: number;
  bans: number;
  throttles: number;
  /** Waits for a proxy, by the API's reason (`all-cooling-down`, `all-at-capacity`, `none-healthy`, ...). */
  waits: Record<string, number>;
  /** Reports or releases the API refused or that did not reach it (the lease then ends by its TTL). */
  reportErrors: number;
}

/** The part of crawlee's crawling context the hooks read (HTTP and browser crawlers alike). */
export interface EgressCrawlingContext {
  request: Request;
  session?: Session;
  response?: unknown;
}

/** A refusal the post-navigation hook reported: the error handlers leave it alone. */
export class EgressBlockedError extends SessionError {}

/** A throttle the post-navigation hook reported; the request is retried on another lease. */
export class EgressThrottledError extends RetryRequestError {}

class Held {
  ok = 0;
  failed = 0;
  dropped = false;

  constructor(
    readonly key: string,
    readonly session: string | undefined,
    readonly lease: Lease,
  ) {}
}

interface Attempt {
  held: Held;
  /** The answer (or its absence) was counted. */
  counted: boolean;
  status?: number;
}

const RETRIES = '__egressThrottles';

function statusOf(response: unknown): number | undefined {
  const value = response as { statusCode?: unknown; status?: unknown } | undefined;
  if (typeof value?.statusCode === 'number') return value.statusCode;
  if (typeof value?.status === 'function') return Number((value.status as () => unknown).call(response));
  if (typeof value?.status === 'number') return value.status;
  return undefined;
}

function headerOf(response: unknown, name: string): string | undefined {
  const value = response as { headers?: unknown } | undefined;
  const headers = typeof value?.headers === 'function' ? (value.headers as () => unknown).call(response) : value?.headers;
  if (headers && typeof (headers as { get?: unknown }).get === 'function') {
    return (headers as { get(name: string): string | null }).get(name) ?? undefined;
  }
  const found = (headers as Record<string, unknown> | undefined)?.[name];
  return Array.isArray(found) ? String(found[0]) : typeof found === 'string' ? found : undefined;
}

/** The statuses the session's pool retires sessions on (`sessionPoolOptions.blockedStatusCodes`). */
function blockedBy(session: Session | undefined): number[] {
  const codes = (session as unknown as { sessionPool?: { blockedStatusCodes?: unknown } } | undefined)?.sessionPool?.blockedStatusCodes;
  return Array.isArray(codes) ? codes.filter((code): code is number => typeof code === 'number') : [];
}

function codes(list: number[] | undefined, fallback: number[], name: string): Set<number> {
  const chosen = list ?? fallback;
  for (const code of chosen) {
    if (!Number.isInteger(code) || code < 100 || code > 599) {
      throw new RangeError(`EgressProxyConfiguration: ${name} must hold HTTP statuses (100-599), not ${code}`);
    }
  }
  return new Set(chosen);
}

function positive(value: number | undefined, fallback: number, name: string): number {
  const chosen = value ?? fallback;
  if (!Number.isFinite(chosen) || chosen < 0) {
    throw new RangeError(`EgressProxyConfiguration: ${name} must be a non-negative number, not ${chosen}`);
  }
  return chosen;
}

/** A crawlee `ProxyConfiguration` whose proxies are egress-operator leases. See the module's documentation. */
export class EgressProxyConfiguration extends ProxyConfiguration {
  readonly client: DiscoveryClient;
  readonly stats: EgressStats = {
    leases: 0,
    renewals: 0,
    replaced: 0,
    released: 0,
    ok: 0,
    failed: 0,
    bans: 0,
    throttles: 0,
    waits: {},
    reportErrors: 0,
  };
  readonly #selector: string | undefined;
  readonly #pool: string | undefined;
  readonly #banCodes: Set<number>;
  readonly #throttleCodes: Set<number>;
  readonly #ttl: number;
  readonly #reportEvery: number;
  readonly #maxWait: number;
  readonly #maxRetries: number;
  readonly #held = new Map<string, Held>();
  readonly #attempts = new WeakMap<Request, Attempt>();
  readonly #locks = new Map<string, Promise<void>>();
  readonly #pools = new WeakSet<object>();
  #closed = false;

  constructor(options: EgressProxyConfigurationOptions) {
    let self: EgressProxyConfiguration | undefined;
    super({ newUrlFunction: (sessionId, context) => self!.#urlFor(sessionId, context?.request) });
    self = this;
    if (options.client) {
      this.client = options.client;
    } else if (options.url) {
      this.client = new DiscoveryClient(options.url, options.token === undefined ? {} : { token: options.token });
    } else {
      throw new TypeError('EgressProxyConfiguration: give the discovery API as `url` (and `token`), or a `client`');
    }
    this.#selector = options.selector;
    this.#pool = options.pool;
    this.#banCodes = codes(options.banCodes, [403], 'banCodes');
    this.#throttleCodes = codes(options.throttleCodes, [429], 'throttleCodes');
    this.#ttl = Math.max(1, Math.round(positive(options.ttlSeconds, 300, 'ttlSeconds')));
    this.#reportEvery = Math.max(1, Math.round(positive(options.reportEvery, 20, 'reportEvery')));
    this.#maxWait = positive(options.maxWaitSeconds, 600, 'maxWaitSeconds');
    this.#maxRetries = Math.round(positive(options.maxRetries, 5, 'maxRetries'));
  }

  /**
   * The crawler options that wire the adapter in: spread them into an `HttpCrawler`/`CheerioCrawler` (or a browser
   * crawler). With your own `errorHandler` or `failedRequestHandler`, call the adapter's from it.
   */
  crawlerOptions(): {
    proxyConfiguration: EgressProxyConfiguration;
    postNavigationHooks: Array<(context: EgressCrawlingContext) => Promise<void>>;
    errorHandler: (context: EgressCrawlingContext, error: Error) => Promise<void>;
    failedRequestHandler: (context: EgressCrawlingContext, error: Error) => Promise<void>;
  } {
    return {
      proxyConfiguration: this,
      postNavigationHooks: [this.postNavigationHook],
      errorHandler: this.errorHandler,
      failedRequestHandler: this.failedRequestHandler,
    };
  }

  /** Reads the site's answer: counts it, or reports a ban or throttle and retries the request on another lease. */
  readonly postNavigationHook = async (context: EgressCrawlingContext): Promise<void> => {
    this.#watch(context.session);
    const attempt = this.#attempts.get(context.request);
    const status = statusOf(context.response);
    if (attempt === undefined || status === undefined) return;
    attempt.counted = true;
    attempt.status = status;
    const held = attempt.held;
    if (this.#banCodes.has(status) || (!this.#throttleCodes.has(status) && blockedBy(context.session).includes(status))) {
      await this.#refuse(held, { outcome: 'banned', statusCode: status });
      throw new EgressBlockedError(`the site answered ${status} through proxy ${held.lease.proxy}: reported banned`);
    }
    if (this.#throttleCodes.has(status)) {
      const retryAfter = retryAfterSeconds(headerOf(context.response, 'retry-after'), {});
      await this.#refuse(held, retryAfter === undefined ? { outcome: 'throttled', statusCode: status } : { outcome: 'throttled', statusCode: status, retryAfterSeconds: retryAfter });
      const userData = context.request.userData as Record<string, unknown>;
      const tries = Number(userData[RETRIES] ?? 0) + 1;
      userData[RETRIES] = tries;
      const message = `the site answered ${status} through proxy ${held.lease.proxy}: reported throttled`;
      if (tries > this.#maxRetries) {
        throw new Error(`${message}, and the request was throttled ${tries} times`);
      }
      throw new EgressThrottledError(message);
    }
    if (!held.dropped) {
      held.ok += 1;
      this.stats.ok += 1;
      if (held.ok + held.failed >= this.#reportEvery) await this.#flush(held);
    }
  };

  /** For crawlee's `errorHandler`: counts a request that got no answer as `failed`; a `SessionError` as `banned`. */
  readonly errorHandler = async (context: EgressCrawlingContext, error: Error): Promise<void> => {
    this.#watch(context.session);
    if (error instanceof EgressBlockedError || error instanceof EgressThrottledError) return;
    const attempt = this.#attempts.get(context.request);
    if (attempt === undefined) return;
    const held = attempt.held;
    if (error instanceof SessionError) {
      // crawlee (or the request handler) found the page blocked even though it answered: a ban, not a success.
      if (attempt.counted && !held.dropped && held.ok > 0) {
        held.ok -= 1;
        this.stats.ok -= 1;
      }
      attempt.counted = true;
      await this.#refuse(held, attempt.status === undefined ? { outcome: 'banned' } : { outcome: 'banned', statusCode: attempt.status });
      return;
    }
    if (!attempt.counted && !held.dropped) {
      attempt.counted = true;
      held.failed += 1;
      this.stats.failed += 1;
    }
  };

  /** For crawlee's `failedRequestHandler` (a request out of retries): as `errorHandler`. */
  readonly failedRequestHandler = async (context: EgressCrawlingContext, error: Error): Promise<void> => {
    await this.errorHandler(context, error);
  };

  /** Reports every lease's counts and releases it. Call it when the crawl is over. */
  async close(): Promise<void> {
    this.#closed = true;
    await Promise.all([...this.#held.values()].map((held) => this.#drop(held)));
  }

  /** How many leases are held now. */
  get heldLeases(): number {
    return this.#held.size;
  }

  async #urlFor(sessionId: string | number | undefined, request: Request | undefined): Promise<string> {
    if (request === undefined) {
      throw new TypeError('EgressProxyConfiguration leases for a site: newUrl needs the request (crawlers pass it)');
    }
    if (this.#closed) {
      throw new Error('EgressProxyConfiguration is closed: make a new one for another crawl');
    }
    const site = new URL(request.url).hostname.toLowerCase();
    const session = sessionId === undefined || sessionId === null ? undefined : String(sessionId);
    const key = `${site}\u0000${session ?? ''}`;
    const held = await this.#serialised(key, () => this.#leaseFor(key, session, request.url));
    this.#attempts.set(request, { held, counted: false });
    return held.lease.proxyUrl;
  }

  async #serialised<T>(key: string, run: () => Promise<T>): Promise<T> {
    const before = this.#locks.get(key) ?? Promise.resolve();
    let done!: () => void;
    const mine = before.then(() => new Promise<void>((resolve) => (done = resolve)));
    this.#locks.set(key, mine);
    await before;
    try {
      return await run();
    } finally {
      done();
      if (this.#locks.get(key) === mine) this.#locks.delete(key);
    }
  }

  async #leaseFor(key: string, session: string | undefined, url: string): Promise<Held> {
    let held = this.#held.get(key);
    if (held !== undefined && held.lease.expiresAt.getTime() - Date.now() < (this.#ttl * 1000) / 3) {
      try {
        if (await held.lease.renew(this.#ttl)) this.stats.replaced += 1;
        this.stats.renewals += 1;
      } catch (error) {
        if (!(error instanceof NotFound || error instanceof Gone)) throw error;
        this.#forget(held);
        held = undefined;
      }
    }
    if (held !== undefined) return held;
    let waited = 0;
    for (;;) {
      try {
        const options = {
          ttlSeconds: this.#ttl,
          ...(this.#selector ? { selector: this.#selector } : {}),
          ...(this.#pool ? { pool: this.#pool } : {}),
          ...(session ? { session } : {}),
        };
        const lease = await this.client.lease(url, options);
        this.stats.leases += 1;
        held = new Held(key, session, lease);
        this.#held.set(key, held);
        return held;
      } catch (error) {
        if (!(error instanceof Unavailable)) throw error;
        const wait = error.retryAfter ?? 5;
        if (waited + wait > this.#maxWait) throw error;
        const reason = error.reason || 'unavailable';
        this.stats.waits[reason] = (this.stats.waits[reason] ?? 0) + 1;
        await new Promise((resolve) => setTimeout(resolve, wait * 1000));
        waited += wait;
      }
    }
  }

  #forget(held: Held): void {
    held.dropped = true;
    if (this.#held.get(held.key) === held) this.#held.delete(held.key);
  }

  /** Reports what `held` has not reported yet, with `extra` (an outcome), and releases it. */
  async #drop(held: Held, extra?: Report): Promise<void> {
    this.#forget(held);
    const ok = held.ok;
    const failed = held.failed;
    held.ok = 0;
    held.failed = 0;
    try {
      if (ok || failed || extra?.outcome) {
        await held.lease.report({ ...extra, ok, failed, release: true });
      } else {
        await held.lease.release();
      }
      this.stats.released += 1;
    } catch (error) {
      if (!(error instanceof DiscoveryError)) throw error;
      this.stats.reportErrors += 1;
    }
  }

  async #flush(held: Held): Promise<void> {
    const ok = held.ok;
    const failed = held.failed;
    held.ok = 0;
    held.failed = 0;
    try {
      await held.lease.reportCounts(ok, failed);
    } catch (error) {
      if (!(error instanceof DiscoveryError)) throw error;
      this.stats.reportErrors += 1;
    }
  }

  /** The site refused the proxy behind `held`: reported once, and every lease on that proxy for that site dropped. */
  async #refuse(held: Held, report: Report): Promise<void> {
    if (held.dropped) return; // A request already in flight on it answered first, and was reported.
    if (report.outcome === 'banned') this.stats.bans += 1;
    else this.stats.throttles += 1;
    // The site refused the proxy, or the address it leaves through, which other proxies may share (the server cools
    // them down together): every lease the crawl holds for the site through either is refused too.
    const sameExit = (other: Held) =>
      other.lease.proxy === held.lease.proxy || (held.lease.egressIP !== undefined && other.lease.egressIP === held.lease.egressIP);
    const siblings = [...this.#held.values()].filter(
      (other) => other !== held && other.lease.target === held.lease.target && sameExit(other),
    );
    siblings.forEach((other) => this.#forget(other));
    await Promise.all([this.#drop(held, report), ...siblings.map((other) => this.#drop(other))]);
  }

  /** A retired crawlee session gives back its leases (a ban was reported when the answer came). */
  #watch(session: Session | undefined): void {
    const pool = (session as unknown as { sessionPool?: { on?: (event: string, listener: (session: Session) => void) => void } })?.sessionPool;
    if (pool === undefined || typeof pool.on !== 'function' || this.#pools.has(pool)) return;
    this.#pools.add(pool);
    pool.on('sessionRetired', (retired: Session) => {
      const ending = [...this.#held.values()].filter((held) => held.session === retired.id);
      ending.forEach((held) => this.#forget(held));
      void Promise.all(ending.map((held) => this.#drop(held)));
    });
  }
}

/** How `EgressGateway` sends requests through the gateway. */
export interface EgressGatewayOptions extends Omit<GatewayOptions, 'session'> {
  /** The gateway's `http://host:port`. */
  url: string;
  /** A `lease`-scope discovery token: the proxy password. */
  token: string;
  /** Answers inside tunnels reported `banned` (default `[401, 403]`). */
  banCodes?: number[];
  /** Answers inside tunnels reported `throttled` with their `Retry-After` (default `[429]`). */
  throttleCodes?: number[];
}

/** What `EgressGateway` reported, for logs and assertions. */
export interface EgressGatewayStats {
  bans: number;
  throttles: number;
  /** Reports the gateway refused or that did not reach it. */
  reportErrors: number;
}

/**
 * crawlee through the egress gateway: each crawlee session is a gateway session (`session-<id>` in the proxy user
 * name), and a refusal inside an `https://` tunnel, which the gateway cannot see, is reported to it
 * (`POST /report`): the proxy cools down for the site, the gateway closes the session's tunnels through it, and
 * crawlee's own handling of the blocked status (the session retires, the request goes again on a new session) sends
 * the request through another proxy. Plain `http://` refusals are the gateway's own to report and retry.
 *
 * ```ts
 * const gateway = new EgressGateway({ url: 'http://egress-gateway.egress-system:8088', token });
 * const crawler = new CheerioCrawler({ ...gateway.crawlerOptions(), requestHandler });
 * ```
 */
export class EgressGateway {
  readonly stats: EgressGatewayStats = { bans: 0, throttles: 0, reportErrors: 0 };
  readonly #url: string;
  readonly #token: string;
  readonly #options: Omit<GatewayOptions, 'session'>;
  readonly #banCodes: Set<number>;
  readonly #throttleCodes: Set<number>;

  constructor({ url, token, banCodes = [401, 403], throttleCodes = [429], ...options }: EgressGatewayOptions) {
    // A bad option is a configuration error now, not a 400 on every request.
    gatewayProxyUrl(url, token, options);
    this.#url = url;
    this.#token = token;
    this.#options = options;
    this.#banCodes = new Set(banCodes);
    this.#throttleCodes = new Set(throttleCodes);
  }

  /** The proxy URL of a crawlee session (or, without one, a rotating one). */
  proxyUrl(sessionId?: string | number): string {
    const session = sessionId === undefined ? undefined : String(sessionId);
    return gatewayProxyUrl(this.#url, this.#token, { ...this.#options, session });
  }

  /** A `ProxyConfiguration` whose URL carries each crawlee session as the gateway session. */
  proxyConfiguration(): ProxyConfiguration {
    return new ProxyConfiguration({ newUrlFunction: (sessionId) => this.proxyUrl(sessionId) });
  }

  /** The crawler options that wire it in: `new CheerioCrawler({ ...gateway.crawlerOptions(), requestHandler })`. */
  crawlerOptions(): {
    proxyConfiguration: ProxyConfiguration;
    postNavigationHooks: Array<(context: EgressGatewayContext) => Promise<void>>;
  } {
    return { proxyConfiguration: this.proxyConfiguration(), postNavigationHooks: [this.postNavigationHook] };
  }

  /** Reports a ban or throttle the site answered inside a tunnel of a session. */
  readonly postNavigationHook = async (context: EgressGatewayContext): Promise<void> => {
    const status = statusOf(context.response);
    const proxyUrl = context.proxyInfo?.url;
    const url = context.request.loadedUrl ?? context.request.url;
    if (status === undefined || proxyUrl === undefined || !url.startsWith('https:') || context.session === undefined) {
      return;
    }
    const banned = this.#banCodes.has(status);
    if (!banned && !this.#throttleCodes.has(status)) return;
    const retryAfter = banned ? undefined : retryAfterSeconds(headerOf(context.response, 'retry-after'), {});
    try {
      await reportToGateway(proxyUrl, url, banned ? 'banned' : 'throttled', retryAfter === undefined ? {} : { retryAfterSeconds: retryAfter });
      if (banned) this.stats.bans += 1;
      else this.stats.throttles += 1;
    } catch (error) {
      // Unreported, the proxy does not cool down; crawlee still retires the session and retries the request.
      this.stats.reportErrors += 1;
      context.log?.warning(`reporting a refusal to the gateway failed: ${(error as Error).message}`);
    }
  };
}

/** The part of crawlee's crawling context `EgressGateway` reads. */
export interface EgressGatewayContext {
  request: Request;
  session?: Session;
  response?: unknown;
  proxyInfo?: { url: string };
  log?: { warning(message: string): void };
}
