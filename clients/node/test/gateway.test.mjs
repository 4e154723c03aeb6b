// Real crawlee CheerioCrawler crawls of the 200-page test site through the gateway: over plain HTTP with nothing
// egress-specific but the proxy URL (crawlee's own ProxyConfiguration, whose URL carries crawlee's session ID as the
// gateway session, `http://session-<id>:<token>@<gateway>`), and over HTTPS (CONNECT tunnels) with the package's
// `EgressGateway`, which reports the refusals crawlee sees inside the tunnels. The site bans one proxy's address outright (403) and rate-limits every
// other address (429 with Retry-After: 2 on every twentieth request from it). The gateway reports those, retries
// elsewhere and waits out short cooldowns, so the crawl must fetch every page with a 200, never through a proxy while
// it was cooling down for the site, and each session must keep its proxy unless a refusal moved it.

import assert from 'node:assert/strict';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { test } from 'node:test';

import { CheerioCrawler, Configuration, ProxyConfiguration, log } from '@crawlee/cheerio';

import { EgressGateway } from '../dist/crawlee.js';
import { DiscoveryClient } from '../dist/index.js';
import { Site } from '../support/site.mjs';

const URL_ = process.env.EGRESS_URL ?? '';
const TOKEN = process.env.EGRESS_TOKEN ?? '';
const GATEWAY = process.env.EGRESS_GATEWAY ?? '';
const PAGES = 200;
const RETRY_AFTER = 2;
/** The test gateway's stickiness (`--sticky=3s`): a session idle that long lets its proxy go. */
const STICKY = 3;
const skip = URL_ && GATEWAY ? false : 'needs a live operator and gateway: run through `cargo xtask test`';

/**
 * Crawls the test site (over TLS with `tls`) with crawlee through the gateway, with `options` (the proxy
 * configuration and hooks) over the shared crawler options; checks every page came with a 200, none through a proxy
 * cooling down for the site, and sessions stuck; returns what it counted.
 */
async function crawlThroughGateway(label, { tls, options }) {
  const addresses = (await new DiscoveryClient(URL_, { token: TOKEN }).proxies()).map((p) => p.egressIP).sort();
  assert.ok(new Set(addresses).size >= 3 && !addresses.includes(undefined), String(addresses));
  const site = await new Site({ banned: addresses[0], pages: PAGES, retryAfter: RETRY_AFTER, tls }).start();
  const storage = await mkdtemp(path.join(tmpdir(), 'egress-crawlee-gateway-'));
  log.setLevel(log.LEVELS.ERROR);
  /** @type {{ url: string, status: number, session: string, proxy: string, address: string, at: number }[]} */
  const pages = [];
  try {
    const crawler = new CheerioCrawler(
      {
        ...options,
        sessionPoolOptions: { maxPoolSize: 4 },
        // A refusal reported for one session closes every tunnel of the tenant through that proxy to the site, so
        // requests of other sessions in flight there are cut (docs/gateway.md) and crawlee tries them again: a busy
        // machine cut one request four times (crawlee's default allows three retries).
        maxRequestRetries: 8,
        maxConcurrency: 8,
        maxRequestsPerMinute: 1500,
        requestHandler: async ({ request, response, session, enqueueLinks }) => {
          pages.push({
            url: request.url,
            status: response.statusCode ?? 0,
            session: session?.id ?? '',
            // Inside a tunnel the proxy's name is not in sight: the site says which address it saw.
            proxy: String(response.headers['x-egress-proxy'] ?? response.headers['x-seen-from'] ?? ''),
            // The address the site saw, and when (on the site's clock), to tell what moved a session.
            address: String(response.headers['x-seen-from'] ?? ''),
            at: (performance.now() - site.startedAt) / 1000,
          });
          await enqueueLinks({ selector: 'a' });
        },
      },
      new Configuration({ persistStorage: false, storageClientOptions: { localDataDirectory: storage } }),
    );
    const finished = await crawler.run([site.url]);
    assert.equal(finished.requestsFailed, 0, JSON.stringify(finished));
  } finally {
    await site.stop();
    await rm(storage, { recursive: true, force: true });
    await leasesLetGo();
  }
  const { log: requests, banned } = site;
  const refusals = requests.filter(([, , , status]) => status === 403 || status === 429).length;
  // Every page (and the index) was fetched, each with a 200.
  assert.equal(new Set(pages.map((page) => page.url)).size, PAGES + 1, `${pages.length} pages`);
  assert.ok(pages.every((page) => page.status === 200));
  // No request reached the site through a proxy while it was cooling down for it: after the banned address's first
  // 403 (plus a second for requests already in flight), and inside a throttle's Retry-After.
  const bans = requests.filter(([, ip, , status]) => ip === banned && status === 403).map(([t]) => t);
  const late = bans.length ? requests.filter(([t, ip]) => ip === banned && t > Math.min(...bans) + 1.0) : [];
  const inside = [];
  for (const address of new Set(requests.map(([, ip]) => ip).filter((ip) => ip !== banned))) {
    const throttles = requests.filter(([, ip, , status]) => ip === address && status === 429).map(([t]) => t);
    inside.push(...requests.filter(([t, ip]) => ip === address && throttles.some((at) => at + 1.0 < t && t < at + RETRY_AFTER - 0.2)));
  }
  // A session moves only when a refusal moved it: the site refused the address it left (any session's request
  // there, since shortly before the session's last page through it: one refusal moves every session of the tenant
  // on that proxy), or it idled past the gateway's stickiness.
  const sessions = new Set(pages.map((page) => page.session));
  const refused = requests.filter(([, , , status]) => status === 403 || status === 429);
  const last = new Map();
  const unexplained = [];
  let moves = 0;
  for (const page of [...pages].sort((a, b) => a.at - b.at)) {
    const before = last.get(page.session);
    last.set(page.session, page);
    if (before === undefined || before.address === page.address) continue;
    moves += 1;
    const moved = refused.some(([t, ip]) => ip === before.address && t >= before.at - 2 && t <= page.at);
    if (!moved && page.at - before.at < STICKY) {
      unexplained.push(`${page.session}: ${before.address} at ${before.at.toFixed(2)} s, ${page.address} at ${page.at.toFixed(2)} s`);
    }
  }
  console.log(
    `${label}: ${pages.length} pages, ${requests.length} requests at the site, ${refusals} refusals, ` +
      `${sessions.size} sessions moved ${moves} times (${unexplained.length} without a refusal or an idle), ` +
      `through a cooling proxy ${late.length + inside.length}`,
  );
  assert.equal(late.length, 0, `${late.length} requests through the banned proxy after its ban`);
  assert.equal(inside.length, 0, `${inside.length} requests through a throttled proxy inside its Retry-After`);
  assert.ok(refusals >= 2, 'the site refused some requests (a ban and throttles)');
  assert.ok(pages.every((page) => page.proxy !== ''), 'every answer names its proxy or address');
  assert.deepEqual(unexplained, [], 'sessions moved with no refusal of their proxy and no idle: they do not stick');
  assert.ok(await leasesLetGo(), 'the gateway released its sessions\' leases once they idled');
  return { refusals, pages: pages.length };
}

/**
 * Waits up to 30 s for the gateway's idle sessions to let their leases go (the test gateway's stickiness is 3 s), so
 * the fleet is as the next test expects, whether or not the crawl passed; whether they did.
 */
async function leasesLetGo() {
  const client = new DiscoveryClient(URL_, { token: TOKEN });
  const deadline = Date.now() + 30_000;
  while ((await client.proxies()).some((proxy) => proxy.activeLeases > 0)) {
    if (Date.now() >= deadline) return false;
    await new Promise((resolve) => setTimeout(resolve, 250));
  }
  return true;
}

test('a plain crawlee crawl through the gateway fetches every page and sessions stick', { skip, timeout: 300_000 }, async () => {
  const proxyConfiguration = new ProxyConfiguration({
    newUrlFunction: (sessionId) => `http://session-${sessionId}:${TOKEN}@${GATEWAY}`,
  });
  await crawlThroughGateway('crawlee through the gateway (retried by the gateway)', { tls: false, options: { proxyConfiguration } });
});

test('an https crawlee crawl through the gateway reports what it sees in tunnels with EgressGateway', { skip, timeout: 300_000 }, async () => {
  const gateway = new EgressGateway({ url: `http://${GATEWAY}`, token: TOKEN });
  const { refusals } = await crawlThroughGateway('crawlee through the gateway over CONNECT', {
    tls: true,
    options: gateway.crawlerOptions(),
  });
  console.log(`EgressGateway reported ${JSON.stringify(gateway.stats)}`);
  assert.equal(gateway.stats.reportErrors, 0);
  assert.equal(gateway.stats.bans + gateway.stats.throttles, refusals, 'every refusal in a tunnel was reported');
});
