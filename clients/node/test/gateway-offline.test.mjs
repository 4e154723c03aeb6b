// The gateway helpers without a gateway: the proxy URLs they build, what they refuse, and the report request they
// send (to a local HTTP server standing in for the gateway's `POST /report`).

import assert from 'node:assert/strict';
import http from 'node:http';
import { test } from 'node:test';

import { GatewayError, gatewayProxyUrl, reportToGateway } from '../dist/index.js';

test('the proxy URL carries the options and an encoded token', () => {
  // No options: the user name `rotate` (many clients send no credentials for an empty one).
  assert.equal(gatewayProxyUrl('http://gw:8088', 't0ken'), 'http://rotate:t0ken@gw:8088');
  const url = new URL(
    gatewayProxyUrl('gw.example:8088', 'a/b:c@d', { session: 's-1', sticky: 60, pool: 'crawl.eu', zone: 'eu-1a', labels: { tier: 'dc' } }),
  );
  assert.equal(decodeURIComponent(url.username), 'session-s-1,sticky-60,pool-crawl.eu,zone-eu-1a,label-tier=dc');
  assert.equal(decodeURIComponent(url.password), 'a/b:c@d');
  assert.equal(url.host, 'gw.example:8088');
  const limited = new URL(gatewayProxyUrl('gw:8088', 't', { session: 's', lifetime: 300, requests: 20 }));
  assert.equal(decodeURIComponent(limited.username), 'session-s,lifetime-300,requests-20');
});

test('options the gateway would refuse are refused here', () => {
  /** @type {Array<[string, string, import('../dist/index.js').GatewayOptions, RegExp]>} */
  const cases = [
    ['https://gw:8088', 't', {}, /http:\/\/host:port/],
    ['http://u:p@gw:8088', 't', {}, /without credentials/],
    ['http://gw:8088', '', {}, /token/],
    ['http://gw:8088', 't', { session: 'a b' }, /session/],
    ['http://gw:8088', 't', { session: 'x'.repeat(129) }, /session/],
    ['http://gw:8088', 't', { sticky: 60 }, /with a session/],
    ['http://gw:8088', 't', { session: 's', sticky: 0 }, /1-86400/],
    ['http://gw:8088', 't', { lifetime: 60 }, /with a session/],
    ['http://gw:8088', 't', { session: 's', lifetime: 86_401 }, /1-86400 seconds/],
    ['http://gw:8088', 't', { requests: 5 }, /with a session/],
    ['http://gw:8088', 't', { session: 's', requests: 0 }, /1-1000000/],
    ['http://gw:8088', 't', { pool: 'a,b' }, /comma/],
    ['http://gw:8088', 't', { labels: { 'k=': 'v' } }, /label/],
  ];
  for (const [gateway, token, options, why] of cases) {
    assert.throws(() => gatewayProxyUrl(gateway, token, options), why, JSON.stringify(options));
  }
});

/** A stand-in for the gateway's `POST /report`, answering `status` and keeping what it was sent. */
async function fakeGateway(status) {
  const seen = [];
  const server = http.createServer((request, response) => {
    seen.push({ method: request.method, url: request.url, headers: request.headers });
    const headers = { 'content-type': 'application/json' };
    if (status !== 200) headers['proxy-status'] = 'egress-gateway; error=http_request_error; details="no session"';
    response.writeHead(status, headers);
    response.end(JSON.stringify({ proxy: 'crawl/eu-1', target: 'shop.example' }));
  });
  await new Promise((resolve) => server.listen(0, '127.0.0.1', () => resolve(undefined)));
  const { port } = /** @type {import('node:net').AddressInfo} */ (server.address());
  return { seen, server, address: `127.0.0.1:${port}` };
}

test("a report is a POST to the gateway with the session's credentials", async () => {
  const gateway = await fakeGateway(200);
  const proxy = gatewayProxyUrl(gateway.address, 't0ken', { session: 'a1' });
  assert.equal(await reportToGateway(proxy, 'https://Shop.example:8443/item?x=1', 'throttled', { retryAfterSeconds: 2.4 }), 'crawl/eu-1');
  assert.equal(await reportToGateway(proxy, 'shop.example', 'banned'), 'crawl/eu-1');
  gateway.server.close();
  const [first, second] = gateway.seen;
  assert.equal(first.method, 'POST');
  assert.equal(first.url, '/report?target=shop.example%3A8443');
  assert.equal(second.url, '/report?target=shop.example');
  assert.equal(first.headers['x-egress-report'], 'throttled; retry-after=2');
  assert.equal(second.headers['x-egress-report'], 'banned');
  assert.equal(Buffer.from(first.headers['proxy-authorization'].replace('Basic ', ''), 'base64').toString(), 'session-a1:t0ken');
});

test('a refused or unreachable report rejects with the reason', async () => {
  const gateway = await fakeGateway(400);
  const proxy = gatewayProxyUrl(gateway.address, 't0ken', { session: 'a1' });
  await assert.rejects(reportToGateway(proxy, 'shop.example', 'banned'), (error) => {
    assert.ok(error instanceof GatewayError && error.status === 400 && /no session/.test(error.message), String(error));
    return true;
  });
  await new Promise((resolve) => gateway.server.close(resolve));
  await assert.rejects(reportToGateway(proxy, 'shop.example', 'banned', { timeoutMs: 2000 }), /could not be reached/);
  await assert.rejects(reportToGateway(gatewayProxyUrl(gateway.address, 't0ken'), 'shop.example', 'banned'), /session-<id>/);
  await assert.rejects(reportToGateway(proxy, 'shop.example', /** @type {any} */ ('blocked')), /one of banned, throttled/);
});
