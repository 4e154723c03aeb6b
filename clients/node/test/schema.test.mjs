// The client's declared answer and request types against the server's OpenAPI document
// (`docs/discovery-openapi.json`, derived by the server from the very types it serialises): the interfaces in
// `src/` are read with the TypeScript compiler, so a property the server adds, renames, stops sending or makes
// optional fails here. The decoders are checked too: a full answer built from each schema decodes with every
// property read.

import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

import ts from 'typescript';

import * as egress from '../dist/index.js';

const project = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const schemas = JSON.parse(readFileSync(path.join(project, '../../docs/discovery-openapi.json'), 'utf8')).components.schemas;

/** The members of every interface declared in `src/`, by interface name: member name → optional. */
function interfaces() {
  /** @type {Map<string, Map<string, boolean>>} */
  const found = new Map();
  for (const file of ['client.ts', 'errors.ts']) {
    const source = ts.createSourceFile(file, readFileSync(path.join(project, 'src', file), 'utf8'), ts.ScriptTarget.ES2022, true);
    source.forEachChild((node) => {
      if (!ts.isInterfaceDeclaration(node)) return;
      const members = new Map();
      for (const member of node.members) {
        if (ts.isPropertySignature(member) && member.name && ts.isIdentifier(member.name)) {
          members.set(member.name.text, member.questionToken !== undefined);
        }
      }
      found.set(node.name.text, members);
    });
  }
  return found;
}

const declared = interfaces();

/** `[interface, schema, properties the interface leaves to someone else, with why]` for every answer type. */
/** @type {Array<[string, string, string[]]>} */
const answers = [
  ['LeasedProxy', 'ProxyRef', []],
  ['ProxyCredentials', 'ProxyCredentials', []],
  // `replaced` is on renew answers only: renew returns it rather than keeping it.
  ['LeaseState', 'Lease', ['replaced']],
  ['ProxyInfo', 'Proxy', []],
  ['CooldownInfo', 'Cooldown', []],
];

for (const [name, schemaName, elsewhere] of answers) {
  test(`${name} has exactly the properties of ${schemaName}, optional where the server may leave one out`, () => {
    const members = declared.get(name);
    assert.ok(members, `${name} is declared in src/`);
    const schema = schemas[schemaName];
    const expected = Object.keys(schema.properties).filter((property) => !elsewhere.includes(property)).sort();
    assert.deepEqual([...members.keys()].sort(), expected);
    const required = new Set(schema.required ?? []);
    for (const [member, optional] of members) {
      assert.equal(optional, !required.has(member), `${name}.${member}: optional in TypeScript iff not required`);
    }
  });
}

test('LeaseOptions and Report take exactly what the lease and report bodies take', () => {
  const lease = schemas.LeaseRequest;
  assert.equal(lease.additionalProperties, false);
  assert.deepEqual([...(declared.get('LeaseOptions')?.keys() ?? [])].sort(), Object.keys(lease.properties).filter((key) => key !== 'target').sort());
  assert.deepEqual([...(declared.get('Report')?.keys() ?? [])].sort(), Object.keys(schemas.Report.properties).sort());
  assert.deepEqual([...egress.OUTCOMES], schemas.Outcome.enum);
});

/** A value the schema allows, with every property. */
function example(schema) {
  if (schema.$ref) return example(schemas[schema.$ref.split('/').pop()]);
  if (schema.allOf?.length === 1) return example(schema.allOf[0]);
  if (schema.enum) return schema.enum[0];
  switch (schema.type) {
    case 'object':
      return Object.fromEntries(Object.entries(schema.properties ?? {}).map(([key, property]) => [key, example(property)]));
    case 'array':
      return [example(schema.items)];
    case 'integer':
      return Math.max(1, schema.minimum ?? 1);
    case 'number':
      return 0.5;
    case 'boolean':
      return true;
    default:
      return schema.format === 'date-time' ? '2026-12-01T12:00:00Z' : 'crawl';
  }
}

/** The paths under `value` that hold `undefined`. */
function unread(value, at = '') {
  return Object.entries(value).flatMap(([key, held]) => {
    if (held === undefined) return [at + key];
    if (held && typeof held === 'object' && !(held instanceof Date) && !Array.isArray(held)) return unread(held, `${at}${key}.`);
    return [];
  });
}

test('the decoders read every property of a full answer', async () => {
  const lease = example(schemas.Lease);
  const proxy = example(schemas.Proxy);
  const cooldown = example(schemas.Cooldown);
  const fetch = async (url) => {
    const route = new URL(url).pathname;
    const body = route === '/v1/leases' ? lease : route === '/v1/proxies' ? { proxies: [proxy] } : { cooldowns: [cooldown] };
    return new Response(JSON.stringify(body), { status: route === '/v1/leases' ? 201 : 200, headers: { 'content-type': 'application/json' } });
  };
  const client = new egress.DiscoveryClient('http://discovery/', { token: 't', fetch });
  const held = await client.lease('example.com');
  assert.deepEqual(unread({ id: held.id, proxy: held.proxy, url: held.proxyUrl, egressIP: held.egressIP, target: held.target, expiresAt: held.expiresAt }), []);
  assert.deepEqual(unread(held.leasedProxy), [], "every property of a lease's proxy was read, its credentials too");
  assert.deepEqual(Object.keys(held.leasedProxy).sort(), Object.keys(lease.proxy).sort());
  const [listed] = await client.proxies();
  assert.deepEqual(unread(listed), [], 'every property of a listed proxy was read');
  assert.deepEqual(Object.keys(listed).sort(), Object.keys(proxy).sort());
  const [cooling] = await client.cooldowns('example.com');
  assert.deepEqual(Object.keys(cooling).sort(), Object.keys(cooldown).sort());
  assert.deepEqual(unread(cooling), []);
});
