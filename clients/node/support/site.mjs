// The origin the crawl tests fetch: an index linking every page, each page answered according to the address that
// fetched it (each test Squid reaches origins from an address of its own). The banned address gets 403 for every
// page; every other address gets 429 with Retry-After on every `throttleEvery`-th request it makes.

import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import http from 'node:http';
import https from 'node:https';
import { tmpdir } from 'node:os';
import path from 'node:path';

/** A fresh self-signed certificate for 127.0.0.1 (made by the openssl command). */
function selfSigned() {
  const dir = mkdtempSync(path.join(tmpdir(), 'egress-site-tls-'));
  try {
    const [key, cert] = [path.join(dir, 'key.pem'), path.join(dir, 'cert.pem')];
    execFileSync('openssl', ['req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes',
      '-keyout', key, '-out', cert, '-days', '1', '-subj', '/CN=127.0.0.1', '-addext', 'subjectAltName=IP:127.0.0.1'],
      { stdio: 'pipe' });
    return { key: readFileSync(key), cert: readFileSync(cert) };
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

export class Site {
  constructor({ banned, pages = 200, throttleEvery = 20, retryAfter = 2, tls = false }) {
    this.banned = banned;
    this.pages = pages;
    /** [seconds since start, client address, path, status] for every request. */
    this.log = [];
    /** Set by `start`. */
    this.url = '';
    const served = new Map();
    const start = performance.now();
    /** When it started (`performance.now()`): the log's times count from it. */
    this.startedAt = start;
    this.tls = tls;
    const handler = (request, response) => {
      const client = request.socket.remoteAddress;
      let status = 200;
      // Who fetched it, for a crawler that cannot see which proxy its tunnel went through.
      const headers = { 'content-type': 'text/html', 'x-seen-from': String(client) };
      if (client === banned) {
        status = 403;
      } else {
        served.set(client, (served.get(client) ?? 0) + 1);
        if (served.get(client) % throttleEvery === 0) {
          status = 429;
          headers['retry-after'] = String(retryAfter);
        }
      }
      this.log.push([(performance.now() - start) / 1000, client, request.url, status]);
      let body = 'no';
      if (status === 200) {
        body =
          request.url === '/'
            ? Array.from({ length: pages }, (_, i) => `<a href="/page/${i}">${i}</a>`).join('')
            : `<p>${request.url}</p>`;
      }
      response.writeHead(status, headers);
      response.end(`<html><body>${body}</body></html>`);
    };
    this.server = tls ? https.createServer(selfSigned(), handler) : http.createServer(handler);
  }

  async start() {
    await new Promise((resolve) => this.server.listen(0, '127.0.0.1', () => resolve(undefined)));
    const address = /** @type {import('node:net').AddressInfo} */ (this.server.address());
    this.url = `${this.tls ? 'https' : 'http'}://127.0.0.1:${address.port}/`;
    return this;
  }

  async stop() {
    this.server.closeAllConnections();
    await new Promise((resolve) => this.server.close(resolve));
  }
}

/** Every request the discovery API has answered, from the operator's own metrics. */
export async function apiRequests(metricsUrl) {
  const text = await (await fetch(`${metricsUrl}/metrics`)).text();
  return text
    .split('\n')
    .filter((line) => line.startsWith('egress_discovery_requests_total{'))
    .reduce((sum, line) => sum + Number(line.slice(line.lastIndexOf(' ') + 1)), 0);
}
