// What the client does with each kind of answer, against a fetch that answers from a table (no server).

import assert from 'node:assert/strict';
import { test } from 'node:test';

import * as egress from '../dist/index.js';

const LEASE = {
  id: 'l1.AAA/BBB',
  proxy: { namespace: 'crawl', name: 'eu-1', host: '10.0.0.1', port: 3128, url: 'http://10.0.0.1:3128', egressIP: '203.0.113.7' },
  target: 'example.com',
  expiresAt: '2026-12-01T12:00:00Z',
};

function answering(status, body, headers = {}) {
  const seen = [];
  const fetch = async (url, init) => {
    seen.push({ url: new URL(url), method: init.method, headers: init.headers, body: init.body && JSON.parse(init.body) });
    if (init.method === 'POST' && new URL(url).pathname === '/v1/leases') {
      return new Response(JSON.stringify(LEASE), { status: 201, headers: { 'content-type': 'application/json' } });
    }
    const text = typeof body === 'string' ? body : JSON.stringify(body);
    return new Response(status === 204 ? null : text, { status, headers });
  };
  return { client: new egress.DiscoveryClient('http://discovery/', { token: 'token-1', fetch }), seen };
}

for (const [status, kind] of /** @type {Array<[number, typeof egress.DiscoveryError]>} */ ([
  [400, egress.BadRequest],
  [401, egress.Unauthorized],
  [403, egress.Forbidden],
  [404, egress.NotFound],
  [410, egress.Gone],
  [409, egress.Conflict],
  [503, egress.Unavailable],
  [429, egress.QuotaExceeded],
  [500, egress.DiscoveryError],
])) {
  test(`${status} is a ${kind.name}`, async () => {
    const problem = { type: 'urn:x', title: 't', status, detail: 'what went wrong', reason: 'r' };
    const { client } = answering(status, problem, { 'retry-after': '7' });
    const lease = await client.lease('example.com');
    const error = await lease.renew().then(() => assert.fail('renew succeeded'), (error) => error);
    assert.ok(error instanceof kind, `${error.name}: ${error.message}`);
    assert.ok(error instanceof egress.DiscoveryError);
    assert.equal(error.message, 'what went wrong');
    assert.equal(error.status, status);
    assert.equal(error.name, kind.name);
    if (status === 409 || status === 429 || status === 503) {
      const refused = /** @type {egress.RefusedError} */ (error);
      assert.deepEqual([refused.reason, refused.retryAfter], ['r', 7]);
    }
  });
}

test('a paced refusal gives its slot to the millisecond', async () => {
  const problem = { status: 503, detail: 'paced', reason: 'paced', retryAfterMilliseconds: 1250 };
  const { client } = answering(503, problem, { 'retry-after': '2' });
  const lease = await client.lease('example.com');
  const error = await lease.renew().then(() => assert.fail('renew succeeded'), (error) => error);
  assert.deepEqual([error.reason, error.retryAfter], ['paced', 1.25]);
});

test('requests carry the token and the bodies the API wants', async () => {
  const { client, seen } = answering(200, { cooldownUntil: '2026-12-01T12:10:00Z' });
  const lease = await client.lease('example.com', { ttlSeconds: 90.4, selector: 'region=eu', session: 's-1' });
  const until = await lease.report({ outcome: 'throttled', statusCode: 429, retryAfterSeconds: 12.4 });
  assert.equal(until?.toISOString(), '2026-12-01T12:10:00.000Z');
  await lease.reportCounts(5);
  await lease.reportCounts(0, 0); // nothing to say: no call
  const [first, throttle, counts] = seen;
  assert.equal(seen.length, 3);
  assert.equal(first.headers.authorization, 'Bearer token-1');
  assert.equal(first.url.href, 'http://discovery/v1/leases');
  assert.deepEqual(first.body, { target: 'example.com', ttlSeconds: 90, selector: 'region=eu', session: 's-1' });
  assert.equal(throttle.url.pathname, '/v1/leases/l1.AAA%2FBBB/report', 'the ID is one path segment');
  assert.deepEqual(throttle.body, { outcome: 'throttled', statusCode: 429, retryAfterSeconds: 12 });
  assert.deepEqual(counts.body, { ok: 5 });
  assert.equal(lease.proxy, 'crawl/eu-1');
  assert.equal(lease.proxyUrl, 'http://10.0.0.1:3128');
  assert.equal(lease.egressIP, '203.0.113.7');
});

test("a session's lifetime goes in the lease body and is checked first", async () => {
  const { client, seen } = answering(200, {});
  await client.lease('example.com', { session: 's-1', sessionLifetimeSeconds: 300, sessionMaxLeases: 20 });
  assert.deepEqual(seen[0].body, { target: 'example.com', session: 's-1', sessionLifetimeSeconds: 300, sessionMaxLeases: 20 });
  for (const options of [{ sessionLifetimeSeconds: 60 }, { session: 's', sessionLifetimeSeconds: 0 }, { session: 's', sessionMaxLeases: 1.5 }]) {
    await assert.rejects(client.lease('example.com', options), /with a session/, JSON.stringify(options));
  }
  assert.equal(seen.length, 1);
});

test('bad input is refused before any request, saying what is wrong', async () => {
  const { client, seen } = answering(200, {});
  const lease = await client.lease('example.com');
  // Deliberately ill-typed: what a caller without TypeScript can send.
  for (const [bad, says] of /** @type {Array<[any, RegExp]>} */ ([
    [{ outcome: 'meh' }, /outcome must be one of ok, banned, throttled, failed/],
    [{ outcome: 'banned', retryAfterSeconds: 3 }, /retryAfterSeconds goes only with outcome 'throttled'/],
    [{}, /needs an outcome, counts/],
    [{ ok: -1 }, /ok must be a count/],
    [{ outcome: 'banned', statusCode: 700 }, /statusCode must be an HTTP status/],
  ])) {
    await assert.rejects(lease.report(bad), says);
  }
  await assert.rejects(lease.renew(0), /ttlSeconds must be a positive number/);
  await assert.rejects(client.lease(''), /target must be/);
  for (const [bad, says] of /** @type {Array<[string, RegExp]>} */ ([
    ['-bad-.com', /"-bad-" is not a DNS label/],
    ['http://a..com/', /"" is not a DNS label|not a valid URL/],
    ['ftp://example.com/', /only http and https URLs/],
  ])) {
    await assert.rejects(client.lease(bad), says);
  }
  assert.equal(seen.length, 1, 'only the lease went out');
  for (const good of ['https://www.shop.example.co.uk/item?x=1', '127.0.0.1:8080', '[::1]:443', '::1', 'bücher.example', 'Example.COM.']) {
    await client.lease(good);
  }
  assert.equal(seen.length, 7, 'every good target went out');
  assert.throws(() => new egress.DiscoveryClient('discovery:8090'), /must be http:\/\/ or https:\/\//);
});

test('an answer that is not the API is a decode error', async () => {
  const { client } = answering(200, { id: 'x' });
  const lease = await client.lease('example.com');
  await assert.rejects(lease.renew(), (error) => error instanceof egress.DecodeError && /not a lease/.test(error.message));
  const { client: garbled } = answering(200, '<html>');
  await assert.rejects(garbled.proxies(), egress.DecodeError);
});

test('a release is sent once, and withLease releases however its body ends', async () => {
  const { client, seen } = answering(204, null);
  const lease = await client.lease('example.com');
  await lease.release();
  await lease.release();
  assert.equal(seen.filter((call) => call.method === 'DELETE').length, 1);
  await assert.rejects(
    client.withLease('example.com', {}, async () => {
      throw new Error('the crawl failed');
    }),
    /the crawl failed/,
  );
  assert.equal(seen.filter((call) => call.method === 'DELETE').length, 2);
});

test('Retry-After is read as seconds or as an HTTP date', () => {
  const now = Date.parse('2026-12-01T12:00:00Z');
  assert.equal(egress.retryAfterSeconds('120', {}, now), 120);
  assert.equal(egress.retryAfterSeconds('Tue, 01 Dec 2026 12:00:30 GMT', {}, now), 30);
  assert.equal(egress.retryAfterSeconds(null, { retryAfterSeconds: 9 }, now), 9);
  assert.equal(egress.retryAfterSeconds('soon', {}, now), undefined);
});

test('a pool is asked for by name, listed members say their pool, and a scaling pool says when to come back', async () => {
  const member = { ...LEASE.proxy, labels: {}, activeLeases: 0, maxLeases: 5, pool: 'eu' };
  const { client, seen } = answering(200, { proxies: [member] });
  await client.lease('example.com', { pool: 'crawl/eu' });
  const listed = await client.proxies({ pool: 'eu' });
  assert.deepEqual(seen[0].body, { target: 'example.com', pool: 'crawl/eu' });
  assert.equal(seen[1].url.searchParams.get('pool'), 'eu');
  assert.equal(listed[0].pool, 'eu');
  for (const bad of /** @type {any[]} */ (['', 'a/b/c', 'e u', 7])) {
    await assert.rejects(client.lease('example.com', { pool: bad }), TypeError);
  }
  assert.equal(seen.length, 2, 'a bad pool is refused before any request');
  const problem = { type: 'urn:x', title: 't', status: 503, detail: 'no Ready member yet', reason: 'scaling-up' };
  const fetch = async () => new Response(JSON.stringify(problem), { status: 503, headers: { 'retry-after': '42' } });
  const scaling = new egress.DiscoveryClient('http://discovery/', { token: 'token-1', fetch });
  const error = await scaling.lease('example.com', { pool: 'night' }).then(() => assert.fail('leased'), (error) => error);
  assert.ok(error instanceof egress.Unavailable);
  assert.deepEqual([error.reason, error.retryAfter], ['scaling-up', 42]);
});

test('an admin clears cooldowns by target and proxy', async () => {
  const cleared = { cleared: [{ proxy: 'crawl/eu-1', target: 'example.com', until: '2026-12-02T12:00:00Z', streak: 2 }] };
  const { client, seen } = answering(200, cleared, { 'content-type': 'application/json' });
  const entries = await client.clearCooldowns('www.example.com', { proxy: 'crawl/eu-1' });
  assert.deepEqual(entries.map((entry) => [entry.proxy, entry.target, entry.streak]), [['crawl/eu-1', 'example.com', 2]]);
  const request = seen.at(-1);
  assert.equal(request.method, 'DELETE');
  assert.equal(request.url.pathname, '/v1/cooldowns');
  assert.deepEqual(Object.fromEntries(request.url.searchParams), { target: 'www.example.com', proxy: 'crawl/eu-1' });
});

/** A fetch that plays `answers` in turn: an error code to fail with (as undici does), or [status, body]. */
function changingLeader(answers) {
  const seen = [];
  const fetch = async () => {
    seen.push(1);
    const answer = answers[Math.min(seen.length, answers.length) - 1];
    if (typeof answer === 'string') {
      throw new TypeError('fetch failed', { cause: Object.assign(new Error(answer), { code: answer }) });
    }
    const [status, body] = answer;
    return new Response(JSON.stringify(body), { status, headers: { 'content-type': 'application/json' } });
  };
  return { fetch, seen };
}

const NOT_SERVING = [503, { status: 503, reason: 'not-serving', detail: 'handing over' }];

test('a change of leader is waited out within the failover budget', async () => {
  const { fetch, seen } = changingLeader(['ECONNREFUSED', 'UND_ERR_SOCKET', NOT_SERVING, [201, LEASE]]);
  const lease = await new egress.DiscoveryClient('http://discovery', { fetch }).lease('example.com');
  assert.equal(lease.id, LEASE.id);
  assert.equal(seen.length, 4);
});

test('past the budget, or for other answers, the error is thrown at once', async () => {
  let { fetch, seen } = changingLeader([NOT_SERVING]);
  let error = await new egress.DiscoveryClient('http://discovery', { fetch, failoverBudgetMs: 300 }).lease('example.com').catch((error) => error);
  assert.ok(error instanceof egress.Unavailable && error.reason === 'not-serving', String(error));
  assert.ok(seen.length >= 3, `${seen.length} attempts`);
  ({ fetch, seen } = changingLeader(['ECONNREFUSED']));
  error = await new egress.DiscoveryClient('http://discovery', { fetch, failoverBudgetMs: 0 }).lease('example.com').catch((error) => error);
  assert.ok(error instanceof egress.TransportError, String(error));
  assert.equal(seen.length, 1);
  ({ fetch, seen } = changingLeader([[503, { status: 503, reason: 'none-healthy', detail: 'no proxy' }], [201, LEASE]]));
  error = await new egress.DiscoveryClient('http://discovery', { fetch }).lease('example.com').catch((error) => error);
  assert.ok(error instanceof egress.Unavailable && error.reason === 'none-healthy', String(error));
  assert.equal(seen.length, 1, 'an answer about the fleet is the caller\'s to act on');
  assert.throws(() => new egress.DiscoveryClient('http://discovery', { failoverBudgetMs: -1 }), RangeError);
});
