/**
 * Gateway helpers: the proxy URL for a session, and reporting a refusal the gateway could not see.
 *
 * The gateway (`egress-operator gateway`, docs/gateway.md) is one forward-proxy URL for the whole fleet; its user
 * name carries options (`session-<id>`, `pool-<name>`, `zone-<z>`, `provider-<p>`, `label-<k>=<v>`,
 * `sticky-<seconds>`, `lifetime-<seconds>`, `requests-<count>`) and its password is a discovery token. Plain `http://` answers are the gateway's to judge;
 * inside a `CONNECT` tunnel (every `https://` URL) only the crawler sees the site's answer, so it reports a ban or a
 * throttle itself:
 *
 * ```ts
 * const proxy = gatewayProxyUrl('http://egress-gateway.egress-system:8088', token, { session: 'a1' });
 * // ... a 403 from https://shop.example.com/ through `proxy` ...
 * await reportToGateway(proxy, 'https://shop.example.com/', 'banned');
 * ```
 *
 * The report cools the session's proxy down for the site (for the tenant), closes the tunnels the gateway holds
 * through it to that site, and the session's next request goes through another proxy.
 */

import http from 'node:http';

/** The report outcomes the gateway takes. */
export const GATEWAY_REPORTS = ['banned', 'throttled'] as const;
export type GatewayReport = (typeof GATEWAY_REPORTS)[number];

/** What a gateway proxy URL's user name asks for. */
export interface GatewayOptions {
  /** Requests of one session to one site go through one proxy: 1–128 of `A-Z a-z 0-9 . _ ~ -`. */
  session?: string;
  /** How long an idle session keeps its proxy, 1–86400 seconds (with a session). */
  sticky?: number;
  /** The longest a session keeps one proxy, 1–86400 seconds from its first request there (with a session). */
  lifetime?: number;
  /** The most requests a session sends through one proxy, 1–1000000 (with a session). */
  requests?: number;
  /** Only members of this ProxyPool (`name` or `namespace.name`). */
  pool?: string;
  /** Only proxies labelled `zone=<zone>`. */
  zone?: string;
  /** Only proxies labelled `provider=<provider>`. */
  provider?: string;
  /** Only proxies with these labels. */
  labels?: Record<string, string>;
}

/** The gateway refused a report, or could not be reached (`status` undefined then). */
export class GatewayError extends Error {
  constructor(
    message: string,
    readonly status?: number,
  ) {
    super(message);
    this.name = 'GatewayError';
  }
}

const SESSION = /^[A-Za-z0-9._~-]{1,128}$/;

/**
 * The proxy URL that sends requests through `gateway` (`http://host:port`, or `host:port`) as `token`, with
 * `options` in the user name. Throws a `TypeError` for an option the gateway would refuse.
 */
export function gatewayProxyUrl(gateway: string, token: string, options: GatewayOptions = {}): string {
  let url: URL;
  try {
    url = new URL(gateway.includes('://') ? gateway : `http://${gateway}`);
  } catch {
    throw new TypeError(`the gateway is http://host:port, not ${JSON.stringify(gateway)}`);
  }
  if (url.protocol !== 'http:' || !url.hostname || url.username || url.password) {
    throw new TypeError(`the gateway is http://host:port, without credentials (got ${JSON.stringify(gateway)})`);
  }
  if (!token) throw new TypeError('the token (the proxy password) is empty');
  const parts: string[] = [];
  const { session, sticky } = options;
  if (session !== undefined) {
    if (!SESSION.test(session)) throw new TypeError(`session ${JSON.stringify(session)}: 1-128 of A-Z a-z 0-9 . _ ~ -`);
    parts.push(`session-${session}`);
  }
  if (sticky !== undefined) {
    if (session === undefined || !Number.isInteger(sticky) || sticky < 1 || sticky > 86_400) {
      throw new TypeError(`sticky ${sticky}: 1-86400 seconds, with a session`);
    }
    parts.push(`sticky-${sticky}`);
  }
  for (const [key, most, unit] of [['lifetime', 86_400, ' seconds'], ['requests', 1_000_000, '']] as const) {
    const value = options[key];
    if (value === undefined) continue;
    if (session === undefined || !Number.isInteger(value) || value < 1 || value > most) {
      throw new TypeError(`${key} ${value}: 1-${most}${unit}, with a session`);
    }
    parts.push(`${key}-${value}`);
  }
  for (const key of ['pool', 'zone', 'provider'] as const) {
    const value = options[key];
    if (value === undefined) continue;
    if (!value || value.includes(',')) throw new TypeError(`${key} ${JSON.stringify(value)}: not empty and without a comma`);
    parts.push(`${key}-${value}`);
  }
  for (const [key, value] of Object.entries(options.labels ?? {}).sort(([a], [b]) => a.localeCompare(b))) {
    if (!key || !value || (key + value).includes(',') || key.includes('=')) {
      throw new TypeError(`label ${key}=${value}: a label key and value, without commas`);
    }
    parts.push(`label-${key}=${value}`);
  }
  // No options is the user name `rotate`: many clients send no credentials for an empty one.
  return `http://${encodeURIComponent(parts.join(',') || 'rotate')}:${encodeURIComponent(token)}@${url.host}`;
}

/**
 * Reports `outcome` (`banned`, or `throttled` with `retryAfterSeconds`) that `target` (the URL or host the site
 * answered) gave the session of `proxyUrl` (the gateway proxy URL the request went through, with `session-<id>`).
 * Resolves to the proxy reported (`namespace/name`); rejects with a `GatewayError` when the gateway refuses the
 * report or cannot be reached, and a `TypeError` for arguments it would refuse.
 */
export async function reportToGateway(
  proxyUrl: string,
  target: string,
  outcome: GatewayReport,
  { retryAfterSeconds, timeoutMs = 10_000 }: { retryAfterSeconds?: number; timeoutMs?: number } = {},
): Promise<string> {
  if (!GATEWAY_REPORTS.includes(outcome)) throw new TypeError(`outcome ${outcome}: one of ${GATEWAY_REPORTS.join(', ')}`);
  const proxy = new URL(proxyUrl);
  if (proxy.protocol !== 'http:' || !proxy.hostname || !proxy.password) {
    throw new TypeError('proxyUrl is the gateway proxy URL, http://<options>:<token>@host:port');
  }
  const user = decodeURIComponent(proxy.username);
  if (!user.split(',').some((option) => option.startsWith('session-'))) {
    throw new TypeError("a report is on a session's proxy: the proxy URL's user name needs session-<id>");
  }
  let site: URL;
  try {
    site = new URL(target.includes('://') ? target : `http://${target}`);
  } catch {
    throw new TypeError(`target ${JSON.stringify(target)}: a URL or host[:port]`);
  }
  let value: string = outcome;
  if (outcome === 'throttled' && retryAfterSeconds !== undefined) {
    value += `; retry-after=${Math.max(1, Math.min(86_400, Math.round(retryAfterSeconds)))}`;
  }
  const credentials = Buffer.from(`${user}:${decodeURIComponent(proxy.password)}`).toString('base64');
  const path = `/report?target=${encodeURIComponent(site.host)}`;
  return new Promise((resolve, reject) => {
    const request = http.request(
      {
        host: proxy.hostname.replace(/^\[|\]$/g, ''),
        port: proxy.port || 80,
        method: 'POST',
        path,
        headers: { 'proxy-authorization': `Basic ${credentials}`, 'x-egress-report': value, 'content-length': 0 },
        timeout: timeoutMs,
      },
      (response) => {
        const chunks: Buffer[] = [];
        response.on('data', (chunk: Buffer) => chunks.push(chunk));
        response.on('error', (error) => reject(new GatewayError(`the gateway could not be reached: ${error.message}`)));
        response.on('end', () => {
          const body = Buffer.concat(chunks).toString();
          if (response.statusCode !== 200) {
            const why = String(response.headers['proxy-status'] ?? '') || body.slice(0, 200);
            reject(new GatewayError(`the gateway refused the report (${response.statusCode}): ${why}`, response.statusCode));
            return;
          }
          try {
            resolve(String((JSON.parse(body) as { proxy?: unknown }).proxy ?? ''));
          } catch {
            reject(new GatewayError(`the gateway's answer to a report is not JSON: ${body.slice(0, 200)}`, 200));
          }
        });
      },
    );
    request.on('timeout', () => request.destroy(new Error(`no answer in ${timeoutMs} ms`)));
    request.on('error', (error) => reject(new GatewayError(`the gateway could not be reached: ${error.message}`)));
    request.end();
  });
}
