// The client against a live operator (started by `bins/operator/tests/clients.rs`, which sets the environment): real
// discovery API, real Squids, a local origin. Each test uses sites of its own, so their cooldowns never meet.

import assert from 'node:assert/strict';
import http from 'node:http';
import { test } from 'node:test';

import * as egress from '../dist/index.js';

const URL_ = process.env.EGRESS_URL ?? '';
const TOKEN = process.env.EGRESS_TOKEN ?? '';
const ORIGIN = process.env.EGRESS_ORIGIN ?? '';
const PROXIES = Number(process.env.EGRESS_PROXIES ?? '0');
const skip = URL_ ? false : 'needs a live operator: run through `cargo xtask test` (bins/operator/tests/clients.rs)';

/** A GET through an HTTP proxy (a forward proxy gets the absolute URL), as a crawler's HTTP client sends it. */
function getThrough(proxyUrl, target) {
  const proxy = new URL(proxyUrl);
  return new Promise((resolve, reject) => {
    const headers = { host: new URL(target).host };
    if (proxy.username) {
      headers['proxy-authorization'] = `Basic ${Buffer.from(`${decodeURIComponent(proxy.username)}:${decodeURIComponent(proxy.password)}`).toString('base64')}`;
    }
    const request = http.request({ host: proxy.hostname, port: proxy.port, path: target, headers, timeout: 10_000 }, (response) => {
      response.resume();
      response.on('end', () => resolve(response.statusCode));
    });
    request.on('error', reject);
    request.on('timeout', () => request.destroy(new Error('timed out')));
    request.end();
  });
}

async function active(client) {
  return (await client.proxies()).reduce((sum, proxy) => sum + proxy.activeLeases, 0);
}

function secondsUntil(date) {
  return (date.getTime() - Date.now()) / 1000;
}

test('a lease fetches through its proxy, renews, reports and releases', { skip }, async () => {
  const client = new egress.DiscoveryClient(URL_, { token: TOKEN });
  assert.equal((await client.proxies()).length, PROXIES);
  await client.withLease('https://www.js-one.example/page', { ttlSeconds: 60 }, async (lease) => {
    assert.equal(lease.target, 'js-one.example');
    assert.equal(await getThrough(lease.proxyUrl, ORIGIN), 200);
    const [firstId, firstExpiry] = [lease.id, lease.expiresAt];
    assert.equal(await lease.renew(600), false, 'no replacement');
    assert.notEqual(lease.id, firstId);
    assert.ok(lease.expiresAt > firstExpiry);
    await lease.reportCounts(40, 2);
    const listed = (await client.proxies({ target: 'js-one.example' })).find((p) => `${p.namespace}/${p.name}` === lease.proxy);
    assert.ok(listed, 'the leased proxy is listed');
    assert.equal(listed.reported, 42);
    assert.ok(Math.abs((listed.successRate ?? NaN) - 40 / 42) < 1e-9, String(listed.successRate));
    assert.ok(listed.egressIP, 'the probes observed its egress address');
    assert.equal(lease.egressIP, listed.egressIP, 'the lease says which address the site sees');
    assert.equal(await active(client), 1);
  });
  assert.equal(await active(client), 0, 'withLease released the lease');
});

test('a throttle honours the site\'s Retry-After and a ban is listed', { skip }, async () => {
  const client = new egress.DiscoveryClient(URL_, { token: TOKEN });
  const lease = await client.lease('js-two.example');
  const until = await lease.report({ outcome: 'throttled', statusCode: 429, retryAfterSeconds: 20 });
  assert.ok(secondsUntil(until) >= 18 && secondsUntil(until) <= 21, String(until));
  const refused = await client.lease('js-two.example', { proxy: lease.proxy }).then(() => assert.fail('leased'), (e) => e);
  assert.ok(refused instanceof egress.Conflict, String(refused));
  assert.equal(refused.reason, 'proxy-cooling-down');
  assert.ok(refused.retryAfter !== undefined && refused.retryAfter >= 18 && refused.retryAfter <= 21, String(refused.retryAfter));
  const bannedUntil = await lease.report({ outcome: 'banned', statusCode: 403, release: true });
  assert.ok(bannedUntil && until && bannedUntil > until);
  const cooldowns = await client.cooldowns('www.js-two.example');
  assert.deepEqual(cooldowns.map((c) => [c.proxy, c.target, c.streak]), [[lease.proxy, 'js-two.example', 1]]);
  assert.ok(lease.released);
  await lease.release(); // already released by the report: does nothing
  assert.equal(await active(client), 0);
});

test('errors are typed', { skip }, async () => {
  const client = new egress.DiscoveryClient(URL_, { token: TOKEN });
  await assert.rejects(client.resume('l1.AAAA.AAAA'), egress.NotFound);
  await assert.rejects(client.lease('js-three.example', { proxy: 'nowhere/none' }), egress.NotFound);
  await assert.rejects(client.lease('js-three.example', { selector: 're gion=eu' }), (/** @type {unknown} */ e) => e instanceof egress.BadRequest && /selector/.test(e.message));
  await assert.rejects(new egress.DiscoveryClient(URL_, { token: 'not-a-token' }).proxies(), egress.Unauthorized);
  await assert.rejects(new egress.DiscoveryClient('http://127.0.0.1:9', { token: TOKEN, timeoutMs: 2000 }).proxies(), egress.TransportError);
});

test('every proxy cooling down is unavailable with a Retry-After', { skip }, async () => {
  const client = new egress.DiscoveryClient(URL_, { token: TOKEN });
  for (let i = 0; i < PROXIES; i++) {
    await (await client.lease('js-four.example')).report({ outcome: 'throttled', retryAfterSeconds: 30, release: true });
  }
  const refused = await client.lease('js-four.example').then(() => assert.fail('leased'), (e) => e);
  assert.ok(refused instanceof egress.Unavailable, String(refused));
  assert.equal(refused.reason, 'all-cooling-down');
  assert.ok(refused.retryAfter !== undefined && refused.retryAfter > 0 && refused.retryAfter <= 31, String(refused.retryAfter));
});

test('a lease is resumed by its ID, and leases taken at once spread over the proxies', { skip }, async () => {
  const client = new egress.DiscoveryClient(URL_, { token: TOKEN });
  const lease = await client.lease('js-five.example', { ttlSeconds: 60 });
  const resumed = await client.resume(lease.id, 120);
  assert.deepEqual([resumed.proxy, resumed.proxyUrl], [lease.proxy, lease.proxyUrl]);
  await resumed.release();
  const leases = await Promise.all(Array.from({ length: PROXIES }, (_, i) => client.lease(`js-six-${i}.example`)));
  assert.equal(new Set(leases.map((l) => l.proxy)).size, PROXIES, 'least-loaded: one each');
  await Promise.all(leases.map((l) => l.release()));
  assert.equal(await active(client), 0);
});
