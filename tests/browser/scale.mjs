// Measures the dashboard against a loaded relay (see tests/browser/README.md): DOM size, JS
// heap, and how long the page's calls take, at first load and after minutes of polling (the
// last run's figures are in docs/operating.md, "Dashboard").
// Usage: RELAY_URL=http://127.0.0.1:PORT API_TOKEN=... node scale.mjs [seconds]
import { chromium } from 'playwright-core';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const base = process.env.RELAY_URL;
const token = process.env.API_TOKEN;
const soakSeconds = Number(process.argv[2] || 60);
const dir = mkdtempSync(join(tmpdir(), 'relay-scale-'));
const context = await chromium.launchPersistentContext(dir, {
  executablePath: '/usr/bin/chromium', headless: true, viewport: { width: 1360, height: 1000 },
  args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
    '--disable-component-update', '--disable-sync', '--enable-precise-memory-info'],
});
const page = await context.newPage();
const cdp = await context.newCDPSession(page);
await cdp.send('Performance.enable');
const metrics = async () => {
  await cdp.send('HeapProfiler.collectGarbage');
  const m = Object.fromEntries((await cdp.send('Performance.getMetrics')).metrics.map((x) => [x.name, x.value]));
  return { heapMiB: +(m.JSHeapUsedSize / 1048576).toFixed(2), nodes: m.Nodes, domElements: await page.evaluate(() => document.getElementsByTagName('*').length) };
};
const timings = [];
page.on('requestfinished', async (r) => {
  const t = r.timing();
  const size = (await r.sizes().catch(() => ({ responseBodySize: 0 }))).responseBodySize;
  timings.push({ url: r.url().replace(base, ''), ms: +(t.responseEnd - t.requestStart).toFixed(1), bytes: size });
});
const t0 = Date.now();
await page.goto(base + '/ui');
await page.fill('#token', token);
await page.click('#use-token');
await page.waitForFunction(() => document.querySelectorAll('#workers tr').length > 0 && document.querySelectorAll('#tasks tr td a').length > 0, null, { timeout: 30000 });
console.log('first render with workers and tasks:', Date.now() - t0, 'ms');
console.log('after first render:', await metrics());
const show = (re) => timings.filter((t) => re.test(t.url)).slice(-3);
console.log('/clients:', show(/^\/clients/));
console.log('/tasks page:', show(/^\/tasks\?/));
// Page through 20 pages of the list, then a rare filter.
let t = Date.now();
for (let i = 0; i < 20; i++) {
  const before = await page.textContent('#tasks-page');
  await page.click('#tasks-older');
  await page.waitForFunction((b) => document.getElementById('tasks-page').textContent !== b, before);
}
console.log('20 pages older:', Date.now() - t, 'ms; elements', (await metrics()).domElements);
t = Date.now();
await page.selectOption('#f-status', 'canceled');
await page.click('#filters button[type=submit]');
await page.waitForFunction(() => !list.busy && /^page 1\b/.test(document.getElementById('tasks-page').textContent));
console.log('status=canceled (no match in 100k):', Date.now() - t, 'ms,', timings.filter((x) => /status=canceled/.test(x.url)).length, 'calls');
await page.selectOption('#f-status', 'failed');
await page.click('#filters button[type=submit]');
t = Date.now();
await page.waitForFunction(() => document.querySelectorAll('#tasks tr td a').length > 0);
console.log('status=failed first page:', Date.now() - t, 'ms');
for (let i = 0; i < 39; i++) await page.click('#workers-next');
console.log('workers page:', await page.textContent('#workers-page'));
await page.waitForTimeout(soakSeconds * 1000);
console.log(`after ${soakSeconds}s of polling:`, await metrics(), 'chart points:', await page.evaluate(() => document.querySelector('#chart polyline.done')?.getAttribute('points').split(' ').length));
console.log('/clients latest:', show(/^\/clients/));
console.log('/metrics latest:', show(/^\/metrics/));
await context.close();
rmSync(dir, { recursive: true, force: true });
