// The dashboard in a real Chromium (Debian's /usr/bin/chromium, driven by playwright-core).
// Started by tests/it/browser.rs, which runs relay and the scripted workers and passes:
//   RELAY_URL, API_TOKEN, WORKERS (comma list of the two client ids),
//   FALLBACK_TASK (failed on its first worker, done on the second), XSS_TASK (hostile payload),
//   DELAYED_TASK (pending, to cancel), ARTIFACTS (directory for screenshots), USER_DATA_DIR.
// Exit code 0 = every check passed; any failure prints why and exits 1.
import { chromium } from 'playwright-core';
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';

const env = (name) => {
  const v = process.env[name];
  if (!v) throw new Error(`missing env ${name}`);
  return v;
};
const base = env('RELAY_URL');
const token = env('API_TOKEN');
const workers = env('WORKERS').split(',');
const fallbackTask = env('FALLBACK_TASK');
const xssTask = env('XSS_TASK');
const delayedTask = env('DELAYED_TASK');
const artifacts = env('ARTIFACTS');
mkdirSync(artifacts, { recursive: true });

function check(ok, what) {
  if (!ok) throw new Error('check failed: ' + what);
  console.log('ok -', what);
}

// The whole run is bounded: a hung browser must not hang cargo test.
const watchdog = setTimeout(() => {
  console.error('browser test: over 90 s, giving up');
  process.exit(1);
}, 90_000);

// A fresh profile directory (playwright passes it to Chromium as --user-data-dir).
const context = await chromium.launchPersistentContext(env('USER_DATA_DIR'), {
  executablePath: '/usr/bin/chromium',
  headless: true,
  viewport: { width: 1360, height: 1000 },
  args: [
    '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
    '--disable-component-update', '--disable-sync',
  ],
});
let failed = false;
try {
  const page = await context.newPage();
  page.setDefaultTimeout(10_000);
  const dialogs = [];
  page.on('dialog', (d) => {
    dialogs.push(d.message());
    d.dismiss();
  });
  const pageErrors = [];
  page.on('pageerror', (e) => pageErrors.push(String(e)));
  // Every request the page makes, to prove the token never travels in a URL and nothing
  // leaves for another origin.
  const urls = [];
  page.on('request', (r) => urls.push(r.url()));

  const res = await page.goto(base + '/ui');
  check(res.status() === 200, '/ui answers 200');
  const headers = res.headers();
  check((headers['content-security-policy'] || '').includes("script-src 'self'"), 'a strict CSP is sent');
  check(headers['x-content-type-options'] === 'nosniff', 'nosniff is sent');
  await page.locator('#tasks-page', { hasText: 'Type the API token' }).waitFor();
  check(true, 'without a token the page asks for one');

  // Log in.
  await page.fill('#token', token);
  await page.click('#use-token');
  await page.locator('#whoami', { hasText: 'token accepted' }).waitFor();
  check((await page.inputValue('#token')) === '', 'the token field is cleared after use');
  check((await page.evaluate(() => sessionStorage.getItem('relay.token'))) === token, 'the token is in sessionStorage');
  check((await page.evaluate(() => localStorage.length + document.cookie.length)) === 0, 'nothing in localStorage or cookies');

  // Two workers.
  await page.waitForFunction(() => document.querySelectorAll('#workers tr').length === 2);
  const shown = await page.$$eval('#workers tr td:first-child', (tds) => tds.map((td) => td.textContent));
  check(workers.every((w) => shown.includes(w)), 'both workers are listed: ' + shown.join(', '));

  // Counts and the chart fill in.
  await page.waitForFunction(() => /^\d+$/.test(document.getElementById('count-done').textContent));
  await page.waitForFunction(() => document.querySelectorAll('#chart polyline').length === 2, null, { timeout: 15_000 });
  check(true, 'the chart draws done and failed');

  // Let the chart gather a few points for the screenshot.
  await page.waitForFunction(() => {
    const p = document.querySelector('#chart polyline.done');
    return p && p.getAttribute('points').split(' ').length >= 4;
  }, null, { timeout: 20_000 });
  await page.screenshot({ path: join(artifacts, 'dashboard.png') });
  check(true, 'screenshot dashboard.png written');

  // Filter the list down to the fallback task's kind (the chart's traffic is another kind)
  // and open the task from there.
  await page.fill('#f-kind', 'fetch');
  await page.selectOption('#f-status', 'done');
  await page.click('#filters button[type=submit]');
  const link = page.locator(`#tasks a[href="#/task/${fallbackTask}"]`);
  await link.waitFor();
  const kinds = await page.$$eval('#tasks tr td:nth-child(3)', (tds) => tds.map((td) => td.textContent));
  check(kinds.length > 0 && kinds.every((k) => k === 'fetch'), 'the kind filter lists only that kind');
  await link.click();
  await page.locator('#t-id', { hasText: fallbackTask }).waitFor();
  await page.waitForFunction(() => document.querySelectorAll('#t-attempts li[data-outcome]').length === 2);
  const attempts = await page.$$eval('#t-attempts li', (lis) =>
    lis.map((li) => ({ outcome: li.dataset.outcome, worker: li.querySelector('code').textContent, text: li.textContent })));
  check(attempts[0].outcome === 'failed' && attempts[1].outcome === 'done', 'attempt 1 failed, attempt 2 done');
  check(attempts[0].worker !== attempts[1].worker && workers.includes(attempts[0].worker) && workers.includes(attempts[1].worker),
    'the two attempts ran on the two workers');
  check(attempts[0].text.includes('upstream refused'), 'the first attempt says why it failed');
  check((await page.textContent('#t-status')) === 'done', 'the task is done');
  check(await page.locator('#t-cancel').isHidden(), 'no cancel button on a final task');
  await page.screenshot({ path: join(artifacts, 'task.png'), fullPage: true });
  check(true, 'screenshot task.png written');

  // A hostile payload is shown as text and runs nothing.
  await page.goto(base + '/ui#/task/' + xssTask);
  await page.locator('#t-id', { hasText: xssTask }).waitFor();
  await page.locator('#t-result', { hasText: '<script>' }).waitFor();
  const resultText = await page.textContent('#t-result');
  check(resultText.includes('<img src=x onerror='), 'the payload is shown literally, as text');
  await page.goto(base + '/ui#/');
  // The hostile kind, typed into the filter, reaches relay intact (URL-encoded) and back.
  await page.fill('#f-kind', '<img src=x onerror=window.__xss=1>');
  await page.selectOption('#f-status', '');
  await page.click('#filters button[type=submit]');
  await page.locator(`#tasks a[href="#/task/${xssTask}"]`).waitFor();
  const kindCells = await page.$$eval('#tasks td', (tds) => tds.map((td) => td.textContent));
  check(kindCells.some((t) => t.includes('<img')), 'a hostile kind is listed as text');
  await page.waitForTimeout(500); // give an (impossible) onerror time to fire
  check((await page.evaluate(() => window.__xss)) === undefined, 'no script from the payload ran');
  check((await page.evaluate(() => document.querySelectorAll('img, script:not([src])').length)) === 0,
    'no element was created from the payload');
  check(dialogs.length === 0, 'no dialog was opened');

  // Cancel a pending task from its page.
  await page.goto(base + '/ui#/task/' + delayedTask);
  await page.locator('#t-status', { hasText: 'pending' }).waitFor();
  await page.click('#t-cancel');
  await page.locator('#t-status', { hasText: 'canceled' }).waitFor();
  check(await page.locator('#t-cancel').isHidden(), 'cancel button: the task is canceled and the button goes');

  check(pageErrors.length === 0, 'no script errors: ' + pageErrors.join('; '));
  check(urls.every((u) => u.startsWith(base) && !u.includes(token)), 'every request stays on relay and no URL carries the token');
} catch (err) {
  failed = true;
  console.error(String(err && err.stack ? err.stack : err));
  try {
    const pages = context.pages();
    if (pages.length) await pages[pages.length - 1].screenshot({ path: join(artifacts, 'failure.png'), fullPage: true });
  } catch {}
} finally {
  await context.close();
  clearTimeout(watchdog);
}
process.exit(failed ? 1 : 0);
