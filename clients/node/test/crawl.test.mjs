// A real crawlee CheerioCrawler crawl of a local site of 200 pages through the operator's proxies, with the adapter.
// The site bans one proxy's address outright (403) and rate-limits every other address (429 with Retry-After: 2 on
// every twentieth request from it); the crawl must still fetch every page, never through a proxy while it was cooling
// down for the site, bring throttled proxies back after the Retry-After, and reuse its leases.

import assert from 'node:assert/strict';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { test } from 'node:test';

import { CheerioCrawler, Configuration, log } from '@crawlee/cheerio';

import { DiscoveryClient } from '../dist/index.js';
import { EgressProxyConfiguration } from '../dist/crawlee.js';
import { Site, apiRequests } from '../support/site.mjs';

const URL_ = process.env.EGRESS_URL ?? '';
const TOKEN = process.env.EGRESS_TOKEN ?? '';
const METRICS = process.env.EGRESS_METRICS ?? '';
const PAGES = 200;
const RETRY_AFTER = 2;
const skip = URL_ ? false : 'needs a live operator: run through `cargo xtask test` (bins/operator/tests/clients.rs)';

test('a crawlee crawl fetches every page and never through a cooling proxy', { skip, timeout: 300_000 }, async () => {
  const addresses = (await new DiscoveryClient(URL_, { token: TOKEN }).proxies()).map((p) => p.egressIP).sort();
  assert.ok(new Set(addresses).size >= 3 && !addresses.includes(undefined), String(addresses));
  const site = await new Site({ banned: addresses[0], pages: PAGES, retryAfter: RETRY_AFTER }).start();
  const storage = await mkdtemp(path.join(tmpdir(), 'egress-crawlee-'));
  log.setLevel(log.LEVELS.ERROR);
  const before = await apiRequests(METRICS);
  const fetched = new Set();
  const egress = new EgressProxyConfiguration({ url: URL_, token: TOKEN, reportEvery: 10 });
  try {
    const crawler = new CheerioCrawler(
      {
        ...egress.crawlerOptions(),
        sessionPoolOptions: { maxPoolSize: 4 },
        maxConcurrency: 8,
        // Long enough that the crawl outlasts the site's Retry-After.
        maxRequestsPerMinute: 1500,
        maxRequestRetries: 8,
        requestHandler: async ({ request, response, enqueueLinks }) => {
          fetched.add(`${request.url} ${response.statusCode}`);
          await enqueueLinks({ selector: 'a' });
        },
      },
      new Configuration({ persistStorage: false, storageClientOptions: { localDataDirectory: storage } }),
    );
    const finished = await crawler.run([site.url]);
    assert.equal(finished.requestsFailed, 0, JSON.stringify(finished));
  } finally {
    await egress.close();
    await site.stop();
    await rm(storage, { recursive: true, force: true });
  }
  const apiCalls = (await apiRequests(METRICS)) - before;
  const { log: requests, banned } = site;
  const stats = egress.stats;
  // Every page (and the index) was fetched, each with a 200.
  assert.equal(fetched.size, PAGES + 1, `${fetched.size} pages; ${JSON.stringify(stats)}`);
  assert.ok([...fetched].every((line) => line.endsWith(' 200')));
  // No request reached the site through a proxy while it was cooling down for it: after the banned address's first
  // 403 (plus a second for requests already in flight), and inside a throttle's Retry-After.
  const bans = requests.filter(([, ip, , status]) => ip === banned && status === 403).map(([t]) => t);
  const late = bans.length ? requests.filter(([t, ip]) => ip === banned && t > Math.min(...bans) + 1.0) : [];
  const inside = [];
  const back = {};
  for (const address of new Set(requests.map(([, ip]) => ip).filter((ip) => ip !== banned))) {
    const throttles = requests.filter(([, ip, , status]) => ip === address && status === 429).map(([t]) => t);
    inside.push(...requests.filter(([t, ip]) => ip === address && throttles.some((at) => at + 1.0 < t && t < at + RETRY_AFTER - 0.2)));
    if (throttles.length) {
      back[address] = requests.some(([t, ip, , status]) => ip === address && status === 200 && t > throttles[0] + RETRY_AFTER);
    }
  }
  const callsPerPage = apiCalls / PAGES;
  console.log(
    `crawlee crawl: ${fetched.size} pages, ${requests.length} requests, ${stats.leases} leases, ${stats.bans} bans, ` +
      `${stats.throttles} throttles, lease calls per page ${(stats.leases / PAGES).toFixed(3)}, ` +
      `API calls per page ${callsPerPage.toFixed(3)}, through a cooling proxy ${late.length + inside.length}, ` +
      `waits ${JSON.stringify(stats.waits)}, report errors ${stats.reportErrors}`,
  );
  assert.equal(late.length, 0, `${late.length} requests through the banned proxy after its ban`);
  assert.equal(inside.length, 0, `${inside.length} requests through a throttled proxy inside its Retry-After`);
  assert.ok(stats.leases / PAGES < 0.3, `${stats.leases} leases for ${PAGES} pages: leases are not reused`);
  assert.ok(stats.bans >= 1 && stats.throttles >= 1, JSON.stringify(stats));
  assert.ok(Object.keys(back).length > 0 && Object.values(back).every(Boolean), `throttled proxies came back: ${JSON.stringify(back)}`);
  assert.ok(callsPerPage < 1, `${apiCalls} discovery API calls for ${PAGES} pages`);
  assert.equal(stats.reportErrors, 0);
  assert.equal(egress.heldLeases, 0, 'close() gave every lease back');
});
