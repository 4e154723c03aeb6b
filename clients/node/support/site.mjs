// The origin the crawl tests fetch: an index linking every page, each page answered according to the address that
// fetched it (each test Squid reaches origins from an address of its own). The banned address gets 403 for every
// page; every other address gets 429 with Retry-After on every `throttleEvery`-th request it makes.

import http from 'node:http';

export class Site {
  constructor({ banned, pages = 200, throttleEvery = 20, retryAfter = 2 }) {
    this.banned = banned;
    this.pages = pages;
    /** [seconds since start, client address, path, status] for every request. */
    this.log = [];
    /** Set by `start`. */
    this.url = '';
    const served = new Map();
    const start = performance.now();
    this.server = http.createServer((request, response) => {
      const client = request.socket.remoteAddress;
      let status = 200;
      const headers = { 'content-type': 'text/html' };
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
    });
  }

  async start() {
    await new Promise((resolve) => this.server.listen(0, '127.0.0.1', () => resolve(undefined)));
    const address = /** @type {import('node:net').AddressInfo} */ (this.server.address());
    this.url = `http://127.0.0.1:${address.port}/`;
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
