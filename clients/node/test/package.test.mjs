// The package as a user installs it: `npm pack` makes a tarball (building it first), which installs into a clean
// project with no registry (it has no dependencies of its own; crawlee is an optional peer) and imports, typed.

import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdtemp, mkdir, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

const project = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');

function run(command, args, cwd) {
  try {
    return execFileSync(command, args, { cwd, encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'], timeout: 300_000 });
  } catch (error) {
    assert.fail(`${command} ${args.join(' ')}:\n${error.stdout ?? ''}\n${error.stderr ?? ''}`);
  }
}

test('npm pack makes a tarball that installs into a clean project and imports, typed', { timeout: 300_000 }, async () => {
  const tmp = await mkdtemp(path.join(tmpdir(), 'egress-npm-pack-'));
  try {
    const packed = JSON.parse(run('npm', ['pack', '--json', '--pack-destination', tmp, '--cache', path.join(tmp, 'cache')], project));
    const files = packed[0].files.map((file) => file.path).sort();
    assert.ok(files.includes('dist/index.js') && files.includes('dist/index.d.ts') && files.includes('dist/crawlee.d.ts'), String(files));
    assert.ok(!files.some((file) => file.startsWith('src/') || file.startsWith('test/')), String(files));
    const tarball = path.join(tmp, packed[0].filename);
    const clean = path.join(tmp, 'clean');
    await mkdir(clean);
    await writeFile(path.join(clean, 'package.json'), JSON.stringify({ name: 'consumer', private: true, type: 'module' }));
    run('npm', ['install', '--offline', '--no-audit', '--no-fund', '--cache', path.join(tmp, 'cache'), tarball], clean);
    const out = run(
      'node',
      ['--input-type=module', '-e', "const m = await import('egress-operator-client'); console.log(typeof m.DiscoveryClient, new m.Unavailable('x', { reason: 'r' }).name);"],
      clean,
    );
    assert.equal(out.trim(), 'function Unavailable');
    // The types a TypeScript user gets: a consumer type-checks against the installed declarations.
    await writeFile(
      path.join(clean, 'consumer.ts'),
      [
        "import { DiscoveryClient, Unavailable, type Lease } from 'egress-operator-client';",
        "const client = new DiscoveryClient('http://egress-discovery.egress-system:8090', { token: 't' });",
        "async function crawl(): Promise<number | undefined> {",
        "  const lease: Lease = await client.lease('shop.example.com', { ttlSeconds: 60 });",
        "  await lease.report({ outcome: 'throttled', retryAfterSeconds: 5 });",
        "  try { await client.lease('x'); } catch (e) { if (e instanceof Unavailable) return e.retryAfter; }",
        "  return lease.expiresAt.getTime();",
        '}',
        'void crawl;',
      ].join('\n'),
    );
    run(
      path.join(project, 'node_modules/.bin/tsc'),
      ['--noEmit', '--strict', '--module', 'nodenext', '--moduleResolution', 'nodenext', '--target', 'es2022', '--typeRoots', path.join(project, 'node_modules/@types'), '--types', 'node', 'consumer.ts'],
      clean,
    );
    assert.ok(existsSync(path.join(clean, 'node_modules/egress-operator-client/dist/index.d.ts')));
  } finally {
    await rm(tmp, { recursive: true, force: true });
  }
});
