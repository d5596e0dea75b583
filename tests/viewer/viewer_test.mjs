// The tree viewer in a real browser (Debian's chromium driven by playwright-core) against a
// live server: the page must ask for the API key, list the tree this script creates over the
// HTTP tree API, draw its 4 forks, show their text growing while Generate streams, keep the
// pruned ones as pruned, say when the tree is gone, and stop reading (so stop renewing) a
// tree that has been quiet. Screenshots land in OUT_DIR.
//
// usage: node viewer_test.mjs BASE_URL API_KEY OUT_DIR [MAX_TOKENS]
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import {chromium} from 'playwright-core';

const [base, apiKey, outDir, maxTokensArg] = process.argv.slice(2);
const maxTokens = Number(maxTokensArg || 1000);
const timeout = 15000;
fs.mkdirSync(outDir, {recursive: true});

function log(...args) { console.log(`[${(performance.now() / 1000).toFixed(2)}s]`, ...args); }

async function call(method, route, body) {
  const res = await fetch(base + route, {
    method,
    headers: {Authorization: 'Bearer ' + apiKey, 'Content-Type': 'application/json'},
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await res.text();
  assert.ok(res.ok, `${method} ${route}: HTTP ${res.status}: ${text}`);
  return JSON.parse(text);
}

// Streams Generate; `events` fills as tokens arrive, `done` resolves after [DONE].
function streamGenerate(treeId, body) {
  const stream = {events: [], finished: false};
  stream.done = (async () => {
    const res = await fetch(`${base}/v1/trees/${treeId}/generate`, {
      method: 'POST',
      headers: {Authorization: 'Bearer ' + apiKey, 'Content-Type': 'application/json'},
      body: JSON.stringify({...body, stream: true}),
    });
    if (res.status !== 200) assert.fail(`generate: HTTP ${res.status}: ${await res.text()}`);
    const decoder = new TextDecoder();
    let buffer = '', sawDone = false;
    for await (const chunk of res.body) {
      buffer += decoder.decode(chunk, {stream: true});
      let cut;
      while ((cut = buffer.indexOf('\n\n')) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split('\n')) {
          if (!line.startsWith('data:')) continue;
          const data = line.slice(5).trim();
          if (data === '[DONE]') { sawDone = true; continue; }
          const e = JSON.parse(data);
          assert.ok(!e.error, 'generate stream error: ' + data);
          stream.events.push(e);
        }
      }
    }
    assert.ok(sawDone, 'the stream ended without [DONE]');
    stream.finished = true;
  })();
  return stream;
}

const userDataDir = fs.mkdtempSync(path.join(outDir, 'chromium-profile-'));
const context = await chromium.launchPersistentContext(userDataDir, {
  executablePath: '/usr/bin/chromium',
  headless: true,
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
         '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  viewport: {width: 1400, height: 1000},
});
const page = context.pages()[0] || await context.newPage();
page.setDefaultTimeout(timeout);

// The page may reach only its own server, and must not throw or break its CSP.
const problems = [];
const origin = new URL(base).origin;
page.on('request', (r) => {
  if (!r.url().startsWith(origin + '/') && !r.url().startsWith('data:')) problems.push('request to ' + r.url());
});
page.on('pageerror', (e) => problems.push('page error: ' + e.message));
page.on('console', (m) => {
  // The browser logs every failed fetch; the 401 and 404 this script provokes are expected.
  if (m.type() === 'error' && !/status of (401|404)/.test(m.text())) problems.push('console: ' + m.text());
});

const rowsOf = (ids) => page.evaluate((ids) => ids.map((id) => {
  const g = document.querySelector(`#graph g.row[data-branch-id="${id}"]`);
  const tr = document.querySelector(`#branch-rows tr[data-branch-id="${id}"]`);
  return g && tr ? {state: g.dataset.state, textLength: Number(g.dataset.textLength),
                    parent: tr.dataset.parent, tokens: Number(tr.dataset.tokens),
                    finish: tr.dataset.finish, pruned: tr.classList.contains('pruned'),
                    text: tr.querySelector('td.text').title}
               : null;
}), ids);

try {
  // 1. No key yet: the page says the server wants one; with the key the pool shows.
  log('open', base + '/viewer');
  await page.goto(base + '/viewer');
  await page.waitForFunction(() => document.getElementById('status').textContent.includes('wants an API key (401'));
  await page.fill('#api-key', apiKey);
  await page.click('#key-form button[type=submit]');
  await page.waitForFunction(() => document.querySelector('#pool-fields') !== null);
  await page.waitForFunction(() => document.getElementById('status').textContent === '');
  log('key accepted, pool shown');

  // 2. A tree made over the HTTP API appears in the list; picking it draws its root. The
  // prompt holds markup that must show as text.
  const prompt = 'The tree <img src=x onerror="window.__pwned=1"> & grows';
  const tree = await call('POST', '/v1/trees', {prompt});
  log('tree', tree.id, 'root', tree.root_branch_id);
  await page.waitForSelector(`#tree-list button[data-tree-id="${tree.id}"]`);
  await page.click(`#tree-list button[data-tree-id="${tree.id}"]`);
  assert.equal(new URL(page.url()).hash, '#tree=' + encodeURIComponent(tree.id));
  await page.waitForSelector(`#graph g.row[data-branch-id="${tree.root_branch_id}"]`);
  const [root] = await rowsOf([tree.root_branch_id]);
  assert.equal(root.parent, '');
  assert.ok(root.text.includes('<img src=x'), 'the root row shows the prompt as text: ' + root.text);
  assert.equal(await page.evaluate(() => document.querySelectorAll('img').length), 0);

  // 3. Forked 4 ways: 4 rows hang from the root.
  const {branch_ids: kids} = await call('POST', `/v1/trees/${tree.id}/branch`,
                                        {branch_id: tree.root_branch_id, n: 4});
  assert.equal(kids.length, 4);
  await page.waitForFunction((n) => document.querySelectorAll('#graph g.row').length === n, 5);
  for (const r of await rowsOf(kids)) assert.equal(r.parent, tree.root_branch_id);
  log('4 forks drawn');

  // 4. Generate streams: between two observations during the stream a branch's text grows.
  const stream = streamGenerate(tree.id, {branch_ids: kids, max_tokens: maxTokens,
                                          temperature: 1.0, seed: 7});
  await page.waitForFunction((ids) => ids.some((id) => {
    const g = document.querySelector(`#graph g.row[data-branch-id="${id}"]`);
    return g && g.dataset.state === 'generating' && Number(g.dataset.textLength) > 0;
  }), kids, {polling: 20});
  const first = await rowsOf(kids);
  const firstDuring = !stream.finished;
  log('observation 1', first.map((r) => `${r.state}:${r.textLength}`).join(' '), 'events', stream.events.length);
  await page.screenshot({path: path.join(outDir, 'viewer-streaming.png'), fullPage: true});
  await page.waitForFunction(([ids, before]) => ids.some((id, i) => {
    const g = document.querySelector(`#graph g.row[data-branch-id="${id}"]`);
    return g && Number(g.dataset.textLength) > before[i];
  }), [kids, first.map((r) => r.textLength)], {polling: 20});
  const second = await rowsOf(kids);
  const secondDuring = !stream.finished;
  log('observation 2', second.map((r) => `${r.state}:${r.textLength}`).join(' '), 'events', stream.events.length);
  assert.ok(firstDuring && secondDuring,
            `both observations must fall inside the stream (raise MAX_TOKENS, now ${maxTokens})`);
  assert.ok(second.some((r, i) => r.textLength > first[i].textLength));
  await stream.done;
  log('stream done:', stream.events.length, 'tokens');

  // Once it ends every fork is idle with a finish reason and as many tokens as it streamed.
  const streamed = kids.map((id) => stream.events.filter((e) => e.branch_id === id).length);
  await page.waitForFunction(([ids, counts]) => ids.every((id, i) => {
    const tr = document.querySelector(`#branch-rows tr[data-branch-id="${id}"]`);
    return tr && tr.dataset.state === 'idle' && tr.dataset.finish !== '' &&
           Number(tr.dataset.tokens) === counts[i];
  }), [kids, streamed]);
  log('final token counts', streamed.join(' '));

  // 5. Pruned branches stay on the page, marked pruned; the others stay live.
  const pruned = kids.slice(0, 2), kept = kids.slice(2);
  const prune = await call('POST', `/v1/trees/${tree.id}/prune`, {branch_ids: pruned});
  assert.equal(prune.pruned_branches, 2);
  await page.waitForFunction((ids) => ids.every((id) =>
    document.querySelector(`#graph g.row[data-branch-id="${id}"]`)?.dataset.state === 'pruned'), pruned);
  for (const r of await rowsOf(pruned)) assert.ok(r.pruned && r.textLength > 0 && r.tokens > 0);
  for (const r of await rowsOf(kept)) assert.equal(r.state, 'idle');
  assert.equal(await page.locator('#graph g.row').count(), 5);
  await page.uncheck('#show-pruned');
  assert.equal(await page.locator('#graph g.row').count(), 3);
  await page.check('#show-pruned');
  assert.equal(await page.locator('#graph g.row').count(), 5);
  log('pruned shown as pruned');

  // The detail panel holds a branch's whole text.
  await page.click(`#graph g.row[data-branch-id="${kept[0]}"]`);
  await page.waitForSelector('#detail:not([hidden])');
  const [keptRow] = await rowsOf([kept[0]]);
  assert.equal(await page.textContent('#detail-text'), keptRow.text);
  const shot = path.join(outDir, 'viewer.png');
  await page.screenshot({path: shot, fullPage: true});
  log('screenshot', shot);

  // 6. A deleted tree: the page says it is gone.
  await call('DELETE', `/v1/trees/${tree.id}`);
  await page.waitForFunction(() => document.getElementById('status').textContent.includes('is gone (404'));
  await page.waitForFunction((id) => !document.querySelector(`#tree-list button[data-tree-id="${id}"]`), tree.id);
  log('deleted tree reported gone');

  // 7. Reading a tree renews its lease, so the page stops reading a quiet one (here after
  // 2 s) until the user resumes.
  const idle = await call('POST', '/v1/trees', {prompt: 'A quiet tree'});
  let reads = 0;
  const countReads = (r) => { if (r.url().includes(`/v1/trees/${idle.id}`)) reads++; };
  page.on('request', countReads);
  await page.goto(`${base}/viewer?pause_after_s=2#tree=${encodeURIComponent(idle.id)}`);
  await page.waitForSelector(`#graph g.row[data-branch-id="${idle.root_branch_id}"]`);
  await page.waitForSelector('#resume:not([hidden])', {timeout: 10000});
  assert.match(await page.textContent('#tree-note'), /^Paused/);
  const readsAtPause = reads;
  await page.waitForTimeout(1500);
  assert.equal(reads, readsAtPause, 'the page kept reading a paused tree');
  await page.click('#resume');
  await page.waitForSelector('#resume', {state: 'hidden'});
  await page.waitForFunction(() => document.getElementById('tree-note').hidden);
  assert.ok(reads > readsAtPause, 'resuming reads the tree again');
  page.off('request', countReads);
  await call('DELETE', `/v1/trees/${idle.id}`);
  log('a quiet tree pauses and resumes');

  assert.equal(await page.evaluate(() => window.__pwned), undefined);
  assert.deepEqual(problems, []);
  log('viewer test passed');
} catch (e) {
  await page.screenshot({path: path.join(outDir, 'viewer-failure.png'), fullPage: true}).catch(() => {});
  console.error('problems seen:', problems);
  throw e;
} finally {
  await context.close();
  fs.rmSync(userDataDir, {recursive: true, force: true});
}
