// The dashboard in a real Chromium (Debian's /usr/bin/chromium, driven by playwright-core).
// Started by tests/it/browser.rs, which runs relay and the scripted workers and passes:
//   RELAY_URL, API_TOKEN, WORKERS (comma list of the two client ids),
//   FALLBACK_TASK (failed on its first worker, done on the second), XSS_TASK (hostile payload),
//   DELAYED_TASK (pending, hostile text in its payload, to cancel), FAILED_TASK (failed, to retry),
//   ARTIFACTS (directory for screenshots), USER_DATA_DIR.
// Exit code 0 = every check passed; any failure prints why and exits 1.
// axe-core (locked in package-lock.json) checks the main views at desktop and phone sizes.
import { chromium } from 'playwright-core';
import { mkdirSync, readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
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
const failedTask = env('FAILED_TASK');
const artifacts = env('ARTIFACTS');
mkdirSync(artifacts, { recursive: true });

function check(ok, what) {
  if (!ok) throw new Error('check failed: ' + what);
  console.log('ok -', what);
}

const DESKTOP = { width: 1280, height: 800 };
const PHONE = { width: 390, height: 844 };

// axe-core's own bundle, evaluated in the page through the DevTools protocol (the page's CSP,
// which allows no inline script, stays on for everything the page itself runs).
const axeSource = readFileSync(createRequire(import.meta.url).resolve('axe-core/axe.min.js'), 'utf8');

// Runs axe-core on the page as it is; fails on any serious or critical violation, and prints
// the others (minor, moderate) so they are seen.
async function axeCheck(page, view) {
  if (!(await page.evaluate(() => typeof window.axe === 'object'))) await page.evaluate(axeSource);
  const { violations } = await page.evaluate(() =>
    window.axe.run(document, { resultTypes: ['violations'], runOnly: { type: 'tag', values: ['wcag2a', 'wcag2aa', 'wcag21a', 'wcag21aa', 'best-practice'] } }));
  const bad = violations.filter((v) => v.impact === 'serious' || v.impact === 'critical');
  for (const v of violations) {
    const where = v.nodes.slice(0, 3).map((n) => n.target.join(' ')).join('; ');
    console.log(`  axe ${view}: ${v.impact} ${v.id} on ${v.nodes.length} node(s): ${where}${bad.includes(v) ? '' : ' (not failing: below serious)'}`);
    if (bad.includes(v)) for (const n of v.nodes.slice(0, 5)) console.log('    ' + n.failureSummary.replace(/\n/g, ' / '));
  }
  check(bad.length === 0, `axe-core: no serious or critical violation on ${view}` +
    (bad.length ? ': ' + bad.map((v) => `${v.id} (${v.nodes.length})`).join(', ') : ''));
}

// The page fits the viewport's width, and no table cell is squeezed into a column of a few
// characters (the phone layout once wrapped cells one character per line).
async function layoutCheck(page, view) {
  const { pageWidth, viewport, squeezed } = await page.evaluate(() => {
    // Lines of text in a cell: the line boxes of its text nodes, told apart by their tops.
    const lines = (td) => {
      const tops = [];
      const walk = document.createTreeWalker(td, NodeFilter.SHOW_TEXT);
      for (let n = walk.nextNode(); n; n = walk.nextNode()) {
        const r = document.createRange();
        r.selectNodeContents(n);
        for (const rect of r.getClientRects()) if (rect.width > 0) tops.push(rect.top);
      }
      tops.sort((a, b) => a - b);
      return tops.filter((t, i) => i === 0 || t - tops[i - 1] > 4).length;
    };
    const squeezed = [];
    for (const td of document.querySelectorAll('main:not([hidden]) td')) {
      if (!td.textContent.trim() || td.offsetParent === null) continue;
      // Free text (an error, a kind, a list of kinds) may take a few lines; an id, a time, a
      // count, a status takes one.
      const allowed = td.matches('.error, .text, .kind, .muted') ? 4 : 1;
      const n = lines(td);
      if (n > allowed) squeezed.push(`"${td.textContent.slice(0, 40)}" on ${n} lines`);
    }
    return { pageWidth: document.documentElement.scrollWidth, viewport: window.innerWidth, squeezed };
  });
  check(pageWidth <= viewport, `${view}: the page is no wider than the screen (${pageWidth} px in ${viewport} px)`);
  check(squeezed.length === 0, `${view}: every table cell is readable` + (squeezed.length ? ': ' + squeezed.slice(0, 3).join(', ') : ''));
}

// The whole run is bounded: a hung browser must not hang cargo test.
const watchdog = setTimeout(() => {
  console.error('browser test: over 150 s, giving up');
  process.exit(1);
}, 150_000);

// A fresh profile directory (playwright passes it to Chromium as --user-data-dir).
const context = await chromium.launchPersistentContext(env('USER_DATA_DIR'), {
  executablePath: '/usr/bin/chromium',
  headless: true,
  viewport: DESKTOP,
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
  // (Dismissed, but for the confirmation a test step expects: "retry all shown".)
  let acceptDialogs = false;
  page.on('dialog', (d) => {
    dialogs.push(d.message());
    if (acceptDialogs) d.accept();
    else d.dismiss();
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

  // Kinds: the delayed task's kind is listed with its counts; Pause and Resume set its policy.
  const kindRow = '#kinds tr[data-kind="report"]';
  await page.locator(kindRow).waitFor();
  check((await page.textContent(kindRow)).includes('no limits'), 'a kind with tasks and no policy is listed');
  const askKind = async () =>
    (await fetch(`${base}/kinds/report`, { headers: { Authorization: 'Bearer ' + token } })).json();
  await page.click(`${kindRow} button`);
  await page.locator(`${kindRow} button`, { hasText: 'Resume' }).waitFor();
  const paused = await askKind();
  check(paused.policy.paused === true && paused.pending >= 1, 'Pause pauses the kind: ' + JSON.stringify(paused));
  check((await page.textContent(kindRow)).includes('paused'), 'the kinds table says it is paused');
  await page.click(`${kindRow} button`);
  await page.locator(`${kindRow} button`, { hasText: 'Pause' }).waitFor();
  check((await askKind()).policy.paused === undefined, 'Resume resumes it');
  // A pending task says why it waits in the list.
  const waitingRow = page.locator('#tasks tr', { has: page.locator(`a[href="#/task/${delayedTask}"]`) });
  await waitingRow.locator('.waiting', { hasText: 'schedule' }).waitFor();
  check(true, 'a pending task shows what it waits on (schedule)');

  // Counts and the chart fill in. The chart does not wait for two samples of the counters:
  // the minutes before the page opened come from the task list (the harness finished tasks
  // before starting the browser, and relay has been up for a few seconds).
  await page.waitForFunction(() => /^\d+$/.test(document.getElementById('count-done').textContent));
  await page.waitForFunction(() => document.querySelectorAll('#chart polyline').length === 2, null, { timeout: 15_000 });
  check(true, 'the chart draws done and failed');
  const seed = await page.evaluate(() => ({ ...document.getElementById('chart').dataset }));
  check(Number(seed.seeded) >= 1 && Number(seed.seededDone) >= 2,
    `the chart starts with the tasks finished before the page opened (${seed.seeded} buckets, ${seed.seededDone} done, ${seed.seededFailed} failed)`);

  // Let the chart gather a few points for the screenshot.
  await page.waitForFunction(() => {
    const p = document.querySelector('#chart polyline.done');
    return p && p.getAttribute('points').split(' ').length >= 4;
  }, null, { timeout: 20_000 });
  await page.screenshot({ path: join(artifacts, 'dashboard.png') });
  check(true, 'screenshot dashboard.png written');
  await layoutCheck(page, 'overview at 1280 px');
  await axeCheck(page, 'overview at 1280 px');
  await page.setViewportSize(PHONE);
  await page.waitForFunction(() => document.documentElement.scrollWidth <= window.innerWidth, null, { timeout: 5_000 }).catch(() => {});
  await layoutCheck(page, 'overview at 390 px');
  await axeCheck(page, 'overview at 390 px');
  await page.screenshot({ path: join(artifacts, 'dashboard-phone.png'), fullPage: true });
  check(true, 'screenshot dashboard-phone.png written');
  await page.setViewportSize(DESKTOP);

  // Search by task id: whatever is pasted around the id (here a line of JSON) is ignored.
  await page.fill('#find-id', `{"task_id":"${fallbackTask}","status":"done"}`);
  await page.click('#find-open');
  await page.locator('#t-id', { hasText: fallbackTask }).waitFor();
  check(!(await page.isHidden('#task-view')), 'a pasted task id opens its task page');
  await page.goto(base + '/ui#/');
  const nobody = '00000000-0000-4000-8000-000000000000';
  await page.fill('#find-id', nobody);
  await page.click('#find-open');
  await page.locator('#find-note', { hasText: 'No such task' }).waitFor();
  check(!(await page.isHidden('#overview')), 'an unknown id says "No such task" and stays on the overview');
  await page.fill('#find-id', 'not an id');
  await page.click('#find-open');
  await page.locator('#find-note', { hasText: 'not a task id' }).waitFor();
  check(true, 'text without a task id is refused as such');
  await page.goto(base + '/ui#/task/' + nobody);
  await page.locator('#t-missing', { hasText: 'No such task' }).waitFor();
  check(true, 'the page of an unknown task says "No such task"');
  await axeCheck(page, 'unknown task at 1280 px');
  await page.goto(base + '/ui#/');

  // Filter the list down to the fallback task's kind (the chart's traffic is another kind)
  // and open the task from there.
  await page.fill('#f-kind', 'fetch');
  await page.selectOption('#f-status', 'done');
  await page.click('#filters button[type=submit]');
  const link = page.locator(`#tasks a[href="#/task/${fallbackTask}"]`);
  // (The unfiltered list may show the task too until the filtered page replaces it: wait for
  // the filtered one, with a deadline, rather than for the link alone.)
  const filtered = await page.waitForFunction(() => {
    const kinds = [...document.querySelectorAll('#tasks tr td:nth-child(3)')].map((td) => td.textContent);
    return kinds.length > 0 && kinds.every((k) => k === 'fetch');
  }, null, { timeout: 5000 }).then(() => true, () => false);
  check(filtered, 'the kind filter lists only that kind');
  await link.waitFor();
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

  // The task page asks for the payload (relay keeps it until the task is final: a done task's
  // page has no fold; the pending task's page below shows one).
  check(urls.some((u) => u.endsWith(`/tasks/${fallbackTask}?include=payload`)), 'the task page asks for the payload');
  check(await page.isHidden('#t-payload-fold'), 'a done task, whose payload relay no longer keeps: no payload fold');
  await axeCheck(page, 'task page at 1280 px');
  await page.screenshot({ path: join(artifacts, 'task.png'), fullPage: true });
  check(true, 'screenshot task.png written');
  await page.setViewportSize(PHONE);
  await layoutCheck(page, 'task page at 390 px');
  await axeCheck(page, 'task page at 390 px');
  await page.screenshot({ path: join(artifacts, 'task-phone.png'), fullPage: true });
  await page.setViewportSize(DESKTOP);

  // A hostile payload is shown as text and runs nothing: in the result (the echo worker sends
  // the payload back).
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

  // A pending task's page: its payload, folded, as relay sends it for ?include=payload.
  await page.goto(base + '/ui#/task/' + delayedTask);
  await page.locator('#t-status', { hasText: 'pending' }).waitFor();
  const asked = await fetch(`${base}/tasks/${delayedTask}?include=payload`, { headers: { Authorization: 'Bearer ' + token } });
  check((await asked.json()).payload?.kind === 'report', 'relay sends a pending task\'s payload for ?include=payload');
  await page.locator('#t-payload-fold').waitFor();
  check(!(await page.$eval('#t-payload-fold', (d) => d.open)), 'the payload starts folded');
  await page.click('#t-payload-fold summary');
  const payloadText = await page.textContent('#t-payload');
  check(payloadText.includes('"report"') && payloadText.includes('<img src=x onerror=window.__xss=3>'),
    'the unfolded payload is the submitted JSON, hostile text shown literally');
  check((await page.evaluate(() => document.querySelectorAll('#t-payload img').length)) === 0,
    'no element was created from the payload fold');

  // Cancel the pending task from its page.
  await page.click('#t-cancel');
  await page.locator('#t-status', { hasText: 'canceled' }).waitFor();
  check(await page.locator('#t-cancel').isHidden(), 'cancel button: the task is canceled and the button goes');

  // Retry (SPEC §13): the canceled task runs again from its page, and says it was re-run.
  await page.locator('#t-retry').waitFor();
  check(await page.locator('#t-retry').isVisible(), 'a canceled task has a Retry button');
  await page.click('#t-retry');
  await page.locator('#t-fields', { hasText: 'reruns' }).waitFor();
  check((await page.textContent('#t-note')) === 'Running again.', 'the task page says it runs again');
  const rerun = await (await fetch(`${base}/tasks/${delayedTask}`, { headers: { Authorization: 'Bearer ' + token } })).json();
  check(rerun.reruns === 1 && rerun.status !== 'canceled', 'relay ran the canceled task again');

  // "Retry all shown" on the failed tasks, after a confirmation that states the count.
  await page.goto(base + '/ui#/');
  await page.fill('#f-kind', '');
  await page.selectOption('#f-status', 'failed');
  await page.click('#filters button[type=submit]');
  await page.locator(`#tasks a[href="#/task/${failedTask}"]`).waitFor();
  const shownFailed = await page.$$eval('#tasks tr', (trs) => trs.filter((tr) => tr.querySelector('.status.failed')).length);
  await page.locator('#tasks-retry-all').waitFor();
  check((await page.textContent('#tasks-retry-all')).includes('(' + shownFailed + ')'), 'the button counts the tasks shown');
  const before = dialogs.length;
  acceptDialogs = true;
  await page.click('#tasks-retry-all');
  await page.waitForFunction(() => document.querySelector('#banner').textContent.startsWith('Running '));
  acceptDialogs = false;
  const confirmations = dialogs.slice(before);
  check(confirmations.length === 1 && confirmations[0] === 'Run ' + shownFailed + ' task' + (shownFailed === 1 ? '' : 's') + ' again?',
    'one confirmation, stating the count: ' + JSON.stringify(confirmations));
  const retried = await (await fetch(`${base}/tasks/${failedTask}`, { headers: { Authorization: 'Bearer ' + token } })).json();
  check(retried.reruns === 1, 'the failed task was run again');

  // Failures beside a high done rate, in a second tab whose /metrics is stubbed: the counters
  // grow by 5,000 done per poll and by 5 failed every other poll. On one axis shared with done
  // the failures would be a thousandth of its height, a flat line; in their own lane they span it.
  const chartPage = await context.newPage();
  chartPage.on('pageerror', (e) => pageErrors.push(String(e)));
  chartPage.on('request', (r) => urls.push(r.url()));
  let polls = 0;
  await chartPage.route(`${base}/metrics`, (route) => {
    polls++;
    const done = 1_000_000 + polls * 5000;
    const failedTotal = 100 + Math.floor(polls / 2) * 5;
    route.fulfill({
      status: 200,
      contentType: 'text/plain; version=0.0.4; charset=utf-8',
      body: `relay_tasks_total{status="done"} ${done}\nrelay_tasks_total{status="failed"} ${failedTotal}\n`,
    });
  });
  await chartPage.goto(base + '/ui');
  await chartPage.waitForFunction(() => {
    const p = document.querySelector('#chart polyline.failed');
    return p && p.getAttribute('points').split(' ').length >= 6;
  }, null, { timeout: 20_000 });
  const failedSpan = await chartPage.$eval('#chart polyline.failed', (p) => p.getBBox().height);
  const chartHeight = await chartPage.$eval('#chart', (c) => c.getBoundingClientRect().height);
  check(failedSpan >= 15,
    `failures beside 2,500 done/s are visible: the failed line spans ${failedSpan.toFixed(1)} px of the chart's ${chartHeight} (15 px at least)`);
  check(/failed\/s · [\d.]+ % failed in view/.test(await chartPage.textContent('#chart-now')), 'the chart says the share that failed');
  await chartPage.screenshot({ path: join(artifacts, 'chart-failures.png') });
  await chartPage.close();

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
