// relay dashboard. Vanilla JS, no build step, no dependencies.
//
// Rules this file keeps (the server's CSP enforces the first two anyway):
// - no HTML is ever built from strings: every element is made with createElement and every
//   value from a task or a worker goes in through textContent (a payload is attacker-controlled);
// - no inline styles: looks come from classes in app.css, sizes in the SVGs from attributes;
// - the token lives in sessionStorage only (never a URL, a cookie or persistent storage) and travels
//   only in the Authorization header of the same JSON calls a curl user could make;
// - bounded: tables show one page (tasks: one API page; workers: WORKERS_PER_PAGE rows), the
//   chart keeps CHART_POINTS samples, the cursor history CURSOR_HISTORY entries.
'use strict';

const TOKEN_KEY = 'relay.token';
const POLL_MS = 2000;
const WORKERS_EVERY = 3; // /clients every 3rd poll
const WORKERS_PER_PAGE = 25;
const CHART_POINTS = 150; // 5 minutes at one sample per 2 s
const CURSOR_HISTORY = 10000;
const EMPTY_HOPS = 20; // pages followed when a filter matched nothing in a page's scan budget
const W = 600;
const H = 190;
const SVG = 'http://www.w3.org/2000/svg';

const $ = (id) => document.getElementById(id);

// ----- DOM helpers (text only) -----------------------------------------------------------

function el(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}

function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
}

function cell(text, className) {
  return el('td', className, text === undefined ? '' : text);
}

function fmtTime(iso) {
  if (typeof iso !== 'string') return '';
  return iso.replace('T', ' ');
}

function fmtDuration(ms) {
  if (typeof ms !== 'number') return '';
  if (ms < 1000) return ms + ' ms';
  if (ms < 60000) return (ms / 1000).toFixed(ms < 10000 ? 2 : 1) + ' s';
  const m = Math.floor(ms / 60000);
  return m + ' min ' + Math.round((ms % 60000) / 1000) + ' s';
}

function fmtUptime(s) {
  if (typeof s !== 'number') return '–';
  const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60);
  if (d) return d + 'd ' + h + 'h';
  if (h) return h + 'h ' + m + 'm';
  return m + 'm ' + (s % 60) + 's';
}

function banner(text, isError) {
  const b = $('banner');
  b.textContent = text || '';
  b.hidden = !text;
  b.classList.toggle('error', !!isError);
}

// ----- the API --------------------------------------------------------------------------------

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || '';
}

class ApiError extends Error {
  constructor(status, body) {
    super((body && body.message) || ('HTTP ' + status));
    this.status = status;
    this.body = body;
  }
}

async function api(method, path, json) {
  const headers = { Accept: 'application/json' };
  const t = token();
  if (t) headers.Authorization = 'Bearer ' + t;
  const init = { method, headers, cache: 'no-store', credentials: 'omit', redirect: 'error' };
  if (json !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(json);
  }
  const res = await fetch(path, init);
  const type = res.headers.get('Content-Type') || '';
  const body = type.startsWith('application/json') ? await res.json() : await res.text();
  // (A 409 of a cancel or a retry carries the task as it is: not an error to show.)
  const taskAnswer = method === 'DELETE' || (method === 'POST' && path.endsWith('/retry'));
  if (!res.ok && !(taskAnswer && res.status === 409)) throw new ApiError(res.status, body);
  return { status: res.status, body, date: res.headers.get('Date') };
}

function explain(err) {
  if (err instanceof ApiError) {
    if (err.status === 401) return 'The token was refused (401). Type a valid API token above.';
    return err.message + ' (' + err.status + ')';
  }
  return 'relay did not answer: ' + err.message;
}

// ----- overview: counts and the chart ----------------------------------------------------------
//
// The chart shows tasks finished per second, from the counters relay_tasks_total in /metrics:
// each poll adds one interval (its counts and length). So that it is not empty for the first
// seconds, the last minutes are filled in once from the task list (one page, newest first:
// the finished_at of the done and failed tasks on it, counted in POLL_MS buckets, back as far
// as that page and relay's uptime reach). Done and failed are drawn in two lanes, each on its
// own scale: one failure a second next to a thousand done still fills its lane, where on a
// shared axis it would be a flat line under the done curve.

let health = null; // the last /healthz answer
let base = null; // the first /metrics sample: {t (Date.now()), done, failed}
let last = null; // the latest /metrics sample
const points = []; // {t: end (ms, this page's clock), dt: ms, done, failed: counts}, oldest first
let seeded = 0; // buckets that came from the task list
let seedState = 'no'; // 'no' | 'busy' | 'done'

const JOURNAL_FULL = 'The journal cannot write (the disk of DATA_DIR is full): new tasks and cancels are refused (503) until there is room; everything else is still served.';

async function pollHealth() {
  let body;
  try {
    ({ body } = await api('GET', '/healthz'));
  } catch (err) {
    // 503 with the counts: relay is up and serves reads, but cannot write (a full disk).
    if (!(err instanceof ApiError) || err.status !== 503 || !err.body || !err.body.tasks) throw err;
    body = err.body;
  }
  const full = body.journal === 'full';
  if (full) banner(JOURNAL_FULL, true);
  else if ($('banner').textContent === JOURNAL_FULL) banner('');
  health = body;
  for (const s of ['pending', 'dispatched', 'done', 'failed', 'canceled']) {
    $('count-' + s).textContent = String(body.tasks[s]);
  }
  $('count-workers').textContent = body.clients + ' (' + body.active_clients + ')';
  $('uptime').textContent = fmtUptime(body.uptime_s);
}

function metricValue(text, series) {
  for (const line of text.split('\n')) {
    if (line.startsWith(series + ' ')) return Number(line.slice(series.length + 1));
  }
  return NaN;
}

function resetChart() {
  base = null;
  last = null;
  points.length = 0;
  seeded = 0;
  seedState = 'no';
}

async function pollMetrics() {
  const { body } = await api('GET', '/metrics');
  const done = metricValue(body, 'relay_tasks_total{status="done"}');
  const failed = metricValue(body, 'relay_tasks_total{status="failed"}');
  if (Number.isNaN(done) || Number.isNaN(failed)) return;
  const now = Date.now();
  if (last && (done < last.done || failed < last.failed)) resetChart(); // relay restarted
  if (!base) {
    base = { t: now, done, failed };
  } else if (now > last.t) {
    points.push({ t: now, dt: now - last.t, done: done - last.done, failed: failed - last.failed });
    trimPoints();
  }
  last = { t: now, done, failed };
  drawChart();
}

function trimPoints() {
  if (!points.length) return;
  const oldest = points[points.length - 1].t - CHART_POINTS * POLL_MS;
  while (points.length > CHART_POINTS || points[0].t <= oldest) points.shift();
}

// Fills in the minutes before the first sample from one page of the task list. Only with the
// root token: a scoped token lists its own kinds, and the counters count every kind.
async function seedChart() {
  if (seedState !== 'no' || !base || !token() || workersAccess !== 'root') return;
  seedState = 'busy';
  try {
    const res = await api('GET', '/tasks?limit=1000');
    const tasks = Array.isArray(res.body.tasks) ? res.body.tasks : [];
    // relay's clock, from the answer's Date header when there is one (to the second).
    const serverDate = Date.parse(res.date || '');
    const skew = Number.isNaN(serverDate) ? 0 : serverDate - Date.now();
    let from = base.t - CHART_POINTS * POLL_MS;
    if (health && typeof health.uptime_s === 'number') from = Math.max(from, base.t - health.uptime_s * 1000);
    if (res.body.next_cursor && tasks.length) {
      // Older tasks exist that this page did not show: count only where the page is complete.
      const oldest = Math.min(...tasks.map((t) => Date.parse(t.created_at)).filter((x) => !Number.isNaN(x)));
      if (Number.isFinite(oldest)) from = Math.max(from, oldest - skew);
    }
    const n = Math.max(0, Math.floor((base.t - from) / POLL_MS));
    const buckets = [];
    for (let i = 0; i < n; i++) buckets.push({ t: base.t - (n - 1 - i) * POLL_MS, dt: POLL_MS, done: 0, failed: 0 });
    for (const t of tasks) {
      if (t.status !== 'done' && t.status !== 'failed') continue;
      const at = Date.parse(t.finished_at) - skew;
      if (Number.isNaN(at) || at >= base.t) continue; // after the first sample: the counters have it
      const i = n - 1 - Math.floor((base.t - at) / POLL_MS);
      if (i >= 0) buckets[i][t.status]++;
    }
    points.unshift(...buckets);
    seeded = buckets.length;
    const chart = $('chart');
    chart.dataset.seededDone = String(buckets.reduce((n, b) => n + b.done, 0));
    chart.dataset.seededFailed = String(buckets.reduce((n, b) => n + b.failed, 0));
    trimPoints();
    seedState = 'done';
    drawChart();
  } catch {
    seedState = 'no'; // tried again on the next poll
  }
}

function niceMax(v) {
  if (v <= 1) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function fmtRate(r) {
  return r >= 100 ? Math.round(r).toLocaleString() : r.toFixed(r >= 10 ? 1 : 2).replace(/\.?0+$/, '');
}

function drawChart() {
  const chart = $('chart');
  clear(chart);
  // Drawn in the element's own pixels, so the labels are not stretched.
  const W = Math.max(280, Math.round(chart.clientWidth || 600));
  chart.setAttribute('viewBox', '0 0 ' + W + ' ' + H);
  chart.dataset.points = String(points.length);
  chart.dataset.seeded = String(seeded);
  const rates = points.map((p) => ({ t: p.t, done: (p.done * 1000) / p.dt, failed: (p.failed * 1000) / p.dt }));
  const now = points.length ? points[points.length - 1].t : Date.now();
  // The time axis spans what has been seen (one minute at least, five at most), so a page
  // opened a moment ago already shows a useful picture.
  const first = points.length ? points[0].t - points[0].dt : now;
  const span = Math.min(CHART_POINTS * POLL_MS, Math.max(60000, now - first));
  const x = (t) => W - ((now - t) / span) * W;
  const lanes = [
    { key: 'done', top: 16, bottom: 104, label: 'done' },
    { key: 'failed', top: 128, bottom: 172, label: 'failed' },
  ];
  const peaks = {};
  for (const lane of lanes) {
    const peak = Math.max(0, ...rates.map((r) => r[lane.key]));
    peaks[lane.key] = peak;
    const max = niceMax(peak);
    const y = (v) => lane.bottom - (v / max) * (lane.bottom - lane.top);
    chart.appendChild(svg('line', { x1: 0, x2: W, y1: lane.top, y2: lane.top, class: 'grid' }));
    chart.appendChild(svg('line', { x1: 0, x2: W, y1: lane.bottom, y2: lane.bottom, class: 'grid base' }));
    const label = svg('text', { x: 4, y: lane.top - 3, class: 'axis-label' });
    label.textContent = lane.label + ': ' + max.toLocaleString() + '/s';
    chart.appendChild(label);
    if (!rates.length) continue;
    const pts = [];
    rates.forEach((r, i) => {
      // Each interval as a step: flat over the time it covers.
      pts.push(x(points[i].t - points[i].dt).toFixed(1) + ',' + y(r[lane.key]).toFixed(1));
      pts.push(x(r.t).toFixed(1) + ',' + y(r[lane.key]).toFixed(1));
    });
    const area = [x(points[0].t - points[0].dt).toFixed(1) + ',' + lane.bottom, ...pts, x(now).toFixed(1) + ',' + lane.bottom];
    chart.appendChild(svg('polygon', { points: area.join(' '), class: 'area ' + lane.key }));
    chart.appendChild(svg('polyline', { points: pts.join(' '), class: lane.key }));
  }
  const axis = (text, xPos, anchor) => {
    const t = svg('text', { x: xPos, y: H - 4, class: 'axis-label', 'text-anchor': anchor });
    t.textContent = text;
    chart.appendChild(t);
  };
  axis(Math.round(span / 1000) + ' s ago', 4, 'start');
  axis('now', W - 4, 'end');
  if (seeded && points.length > seeded) {
    // Where the task list's counts end and the counters' begin.
    const xs = x(points[seeded - 1].t);
    chart.appendChild(svg('line', { x1: xs, x2: xs, y1: lanes[0].top, y2: lanes[1].bottom, class: 'seam' }));
  }
  const r = rates[rates.length - 1];
  let text = '';
  if (r) {
    const inView = points.reduce((a, p) => ({ done: a.done + p.done, failed: a.failed + p.failed }), { done: 0, failed: 0 });
    const share = inView.failed ? (inView.failed * 100) / (inView.done + inView.failed) : 0;
    text = 'now: ' + fmtRate(r.done) + ' done/s, ' + fmtRate(r.failed) + ' failed/s · ' + (share && share < 1 ? share.toFixed(2) : share.toFixed(1)) + ' % failed in view';
  } else {
    text = token() ? 'collecting the first interval…' : 'collecting… (the root API token also shows the minutes before)';
  }
  $('chart-now').textContent = text;
  chart.setAttribute('aria-label', 'Tasks finished per second, last ' + Math.round(span / 1000) + ' s: done up to ' +
    fmtRate(peaks.done || 0) + '/s, failed up to ' + fmtRate(peaks.failed || 0) + '/s. ' + text);
}

// ----- workers ----------------------------------------------------------------------------------

let workers = [];
let workersPage = 0;
let workersAccess = 'unknown'; // 'root' once /clients answered, 'denied' on 403

async function pollWorkers() {
  if (!token()) {
    workers = [];
    workersAccess = 'unknown';
    $('workers-note').textContent = 'Type the API token to see workers.';
    renderWorkers();
    return;
  }
  try {
    const { body } = await api('GET', '/clients');
    workers = Array.isArray(body.clients) ? body.clients : [];
    workersAccess = 'root';
    $('workers-note').textContent = body.count + ' connected';
  } catch (err) {
    workers = [];
    workersAccess = err.status === 403 ? 'denied' : 'unknown';
    $('workers-note').textContent = err.status === 403 ? 'Workers are shown to the root API token only.' : explain(err);
  }
  renderWorkers();
}

function renderWorkers() {
  const pages = Math.max(1, Math.ceil(workers.length / WORKERS_PER_PAGE));
  workersPage = Math.min(workersPage, pages - 1);
  const body = $('workers');
  clear(body);
  for (const w of workers.slice(workersPage * WORKERS_PER_PAGE, (workersPage + 1) * WORKERS_PER_PAGE)) {
    const tr = el('tr');
    tr.appendChild(cell(w.client_id, 'mono'));
    tr.appendChild(cell(w.ip, 'mono'));
    tr.appendChild(cell(fmtTime(w.connected_at)));
    tr.appendChild(cell(Array.isArray(w.kinds) ? (w.kinds.length ? w.kinds.join(', ') : '(none)') : 'any', 'text'));
    tr.appendChild(cell(w.in_flight + ' / ' + (w.concurrency === undefined ? '∞' : w.concurrency)));
    // A session whose connection was lost is held, its tasks kept for it, until resumable_until.
    // Degraded: its attempts keep failing while others succeed; no first attempts for a while.
    const state = w.resumable_until ? 'held until ' + fmtTime(w.resumable_until) : w.active ? (w.degraded ? 'degraded' : 'active') : 'draining';
    tr.appendChild(cell(state, w.degraded ? 'degraded' : undefined));
    tr.appendChild(cell(w.version === undefined ? '' : w.version));
    body.appendChild(tr);
  }
  $('workers-page').textContent = workers.length ? 'page ' + (workersPage + 1) + ' of ' + pages : '';
  $('workers-prev').disabled = workersPage === 0;
  $('workers-next').disabled = workersPage >= pages - 1;
}

// ----- kinds: policies, running and pending counts, pause and resume -----------------------------

let kinds = [];

function policyText(p) {
  const parts = [];
  for (const [name, v] of Object.entries(p || {})) {
    if (name !== 'paused') parts.push(name + ' ' + v);
  }
  return parts.length ? parts.join(', ') : 'no limits';
}

async function pollKinds() {
  if (!token()) {
    kinds = [];
    $('kinds-note').textContent = 'Type the API token to see kinds.';
    renderKinds();
    return;
  }
  try {
    const { body } = await api('GET', '/kinds');
    kinds = Array.isArray(body.kinds) ? body.kinds : [];
    $('kinds-note').textContent = kinds.length ? '' : 'No kind has a policy or tasks waiting or running.';
  } catch (err) {
    kinds = [];
    $('kinds-note').textContent = err.status === 403 ? 'Kinds are shown to the root API token only.' : explain(err);
  }
  renderKinds();
}

// Pause keeps the kind's limits (a PUT replaces the whole policy): the policy as shown, with
// `paused` set or removed.
async function setPaused(k, paused) {
  const policy = { ...(k.policy || {}) };
  if (paused) policy.paused = true;
  else delete policy.paused;
  try {
    await api('PUT', '/kinds/' + encodeURIComponent(k.kind), policy);
    banner('');
  } catch (err) {
    banner(explain(err), true);
  }
  await pollKinds();
}

function renderKinds() {
  const body = $('kinds');
  clear(body);
  for (const k of kinds.slice(0, 200)) {
    const tr = el('tr');
    tr.dataset.kind = k.kind;
    tr.appendChild(cell(k.kind, 'kind'));
    const paused = !!(k.policy && k.policy.paused);
    tr.appendChild(cell((paused ? 'paused · ' : '') + policyText(k.policy), 'text'));
    tr.appendChild(cell(k.running));
    tr.appendChild(cell(k.pending));
    const td = el('td');
    const b = el('button', paused ? null : 'danger', paused ? 'Resume' : 'Pause');
    b.type = 'button';
    b.setAttribute('aria-label', (paused ? 'Resume ' : 'Pause ') + k.kind);
    b.addEventListener('click', () => setPaused(k, !paused));
    td.appendChild(b);
    tr.appendChild(td);
    body.appendChild(tr);
  }
}

// ----- the task list -----------------------------------------------------------------------------

const list = { cursors: [null], index: 0, next: null, busy: false };

function listQuery(cursor) {
  const p = new URLSearchParams();
  const status = $('f-status').value;
  const kind = $('f-kind').value;
  if (status) p.set('status', status);
  if (kind) p.set('kind', kind);
  p.set('limit', $('f-limit').value);
  if (cursor) p.set('cursor', cursor);
  return '/tasks?' + p.toString();
}

async function loadTasks() {
  if (!token()) {
    clear($('tasks'));
    $('tasks-page').textContent = 'Type the API token to list tasks.';
    return;
  }
  if (list.busy) return;
  list.busy = true;
  try {
    let cursor = list.cursors[list.index];
    let body;
    // A page can come back empty with a next_cursor when the filter matched nothing among the
    // tasks it was allowed to look at: follow a few of those before showing an empty page.
    for (let hop = 0; ; hop++) {
      body = (await api('GET', listQuery(cursor))).body;
      if (body.tasks.length || !body.next_cursor || hop >= EMPTY_HOPS) break;
      cursor = body.next_cursor;
    }
    list.cursors[list.index] = cursor;
    list.next = body.next_cursor || null;
    renderTasks(body.tasks);
    banner('');
  } catch (err) {
    banner(explain(err), true);
  } finally {
    list.busy = false;
  }
}

function statusBadge(status) {
  return el('span', 'status ' + (typeof status === 'string' ? status : ''), status);
}

function renderTasks(tasks) {
  const body = $('tasks');
  clear(body);
  for (const t of tasks) {
    const tr = el('tr');
    const idCell = el('td', 'mono');
    const a = el('a', null, t.task_id);
    a.href = '#/task/' + encodeURIComponent(t.task_id);
    idCell.appendChild(a);
    tr.appendChild(idCell);
    const st = el('td');
    st.appendChild(statusBadge(t.status));
    if (t.waiting_on) st.appendChild(el('span', 'muted waiting', ' ' + t.waiting_on));
    tr.appendChild(st);
    tr.appendChild(cell(t.kind === undefined ? '' : t.kind, 'kind'));
    tr.appendChild(cell(fmtTime(t.created_at)));
    tr.appendChild(cell(t.attempts));
    tr.appendChild(cell(fmtTime(t.finished_at)));
    tr.appendChild(cell(t.error === undefined ? '' : t.error, 'error'));
    body.appendChild(tr);
  }
  if (!tasks.length) {
    const tr = el('tr');
    const td = el('td', 'muted', list.next ? 'No match among the tasks looked at so far; "Older" searches further.' : 'No tasks.');
    td.colSpan = 7;
    tr.appendChild(td);
    body.appendChild(tr);
  }
  // "Retry all shown": on a list filtered to failed or canceled tasks, the ones on this page.
  list.shown = tasks.filter((t) => t.status === 'failed' || t.status === 'canceled').map((t) => t.task_id);
  const filtered = $('f-status').value === 'failed' || $('f-status').value === 'canceled';
  $('tasks-retry-all').hidden = !(filtered && list.shown.length);
  $('tasks-retry-all').textContent = 'Retry all shown (' + list.shown.length + ')';
  $('tasks-page').textContent = 'page ' + (list.index + 1) + (list.next ? '' : ' (last)');
  $('tasks-newer').disabled = list.index === 0;
  $('tasks-older').disabled = !list.next;
}

function resetList() {
  list.cursors = [null];
  list.index = 0;
  list.next = null;
}

// ----- one task --------------------------------------------------------------------------------------

let currentTask = null;

function field(dl, name, value) {
  if (value === undefined || value === null || value === '') return;
  dl.appendChild(el('dt', null, name));
  dl.appendChild(el('dd', null, value));
}

// A task's payload is asked for once, when its page opens (it never changes, and may be up to
// MAX_MESSAGE_SIZE); the refreshes of a running task leave it out.
async function loadTask(id, withPayload) {
  const path = '/tasks/' + encodeURIComponent(id) + (withPayload ? '?include=payload' : '');
  try {
    const { body } = await api('GET', path);
    if (withPayload) showPayload(body);
    renderTask(body);
    $('t-missing').hidden = true;
    banner('');
  } catch (err) {
    currentTask = null;
    $('t-id').textContent = id;
    $('t-status').textContent = '';
    $('t-status').className = 'status';
    clear($('t-fields'));
    clear($('t-attempts'));
    $('t-result').textContent = '';
    $('t-cancel').hidden = true;
    $('t-retry').hidden = true;
    showPayload({});
    if (err.status === 404) {
      $('t-missing').textContent = 'No such task: ' + id + '. It may never have existed, have expired (finished tasks are kept ' +
        'for TASK_TTL), or be of a kind this token may not see.';
      $('t-missing').hidden = false;
      banner('');
    } else {
      $('t-missing').hidden = true;
      banner(explain(err), true);
    }
  }
}

// The fold appears only when relay sent the payload (older relays leave it out).
function showPayload(t) {
  const has = t && typeof t === 'object' && Object.prototype.hasOwnProperty.call(t, 'payload');
  $('t-payload-fold').hidden = !has;
  $('t-payload-fold').open = false;
  $('t-payload').textContent = has ? JSON.stringify(t.payload, null, 2) : '';
}

// ----- search by task id ---------------------------------------------------------------------------

const TASK_ID = /[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}/i;

// Takes the id out of whatever was pasted (a bare id, a task URL, a line of JSON or a log).
async function findTask(text) {
  const note = $('find-note');
  const m = text.match(TASK_ID);
  if (!m) {
    note.textContent = text.trim() ? 'That is not a task id (a task id looks like 3f2c1a9e-7b1d-4c2e-9a4f-0d6e8b5c7a21).' : '';
    return;
  }
  const id = m[0].toLowerCase();
  if (!token()) {
    note.textContent = 'Type the API token first: tasks are shown to a token only.';
    return;
  }
  note.textContent = 'Looking for ' + id + '…';
  try {
    await api('GET', '/tasks/' + encodeURIComponent(id));
    note.textContent = '';
    $('find-id').value = '';
    if (location.hash === '#/task/' + id) route();
    else location.hash = '#/task/' + id;
  } catch (err) {
    note.textContent = err.status === 404 ? 'No such task: ' + id + ' (or not visible to this token).' : explain(err);
  }
}

function renderTask(t) {
  currentTask = t;
  $('t-id').textContent = t.task_id;
  const st = $('t-status');
  st.textContent = t.status;
  st.className = 'status ' + t.status;
  $('t-cancel').hidden = !(t.status === 'pending' || t.status === 'dispatched');
  $('t-retry').hidden = !(t.status === 'failed' || t.status === 'canceled');
  const dl = $('t-fields');
  clear(dl);
  field(dl, 'kind', t.kind);
  field(dl, 'created', fmtTime(t.created_at));
  field(dl, 'run at', fmtTime(t.run_at));
  field(dl, 'finished', fmtTime(t.finished_at));
  field(dl, 'attempts', String(t.attempts));
  field(dl, 'reruns', t.reruns === undefined ? undefined : String(t.reruns));
  field(dl, 'waiting on', t.waiting_on === undefined ? undefined : t.waiting_on + (t.next_attempt_at ? ' until ' + fmtTime(t.next_attempt_at) : ''));
  field(dl, 'priority', t.priority === undefined ? undefined : String(t.priority));
  field(dl, 'finished by', t.client_id ? t.client_id + ' (' + t.client_ip + ')' : undefined);
  field(dl, 'error', t.error);
  renderTimeline(t);
  $('t-result').textContent = t.status === 'done' ? JSON.stringify(t.result, null, 2) : '(no result)';
}

function renderTimeline(t) {
  const ol = $('t-attempts');
  clear(ol);
  const log = Array.isArray(t.attempt_log) ? t.attempt_log : [];
  if (!log.length) {
    ol.appendChild(el('li', 'muted', t.status === 'pending' ? 'Not dispatched yet.' : 'No attempts.'));
    return;
  }
  const t0 = Date.parse(t.created_at);
  const ends = log.map((a) => Date.parse(a.started_at) + (typeof a.duration_ms === 'number' ? a.duration_ms : Date.now() - Date.parse(a.started_at)));
  const span = Math.max(1, Math.max(...ends) - t0);
  log.forEach((a, i) => {
    const li = el('li', a.outcome || 'running');
    li.dataset.outcome = a.outcome || 'running';
    const head = el('div', 'head');
    head.appendChild(el('strong', null, 'Attempt ' + a.num));
    head.appendChild(el('span', 'status ' + (a.outcome || 'dispatched'), a.outcome || 'running'));
    const who = el('span', null, 'worker ');
    who.appendChild(el('code', null, a.client_id));
    who.appendChild(document.createTextNode(' at ' + a.client_ip));
    head.appendChild(who);
    head.appendChild(el('span', 'muted', 'started ' + fmtTime(a.started_at)));
    head.appendChild(el('span', 'muted', a.duration_ms === undefined ? 'running…' : 'took ' + fmtDuration(a.duration_ms)));
    li.appendChild(head);
    if (a.error !== undefined) li.appendChild(el('div', 'why', a.error));
    const bar = svg('svg', { viewBox: '0 0 ' + W + ' 8', preserveAspectRatio: 'none' });
    bar.appendChild(svg('rect', { x: 0, y: 0, width: W, height: 8, class: 'track' }));
    // Position and length on the task's time line; at least a few pixels so a fast attempt shows.
    const x = Math.min(W - 4, Math.max(0, ((Date.parse(a.started_at) - t0) / span) * W));
    const w = Math.max(4, Math.min(W - x, ((ends[i] - Date.parse(a.started_at)) / span) * W));
    bar.appendChild(svg('rect', { x: x.toFixed(1), y: 0, width: w.toFixed(1), height: 8, class: 'bar' }));
    li.appendChild(bar);
    ol.appendChild(li);
  });
}

async function cancelTask() {
  if (!currentTask) return;
  try {
    const { status, body } = await api('DELETE', '/tasks/' + encodeURIComponent(currentTask.task_id));
    renderTask(body);
    $('t-note').textContent = status === 409 ? 'Already final: nothing to cancel.' : 'Canceled.';
  } catch (err) {
    banner(explain(err), true);
  }
}

// Runs a failed or canceled task again (SPEC §13): pending, with a fresh retry budget.
async function retryTask() {
  if (!currentTask) return;
  try {
    const { status, body } = await api('POST', '/tasks/' + encodeURIComponent(currentTask.task_id) + '/retry');
    renderTask(body);
    $('t-note').textContent = status === 409 ? 'Not failed or canceled: nothing to retry.' : 'Running again.';
  } catch (err) {
    banner(explain(err), true);
  }
}

// Runs again every failed or canceled task the filtered list shows, after a confirmation that
// says how many.
async function retryAllShown() {
  const ids = (list.shown || []).slice();
  if (!ids.length) return;
  if (!window.confirm('Run ' + ids.length + ' task' + (ids.length === 1 ? '' : 's') + ' again?')) return;
  let ran = 0;
  try {
    for (const id of ids) {
      const { status } = await api('POST', '/tasks/' + encodeURIComponent(id) + '/retry');
      if (status === 202) ran++;
    }
  } catch (err) {
    banner(explain(err), true);
    return;
  }
  // (The list first: a successful load clears the banner.)
  await loadTasks();
  banner('Running ' + ran + ' task' + (ran === 1 ? '' : 's') + ' again.');
}

// ----- routing and the poll loop --------------------------------------------------------------------

function route() {
  const m = location.hash.match(/^#\/task\/([^/]+)$/);
  $('overview').hidden = !!m;
  $('task-view').hidden = !m;
  $('t-note').textContent = '';
  if (m) {
    loadTask(decodeURIComponent(m[1]), true);
  } else {
    currentTask = null;
    loadTasks();
  }
}

let tick = 0;

async function poll() {
  try {
    await Promise.all([pollHealth(), pollMetrics(), tick % WORKERS_EVERY === 0 ? pollWorkers() : null,
      tick % WORKERS_EVERY === 2 ? pollKinds() : null]);
    await seedChart();
    // The first page of the list follows new tasks; later pages stay where the user put them.
    if (!$('overview').hidden && list.index === 0 && tick % WORKERS_EVERY === 1) await loadTasks();
    if (!$('task-view').hidden && currentTask && (currentTask.status === 'pending' || currentTask.status === 'dispatched')) {
      await loadTask(currentTask.task_id, false);
    }
    if ($('banner').classList.contains('error') && $('banner').textContent.startsWith('relay did not answer')) banner('');
  } catch (err) {
    banner(explain(err), true);
  }
  tick++;
  setTimeout(poll, POLL_MS);
}

async function checkToken() {
  const who = $('whoami');
  if (!token()) {
    who.textContent = 'no token';
    return;
  }
  try {
    await api('GET', '/tasks?limit=1');
    who.textContent = 'token accepted';
  } catch (err) {
    who.textContent = err.status === 401 ? 'token refused' : '';
    if (err.status === 401) banner(explain(err), true);
  }
}

function start() {
  $('login').addEventListener('submit', (e) => {
    e.preventDefault();
    const value = $('token').value.trim();
    $('token').value = '';
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    banner('');
    checkToken();
    // With the root token the chart fills in the minutes before at once.
    pollWorkers().then(seedChart);
    pollKinds();
    resetList();
    route();
  });
  $('forget-token').addEventListener('click', () => {
    sessionStorage.removeItem(TOKEN_KEY);
    checkToken();
    pollWorkers();
    pollKinds();
    resetList();
    route();
  });
  $('filters').addEventListener('submit', (e) => {
    e.preventDefault();
    resetList();
    loadTasks();
  });
  $('tasks-refresh').addEventListener('click', () => loadTasks());
  $('tasks-older').addEventListener('click', () => {
    if (!list.next || list.cursors.length >= CURSOR_HISTORY) return;
    list.cursors = list.cursors.slice(0, list.index + 1);
    list.cursors.push(list.next);
    list.index++;
    loadTasks();
  });
  $('tasks-newer').addEventListener('click', () => {
    if (list.index === 0) return;
    list.index--;
    loadTasks();
  });
  $('workers-prev').addEventListener('click', () => {
    workersPage = Math.max(0, workersPage - 1);
    renderWorkers();
  });
  $('workers-next').addEventListener('click', () => {
    workersPage++;
    renderWorkers();
  });
  $('t-cancel').addEventListener('click', cancelTask);
  $('t-retry').addEventListener('click', retryTask);
  $('tasks-retry-all').addEventListener('click', retryAllShown);
  $('t-refresh').addEventListener('click', () => currentTask && loadTask(currentTask.task_id, false));
  $('find').addEventListener('submit', (e) => {
    e.preventDefault();
    findTask($('find-id').value);
  });
  $('find-id').addEventListener('input', () => {
    $('find-note').textContent = '';
  });
  window.addEventListener('hashchange', route);
  checkToken();
  route();
  poll();
}

document.addEventListener('DOMContentLoaded', start);
