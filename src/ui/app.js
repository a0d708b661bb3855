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
const H = 140;
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

async function api(method, path) {
  const headers = { Accept: 'application/json' };
  const t = token();
  if (t) headers.Authorization = 'Bearer ' + t;
  const res = await fetch(path, { method, headers, cache: 'no-store', credentials: 'omit', redirect: 'error' });
  const type = res.headers.get('Content-Type') || '';
  const body = type.startsWith('application/json') ? await res.json() : await res.text();
  if (!res.ok && !(method === 'DELETE' && res.status === 409)) throw new ApiError(res.status, body);
  return { status: res.status, body };
}

function explain(err) {
  if (err instanceof ApiError) {
    if (err.status === 401) return 'The token was refused (401). Type a valid API token above.';
    return err.message + ' (' + err.status + ')';
  }
  return 'relay did not answer: ' + err.message;
}

// ----- overview: counts and the chart ----------------------------------------------------------

const samples = []; // {t, done, failed}: counter values, at most CHART_POINTS + 1

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

async function pollMetrics() {
  const { body } = await api('GET', '/metrics');
  const done = metricValue(body, 'relay_tasks_total{status="done"}');
  const failed = metricValue(body, 'relay_tasks_total{status="failed"}');
  if (Number.isNaN(done) || Number.isNaN(failed)) return;
  const last = samples[samples.length - 1];
  if (last && (done < last.done || failed < last.failed)) samples.length = 0; // relay restarted
  samples.push({ t: performance.now(), done, failed });
  while (samples.length > CHART_POINTS + 1) samples.shift();
  drawChart();
}

function rates() {
  const out = [];
  for (let i = 1; i < samples.length; i++) {
    const dt = (samples[i].t - samples[i - 1].t) / 1000;
    if (dt <= 0) continue;
    out.push({ done: (samples[i].done - samples[i - 1].done) / dt, failed: (samples[i].failed - samples[i - 1].failed) / dt });
  }
  return out;
}

function niceMax(v) {
  if (v <= 1) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function drawChart() {
  const chart = $('chart');
  clear(chart);
  // Drawn in the element's own pixels, so the labels are not stretched.
  const W = Math.max(300, Math.round(chart.clientWidth || 600));
  chart.setAttribute('viewBox', '0 0 ' + W + ' ' + H);
  const r = rates();
  const max = niceMax(Math.max(1, ...r.map((x) => Math.max(x.done, x.failed))));
  for (const f of [0, 0.5, 1]) {
    const y = H - 12 - f * (H - 24);
    chart.appendChild(svg('line', { x1: 0, x2: W, y1: y, y2: y, class: 'grid' }));
    const label = svg('text', { x: 4, y: y - 2, class: 'axis-label' });
    label.textContent = (max * f).toLocaleString() + '/s';
    chart.appendChild(label);
  }
  // The time axis spans what has been seen (one minute at least, five at most), so a page
  // opened a moment ago already shows a useful picture.
  const span = Math.max(30, r.length);
  const step = W / span;
  const offset = W - r.length * step;
  const since = svg('text', { x: W - 4, y: H - 2, class: 'axis-label', 'text-anchor': 'end' });
  since.textContent = 'last ' + Math.round((span * POLL_MS) / 1000) + ' s';
  chart.appendChild(since);
  for (const key of ['done', 'failed']) {
    const pts = r.map((x, i) => (offset + (i + 1) * step).toFixed(1) + ',' + (H - 12 - (x[key] / max) * (H - 24)).toFixed(1));
    if (pts.length) chart.appendChild(svg('polyline', { points: pts.join(' '), class: key }));
  }
  const now = r[r.length - 1];
  $('chart-now').textContent = now ? 'now: ' + now.done.toFixed(1) + ' done/s, ' + now.failed.toFixed(1) + ' failed/s' : '';
}

// ----- workers ----------------------------------------------------------------------------------

let workers = [];
let workersPage = 0;

async function pollWorkers() {
  if (!token()) {
    workers = [];
    $('workers-note').textContent = 'Type the API token to see workers.';
    renderWorkers();
    return;
  }
  try {
    const { body } = await api('GET', '/clients');
    workers = Array.isArray(body.clients) ? body.clients : [];
    $('workers-note').textContent = body.count + ' connected';
  } catch (err) {
    workers = [];
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
    tr.appendChild(cell(Array.isArray(w.kinds) ? (w.kinds.length ? w.kinds.join(', ') : '(none)') : 'any'));
    tr.appendChild(cell(w.in_flight + ' / ' + (w.concurrency === undefined ? '∞' : w.concurrency)));
    tr.appendChild(cell(w.active ? 'active' : 'draining'));
    tr.appendChild(cell(w.version === undefined ? '' : w.version));
    body.appendChild(tr);
  }
  $('workers-page').textContent = workers.length ? 'page ' + (workersPage + 1) + ' of ' + pages : '';
  $('workers-prev').disabled = workersPage === 0;
  $('workers-next').disabled = workersPage >= pages - 1;
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
    tr.appendChild(st);
    tr.appendChild(cell(t.kind === undefined ? '' : t.kind));
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

async function loadTask(id) {
  try {
    const { body } = await api('GET', '/tasks/' + encodeURIComponent(id));
    renderTask(body);
    banner('');
  } catch (err) {
    currentTask = null;
    $('t-id').textContent = id;
    $('t-status').textContent = '';
    clear($('t-fields'));
    clear($('t-attempts'));
    $('t-result').textContent = '';
    $('t-cancel').hidden = true;
    banner(err.status === 404 ? 'No such task (or not visible to this token).' : explain(err), true);
  }
}

function renderTask(t) {
  currentTask = t;
  $('t-id').textContent = t.task_id;
  const st = $('t-status');
  st.textContent = t.status;
  st.className = 'status ' + t.status;
  $('t-cancel').hidden = !(t.status === 'pending' || t.status === 'dispatched');
  const dl = $('t-fields');
  clear(dl);
  field(dl, 'kind', t.kind);
  field(dl, 'created', fmtTime(t.created_at));
  field(dl, 'run at', fmtTime(t.run_at));
  field(dl, 'finished', fmtTime(t.finished_at));
  field(dl, 'attempts', String(t.attempts));
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

// ----- routing and the poll loop --------------------------------------------------------------------

function route() {
  const m = location.hash.match(/^#\/task\/([^/]+)$/);
  $('overview').hidden = !!m;
  $('task-view').hidden = !m;
  $('t-note').textContent = '';
  if (m) {
    loadTask(decodeURIComponent(m[1]));
  } else {
    currentTask = null;
    loadTasks();
  }
}

let tick = 0;

async function poll() {
  try {
    await Promise.all([pollHealth(), pollMetrics()]);
    if (tick % WORKERS_EVERY === 0) await pollWorkers();
    // The first page of the list follows new tasks; later pages stay where the user put them.
    if (!$('overview').hidden && list.index === 0 && tick % WORKERS_EVERY === 1) await loadTasks();
    if (!$('task-view').hidden && currentTask && (currentTask.status === 'pending' || currentTask.status === 'dispatched')) {
      await loadTask(currentTask.task_id);
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
    pollWorkers();
    resetList();
    route();
  });
  $('forget-token').addEventListener('click', () => {
    sessionStorage.removeItem(TOKEN_KEY);
    checkToken();
    pollWorkers();
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
  $('t-refresh').addEventListener('click', () => currentTask && loadTask(currentTask.task_id));
  window.addEventListener('hashchange', route);
  checkToken();
  route();
  poll();
}

document.addEventListener('DOMContentLoaded', start);
