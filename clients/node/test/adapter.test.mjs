// The crawlee adapter's bookkeeping against a table-driven discovery API (no server), with crawlee's own Request,
// SessionPool and Session: which lease each request gets, what is reported when, and what is released.

import assert from 'node:assert/strict';
import { test } from 'node:test';

import { Configuration, Request, SessionError, SessionPool } from '@crawlee/core';

import { DiscoveryClient, Unavailable } from '../dist/index.js';
import { EgressBlockedError, EgressProxyConfiguration, EgressThrottledError } from '../dist/crawlee.js';

/** A discovery API in a table: leases go to proxies `p0`, `p1`, ... in turn; every call is recorded. */
function discovery({ unavailable = 0, retryAfter = '0', proxies = 2, egressOf = (proxy) => `203.0.113.${proxy}`, reason = 'all-cooling-down' } = {}) {
  const calls = [];
  let serial = 0;
  let refusals = unavailable;
  const fetch = async (url, init) => {
    const { pathname } = new URL(url);
    const body = init.body ? JSON.parse(init.body) : undefined;
    calls.push({ method: init.method, path: pathname, body });
    const json = (status, value, headers = {}) =>
      new Response(JSON.stringify(value), { status, headers: { 'content-type': 'application/json', ...headers } });
    if (init.method === 'POST' && pathname === '/v1/leases') {
      if (refusals > 0) {
        refusals -= 1;
        return json(503, { status: 503, detail: `refused: ${reason}`, reason }, { 'retry-after': retryAfter });
      }
      const n = serial++;
      const index = n % proxies;
      const proxy = `p${index}`;
      return json(201, {
        id: `l1.${n}`,
        proxy: {
          namespace: 'crawl',
          name: proxy,
          host: `127.0.0.${10 + index}`,
          port: 3128,
          url: `http://127.0.0.${10 + index}:3128`,
          egressIP: egressOf(index),
        },
        target: new URL(body.target).hostname.replace(/^www\./, ''),
        expiresAt: new Date(Date.now() + 300_000).toISOString(),
      });
    }
    if (init.method === 'POST' && pathname.endsWith('/report')) {
      return json(200, body.outcome === 'banned' || body.outcome === 'throttled' ? { cooldownUntil: new Date(Date.now() + 60_000).toISOString() } : {});
    }
    if (init.method === 'DELETE') return new Response(null, { status: 204 });
    return json(404, { status: 404, detail: 'no such route' });
  };
  return { client: new DiscoveryClient('http://discovery', { token: 't', fetch }), calls };
}

const config = new Configuration({ persistStorage: false });

async function pool(options = {}) {
  return SessionPool.open({ maxPoolSize: 4, persistenceOptions: { enable: false }, ...options }, config);
}

/** What a crawler does for one request: ask for the proxy, then run the post-navigation hook on the answer. */
async function fetchPage(egress, session, url, status, headers = {}) {
  const request = new Request({ url });
  const info = await egress.newProxyInfo(session.id, { request });
  const context = { request, session, proxyInfo: info, response: { statusCode: status, headers } };
  let error;
  try {
    await egress.postNavigationHook(context);
  } catch (thrown) {
    error = thrown;
  }
  return { request, info, context, error };
}

const reports = (calls) => calls.filter((call) => call.path.endsWith('/report')).map((call) => [call.path.split('/')[3], call.body]);
const releases = (calls) => calls.filter((call) => call.method === 'DELETE').map((call) => call.path.split('/')[3]);

test('one lease per (site, session), reused; counts go out in batches and when the crawl closes', async () => {
  const { client, calls } = discovery();
  const egress = new EgressProxyConfiguration({ client, reportEvery: 3 });
  const sessions = await pool();
  const [one, two] = [await sessions.getSession(), await sessions.getSession()];
  const first = await fetchPage(egress, one, 'http://www.shop.example/a', 200);
  await fetchPage(egress, one, 'http://www.shop.example/b', 200);
  await fetchPage(egress, one, 'http://www.shop.example/c', 404); // the site answered: the proxy works
  await fetchPage(egress, one, 'http://other.example/a', 200);
  await fetchPage(egress, two, 'http://www.shop.example/d', 200);
  assert.equal(first.error, undefined);
  assert.equal(first.info.url, 'http://127.0.0.10:3128');
  assert.equal(egress.stats.leases, 3, 'shop for one, other for one, shop for two');
  assert.deepEqual(calls.filter((c) => c.path === '/v1/leases').map((c) => [c.body.session, c.body.ttlSeconds]), [
    [one.id, 300],
    [one.id, 300],
    [two.id, 300],
  ]);
  assert.deepEqual(reports(calls), [['l1.0', { ok: 3 }]]);
  await egress.close();
  assert.deepEqual(reports(calls).slice(1).sort(), [['l1.1', { ok: 1, release: true }], ['l1.2', { ok: 1, release: true }]]);
  assert.equal(egress.heldLeases, 0);
  await assert.rejects(egress.newProxyInfo(one.id, { request: new Request({ url: 'http://shop.example/' }) }), /closed/);
});

test('a ban code is reported once, drops every lease on that proxy for the site, and rotates the session', async () => {
  const { client, calls } = discovery();
  const egress = new EgressProxyConfiguration({ client });
  const sessions = await pool();
  const [one, two, three] = [await sessions.getSession(), await sessions.getSession(), await sessions.getSession()];
  await fetchPage(egress, one, 'http://shop.example/a', 200); // l1.0 on p0
  await fetchPage(egress, two, 'http://shop.example/b', 200); // l1.1 on p1
  await fetchPage(egress, three, 'http://shop.example/c', 200); // l1.2 on p0 again
  const banned = await fetchPage(egress, one, 'http://shop.example/d', 403);
  assert.ok(banned.error instanceof EgressBlockedError && banned.error instanceof SessionError, String(banned.error));
  // The banned lease, and session three's lease on the same proxy for the same site, whose counts go with its release.
  assert.deepEqual(reports(calls), [
    ['l1.0', { outcome: 'banned', statusCode: 403, ok: 1, release: true }],
    ['l1.2', { ok: 1, release: true }],
  ]);
  assert.deepEqual(releases(calls), []);
  assert.equal(egress.heldLeases, 1, 'only session two keeps its lease (p1)');
  // Session three's next request leases anew.
  await fetchPage(egress, three, 'http://shop.example/e', 200);
  assert.equal(egress.stats.leases, 4);
  // An answer from a request already in flight on the banned lease is not reported again.
  await egress.errorHandler(banned.context, banned.error);
  assert.equal(egress.stats.bans, 1);
  await egress.close();
});

test('a ban drops the leases on every proxy that leaves through the same address, and only those', async () => {
  // p0 and p2 leave through one address; p1 through its own.
  const { client, calls } = discovery({ proxies: 3, egressOf: (index) => (index === 1 ? '203.0.113.1' : '203.0.113.2') });
  const egress = new EgressProxyConfiguration({ client });
  const sessions = await pool();
  const [one, two, three] = [await sessions.getSession(), await sessions.getSession(), await sessions.getSession()];
  await fetchPage(egress, one, 'http://shop.example/a', 200); // l1.0 on p0
  await fetchPage(egress, two, 'http://shop.example/b', 200); // l1.1 on p1
  await fetchPage(egress, three, 'http://shop.example/c', 200); // l1.2 on p2, same address as p0
  const banned = await fetchPage(egress, one, 'http://shop.example/d', 403);
  assert.ok(banned.error instanceof EgressBlockedError);
  assert.deepEqual(reports(calls), [
    ['l1.0', { outcome: 'banned', statusCode: 403, ok: 1, release: true }],
    ['l1.2', { ok: 1, release: true }],
  ]);
  assert.equal(egress.heldLeases, 1, 'only the lease on p1 is kept');
  await egress.close();
});

test('statuses the session pool retires sessions on are bans too; throttles carry Retry-After and are bounded', async () => {
  const { client, calls } = discovery();
  const egress = new EgressProxyConfiguration({ client, maxRetries: 1 });
  const sessions = await pool({ blockedStatusCodes: [401, 403, 429] });
  const one = await sessions.getSession();
  const unauthorised = await fetchPage(egress, one, 'http://shop.example/a', 401);
  assert.ok(unauthorised.error instanceof EgressBlockedError, String(unauthorised.error));
  const two = await sessions.getSession();
  const throttled = await fetchPage(egress, two, 'http://shop.example/b', 429, { 'retry-after': '7' });
  assert.ok(throttled.error instanceof EgressThrottledError, 'a throttle is not a ban, even though the pool lists 429');
  const again = new Request({ url: 'http://shop.example/b' });
  again.userData = throttled.request.userData;
  await egress.newProxyInfo(two.id, { request: again });
  let last;
  try {
    await egress.postNavigationHook({ request: again, session: two, response: { statusCode: 429, headers: {} } });
  } catch (error) {
    last = error;
  }
  assert.ok(!(last instanceof EgressThrottledError) && /throttled 2 times/.test(last.message), String(last));
  assert.deepEqual(reports(calls), [
    ['l1.0', { outcome: 'banned', statusCode: 401, release: true }],
    ['l1.1', { outcome: 'throttled', statusCode: 429, retryAfterSeconds: 7, release: true }],
    ['l1.2', { outcome: 'throttled', statusCode: 429, release: true }],
  ]);
  assert.equal(egress.stats.bans, 1);
  assert.equal(egress.stats.throttles, 2);
});

test('error handlers: a SessionError from elsewhere is a ban, a request with no answer is failed', async () => {
  const { client, calls } = discovery();
  const egress = new EgressProxyConfiguration({ client });
  const sessions = await pool();
  const one = await sessions.getSession();
  // crawlee's block detection (or the handler) found a CAPTCHA on a page that answered 200.
  const captcha = await fetchPage(egress, one, 'http://shop.example/a', 200);
  await egress.errorHandler(captcha.context, new SessionError('Found selectors: iframe[src^="https://challenges"]'));
  assert.deepEqual(reports(calls), [['l1.0', { outcome: 'banned', statusCode: 200, release: true }]], 'not counted ok');
  // A network error: the hook never ran.
  const request = new Request({ url: 'http://shop.example/b' });
  await egress.newProxyInfo(one.id, { request });
  await egress.failedRequestHandler({ request, session: one }, new Error('ECONNRESET'));
  await egress.close();
  assert.deepEqual(reports(calls)[1], ['l1.1', { failed: 1, release: true }]);
  assert.equal(egress.stats.failed, 1);
});

test('a retired session gives its leases back; no proxy now waits for the Retry-After, up to maxWaitSeconds', async () => {
  const { client, calls } = discovery({ unavailable: 2 });
  const egress = new EgressProxyConfiguration({ client, maxWaitSeconds: 5 });
  const sessions = await pool();
  const one = await sessions.getSession();
  await fetchPage(egress, one, 'http://shop.example/a', 200);
  await fetchPage(egress, one, 'http://other.example/a', 200);
  assert.deepEqual(egress.stats.waits, { 'all-cooling-down': 2 });
  one.retire();
  await new Promise((resolve) => setTimeout(resolve, 50));
  assert.deepEqual(reports(calls).map(([id, body]) => [id, body]).sort(), [
    ['l1.0', { ok: 1, release: true }],
    ['l1.1', { ok: 1, release: true }],
  ]);
  assert.equal(egress.heldLeases, 0);
  const { client: refusing } = discovery({ unavailable: 10, retryAfter: '1' });
  const impatient = new EgressProxyConfiguration({ client: refusing, maxWaitSeconds: 0 });
  await assert.rejects(impatient.newProxyInfo('s', { request: new Request({ url: 'http://shop.example/' }) }), Unavailable);
  await assert.rejects(impatient.newProxyInfo('s'), /needs the request/);
  assert.throws(() => new EgressProxyConfiguration({}), /give the discovery API as `url`/);
  assert.throws(() => new EgressProxyConfiguration({ url: 'http://d', banCodes: [99] }), /banCodes must hold HTTP statuses/);
});

test('with a pool, every lease asks for its members, and a pool scaling up is waited for', async () => {
  const { client, calls } = discovery({ unavailable: 1, reason: 'scaling-up' });
  const egress = new EgressProxyConfiguration({ client, pool: 'crawl/eu', selector: 'region=eu' });
  const sessions = await pool();
  const page = await fetchPage(egress, await sessions.getSession(), 'http://shop.example/a', 200);
  assert.equal(page.error, undefined);
  assert.deepEqual(egress.stats.waits, { 'scaling-up': 1 });
  const asked = calls.filter((call) => call.path === '/v1/leases').map((call) => [call.body.pool, call.body.selector]);
  assert.deepEqual(asked, [['crawl/eu', 'region=eu'], ['crawl/eu', 'region=eu']]);
  await egress.close();
});
