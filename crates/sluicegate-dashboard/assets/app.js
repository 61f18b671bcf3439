// The sluicegate dashboard: a small single-page app over the JSON API (docs/dashboard.md).
// One EventSource brings every reading of the namespace and every completion event; a page that
// shows more than the reading (a list page, a request) reads it again when a reading arrives, so
// nothing polls on a timer of its own.
'use strict';

const S = {
  config: null,     // /api/config
  overview: null,   // the latest reading
  events: [],       // completion events, newest first
  page: null,       // the page shown: { name, tick() }
  refreshing: false,
  driftStreak: 0,   // readings in a row whose token totals did not balance
};

// ---- helpers -------------------------------------------------------------------------------

/** An element: h('td', {class: 'num'}, 'text', child, ...). Text is always set as text. */
function h(tag, attrs, ...children) {
  const el = document.createElementNS(
    ['svg', 'line', 'polyline', 'text', 'rect', 'g', 'path', 'circle', 'defs', 'marker', 'title'].includes(tag) ? 'http://www.w3.org/2000/svg' : 'http://www.w3.org/1999/xhtml',
    tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

/** Replaces an element's children, leaving out the null ones (a section not shown). */
function fill(el, ...children) {
  el.replaceChildren(...children.flat().filter(c => c !== null && c !== undefined && c !== false));
}

async function api(path, options) {
  const res = await fetch(path, Object.assign({ headers: { 'Accept': 'application/json' } }, options || {}));
  let body = null;
  try { body = await res.json(); } catch (_) { /* not JSON */ }
  if (res.status === 401) { location.href = '/login'; throw new Error('log in first'); }
  if (!res.ok) throw new Error((body && body.error) || `${res.status} ${res.statusText}`);
  return body;
}

function act(path, body) {
  return api(path, { method: 'POST', headers: { 'Content-Type': 'application/json', 'Accept': 'application/json' }, body: JSON.stringify(body || {}) });
}

function toast(text, error) {
  const t = document.getElementById('toast');
  t.textContent = text;
  t.className = 'toast' + (error ? ' error' : '');
  t.hidden = false;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { t.hidden = true; }, error ? 8000 : 4000);
}

const num = n => (n === undefined || n === null) ? '–' : Number(n).toLocaleString('en-US');

function age(ms) {
  if (ms === undefined || ms === null) return '–';
  const s = Math.max(0, ms) / 1000;
  if (s < 1) return `${Math.round(ms)} ms`;
  if (s < 90) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
  if (s < 5400) return `${Math.round(s / 60)} min`;
  if (s < 172800) return `${(s / 3600).toFixed(1)} h`;
  return `${(s / 86400).toFixed(1)} d`;
}

const ago = ms => ms ? `${age(Date.now() - ms)} ago` : '–';
const when = ms => ms ? new Date(ms).toLocaleString() : '–';

function bytes(n) {
  const units = ['B', 'KB', 'MB', 'GB', 'TB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

const badge = (state, paused) => [h('span', { class: `badge ${state}` }, state), paused ? ' ' : null, paused ? h('span', { class: 'badge paused' }, 'paused') : null];

function progress(done, failed, total, big) {
  const ok = Math.max(0, done - failed);
  const pct = v => total ? `${(100 * v / total).toFixed(2)}%` : '0%';
  return h('div', { class: 'progress' + (big ? ' big' : ''), 'data-done': done, 'data-total': total },
    h('div', { class: 'bar' }, h('div', { class: 'done', style: `width:${pct(ok)}` }), h('div', { class: 'failed', style: `width:${pct(failed)}` })),
    h('span', { class: 'txt' }, `${num(done)} / ${num(total)}`));
}

const requestLink = id => `#/request/${encodeURIComponent(id)}`;

function stat(label, value, sub, cls) {
  return h('div', { class: 'card stat' + (cls ? ' ' + cls : '') }, h('div', { class: 'label' }, label), h('div', { class: 'value' }, value), sub ? h('div', { class: 'sub' }, sub) : null);
}

/** A button that asks for a second click before it acts. */
function confirmButton(label, cls, run) {
  const b = h('button', { class: cls, type: 'button' }, label);
  let armed = null;
  b.addEventListener('click', async () => {
    if (!armed) {
      b.textContent = `Confirm: ${label.toLowerCase()}?`;
      b.classList.add('confirm');
      armed = setTimeout(() => { armed = null; b.textContent = label; b.classList.remove('confirm'); }, 5000);
      return;
    }
    clearTimeout(armed); armed = null;
    b.textContent = label; b.classList.remove('confirm');
    b.disabled = true;
    try { await run(); } catch (e) { toast(e.message, true); } finally { b.disabled = false; }
  });
  return b;
}

function table(headers, rows, empty) {
  if (!rows.length) return h('div', { class: 'empty' }, empty || 'Nothing to show.');
  return h('table', {}, h('thead', {}, h('tr', {}, headers.map(([label, cls]) => h('th', { class: cls }, label)))), h('tbody', {}, rows));
}

// ---- the chart ---------------------------------------------------------------------------------

/** Started, completed and failed per minute over the last hour, as an inline SVG. */
function chart(throughput) {
  const W = 720, H = 220, L = 40, R = 10, T = 10, B = 22;
  const now = Date.now();
  const first = Math.floor(now / 60000) * 60000 - 59 * 60000;
  const series = { started: new Array(60).fill(0), completed: new Array(60).fill(0), failed: new Array(60).fill(0) };
  for (const m of (throughput && throughput.minutes) || []) {
    const i = Math.round((m.minute_ms - first) / 60000);
    if (i >= 0 && i < 60) for (const k of Object.keys(series)) series[k][i] += m[k] || 0;
  }
  const max = Math.max(1, ...Object.values(series).flat());
  const x = i => L + (W - L - R) * i / 59;
  const y = v => T + (H - T - B) * (1 - v / max);
  const colors = { started: '#2f6fde', completed: '#1e9e5a', failed: '#d23c3c' };
  const peak = Math.max(0, ...Object.values(series).flat());
  const svg = h('svg', { class: 'chart', viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: 'none', id: 'throughput-chart', 'data-peak': peak });
  for (const v of [...new Set([0, Math.round(max / 2), max])]) {
    svg.append(h('line', { class: 'axis', x1: L, x2: W - R, y1: y(v), y2: y(v) }));
    svg.append(h('text', { x: L - 6, y: y(v) + 3, 'text-anchor': 'end' }, num(v)));
  }
  for (const [i, label] of [[0, '-60 min'], [30, '-30 min'], [59, 'now']]) {
    svg.append(h('text', { x: x(i), y: H - 6, 'text-anchor': i === 0 ? 'start' : i === 59 ? 'end' : 'middle' }, label));
  }
  for (const [k, values] of Object.entries(series)) {
    svg.append(h('polyline', { fill: 'none', stroke: colors[k], 'stroke-width': 2, 'vector-effect': 'non-scaling-stroke', points: values.map((v, i) => `${x(i)},${y(v)}`).join(' ') }));
  }
  const legend = h('div', { class: 'legend' }, Object.entries(colors).map(([k, c]) => h('span', {}, h('i', { style: `background:${c}` }), `${k} per minute`)));
  return [svg, legend];
}

// ---- the graph of a request's dependencies ------------------------------------------------------

/** How often the request page reads its graph again: one status per node, up to 100 of them. */
const GRAPH_EVERY_MS = 5000;

/** The neighbourhood of request `st` (/api/requests/{id}/graph) as an inline SVG: a column per
 *  step (the longest path to it among the nodes shown), upstreams to the left, edges from a request
 *  to those submitted after it; each node shows its state and is a click away from its page. A
 *  DAG, so no cycle; a cycle, were there one, would still be drawn, without looping. */
function dagGraph(g, st) {
  const NW = 176, NH = 42, GX = 64, GY = 14, P = 6;
  // The request itself as this reading has it: the graph may be a few seconds older.
  const nodes = g.nodes.map(n => n.id === st.id ? Object.assign({}, n, { state: st.state, done: st.done, total: st.total }) : n);
  const ups = new Map(nodes.map(n => [n.id, []]));
  for (const e of g.edges) if (ups.has(e.from) && ups.has(e.to)) ups.get(e.to).push(e.from);
  const col = new Map();
  const colOf = (id, path) => {
    if (col.has(id)) return col.get(id);
    if (path.has(id)) return 0; // no cycle can form; never loop if one did
    path.add(id);
    const c = Math.max(0, ...ups.get(id).map(u => colOf(u, path) + 1));
    path.delete(id);
    col.set(id, c);
    return c;
  };
  nodes.forEach(n => colOf(n.id, new Set()));
  // Then each request as close to its nearest downstream as it can be (the last ones first), so
  // that an edge spans one column wherever it can, rather than running behind other nodes.
  const downs = new Map(nodes.map(n => [n.id, []]));
  for (const e of g.edges) if (ups.has(e.from) && ups.has(e.to)) downs.get(e.from).push(e.to);
  for (const n of [...nodes].sort((a, b) => col.get(b.id) - col.get(a.id))) {
    const ds = downs.get(n.id);
    if (ds.length) col.set(n.id, Math.max(col.get(n.id), Math.min(...ds.map(d => col.get(d))) - 1));
  }
  const columns = [];
  for (const n of nodes) { const c = col.get(n.id); (columns[c] = columns[c] || []).push(n); }
  const used = columns.filter(Boolean);
  const rows = Math.max(...used.map(c => c.length));
  const W = 2 * P + used.length * NW + (used.length - 1) * GX, H = 2 * P + rows * NH + (rows - 1) * GY;
  // Each column centred, its nodes in the order of their upstreams' heights (fewer crossings).
  const pos = new Map();
  used.forEach((column, c) => {
    const key = n => { const ys = ups.get(n.id).filter(u => pos.has(u)).map(u => pos.get(u).y); return ys.length ? ys.reduce((a, b) => a + b, 0) / ys.length : -1; };
    column.sort((a, b) => key(a) - key(b) || a.level - b.level || (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
    const top = P + (rows - column.length) * (NH + GY) / 2;
    column.forEach((n, i) => pos.set(n.id, { x: P + c * (NW + GX), y: top + i * (NH + GY) }));
  });
  const svg = h('svg', { class: 'dag', id: 'dag', viewBox: `0 0 ${W} ${H}`, width: W, height: H, 'data-nodes': nodes.length, 'data-edges': g.edges.length },
    h('defs', {}, h('marker', { id: 'dag-arrow', viewBox: '0 0 10 10', refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: 'auto' }, h('path', { class: 'arrow', d: 'M 0 0 L 10 5 L 0 10 z' }))));
  for (const e of g.edges) {
    const a = pos.get(e.from), b = pos.get(e.to);
    if (!a || !b) continue;
    const x1 = a.x + NW, y1 = a.y + NH / 2, x2 = b.x, y2 = b.y + NH / 2, dx = Math.max(20, (x2 - x1) / 2);
    svg.append(h('path', { class: 'edge' + (e.ended ? ` ended-${e.ended}` : ''), d: `M ${x1} ${y1} C ${x1 + dx} ${y1}, ${x2 - dx} ${y2}, ${x2} ${y2}`, 'marker-end': 'url(#dag-arrow)', 'data-from': e.from, 'data-to': e.to },
      h('title', {}, `${e.to} runs after ${e.from}` + (e.ended ? `, which ended ${e.ended}` : ''))));
  }
  for (const n of nodes) {
    const p = pos.get(n.id), root = n.id === st.id;
    const go = () => { if (!root) location.hash = requestLink(n.id); };
    svg.append(h('g', { class: `node state-${n.state}` + (root ? ' root' : ''), transform: `translate(${p.x},${p.y})`, 'data-id': n.id, 'data-state': n.state,
      tabindex: root ? null : 0, role: root ? null : 'link', onclick: go, onkeydown: ev => { if (ev.key === 'Enter') go(); } },
      h('title', {}, `${n.id}: ${n.state}` + (n.reason ? ` (${n.reason})` : '') + (root ? ' (this request)' : '')),
      h('rect', { width: NW, height: NH, rx: 6 }),
      h('text', { x: 10, y: 17, class: 'id' }, n.id.length > 24 ? n.id.slice(0, 23) + '…' : n.id),
      h('text', { x: 10, y: 33, class: 'sub' }, n.found ? `${n.state} · ${num(n.done)} / ${num(n.total)}` : 'gone: nothing of it is left')));
  }
  return [h('div', { class: 'dag-wrap' }, svg),
    h('p', { class: 'muted' }, `${nodes.length} request${nodes.length > 1 ? 's' : ''}, up to ${g.depth} steps each way` + (g.truncated ? '; more are not shown' : '') + '. A node opens its request.')];
}

/** The requests this one runs after (with how each ended, as it heard) and before, and their graph. */
function dependencies(st, graph) {
  const now = new Map(((graph && graph.nodes) || []).map(n => [n.id, n.id === st.id ? st.state : n.state]));
  const link = id => h('a', { href: requestLink(id), class: 'mono' }, id);
  const state = id => now.has(id) ? badge(now.get(id)) : h('span', { class: 'muted' }, '–');
  const ups = st.upstreams || [], downs = st.downstreams || [];
  return h('div', { class: 'card', id: 'dependencies' }, h('h2', {}, 'Dependencies'),
    h('div', { class: 'deps' },
      h('div', { id: 'upstreams' }, h('h3', {}, `Runs after (${ups.length})`),
        table([['Upstream'], ['Ended, as this request heard'], ['State now']],
          ups.map(u => h('tr', { 'data-id': u.id }, h('td', {}, link(u.id)), h('td', {}, u.ended ? badge(u.ended) : h('span', { class: 'muted' }, 'not yet')), h('td', {}, state(u.id)))),
          'It was submitted after no other request.')),
      h('div', { id: 'downstreams' }, h('h3', {}, `Run after it (${downs.length}${downs.length >= 100 ? ', the first ones' : ''})`),
        table([['Downstream'], ['State now']], downs.map(d => h('tr', { 'data-id': d }, h('td', {}, link(d)), h('td', {}, state(d)))),
          'No request was submitted after it.'))),
    graph ? dagGraph(graph, st) : h('p', { class: 'muted' }, 'Reading the graph…'));
}

// ---- pages -----------------------------------------------------------------------------------

function requestRow(r) {
  return h('tr', { class: 'link', 'data-id': r.id, onclick: () => { location.hash = requestLink(r.id); } },
    h('td', { class: 'mono' }, h('a', { href: requestLink(r.id) }, r.id)),
    h('td', {}, badge(r.state), r.open ? h('span', { class: 'muted' }, ' open') : null),
    h('td', { class: 'num' }, r.priority),
    h('td', { class: 'num' }, r.concurrency),
    h('td', {}, progress(r.done, r.failed, r.total)),
    h('td', {}, (r.tags || []).join(', ')),
    h('td', { class: 'muted' }, ago(r.submitted_ms)));
}

const REQUEST_HEADERS = [['Request'], ['State'], ['Priority', 'num'], ['Limit', 'num'], ['Progress'], ['Tags'], ['Submitted']];

const pages = {
  overview: {
    render(main) { this.main = main; this.pauseEl = null; this.tick(); },
    tick() {
      const ov = S.overview;
      const main = this.main;
      if (!ov) { fill(main, h('p', { class: 'muted' }, 'Waiting for the first reading…')); return; }
      const s = ov.stats, t = ov.tokens;
      const oldest = Math.max(0, ...s.tokens_waiting.map(p => p.oldest_waiting_ms));
      const slots = s.workers.reduce((a, w) => a + w.slots, 0);
      const paused = s.paused.all ? 'namespace' : s.paused.priorities.length ? `priorities ${s.paused.priorities.join(', ')}` : 'no';
      fill(main, 
        h('div', { class: 'grid' },
          stat('Unfinished requests', num(s.requests.unfinished), `${num(s.requests.completed)} completed · ${num(s.requests.failed)} failed · ${num(s.requests.cancelled)} cancelled`),
          stat('Workers alive', num(s.workers.length), `${num(slots)} slots`),
          stat('Tokens waiting', num(t.waiting), `oldest waited ${age(oldest)}`),
          stat('Tokens held', num(t.held), `parked ${num(t.parked)}`),
          // A reading is not one atomic snapshot: a token moving between a list and a slot can
          // show as drift for a reading. Only drift that lasts three readings is flagged.
          stat('Token capacity', num(t.capacity), t.drift === null ? `tally ${age(t.tally_age_ms)} old; drift at the next` : t.drift === 0 ? 'no drift' : S.driftStreak < 3 ? `drift ${t.drift} (in flight)` : `drift ${t.drift} for ${S.driftStreak} readings`, S.driftStreak >= 3 ? 'warn' : ''),
          stat('Dead letters', num(s.tally.dead_letters), s.tally.complete ? '' : 'first records only'),
          stat('Redis memory', bytes(s.redis_memory_bytes)),
          stat('Paused', paused),
        ),
        h('div', { class: 'row2' },
          h('div', { class: 'card' }, h('h2', {}, 'Throughput, last hour'), chart(ov.throughput)),
          h('div', { class: 'card' }, h('h2', {}, 'Backlog by priority'),
            table([['Priority', 'num'], ['Tokens waiting', 'num'], ['Oldest waiting', 'num'], ['']],
              s.tokens_waiting.map(p => h('tr', {},
                h('td', { class: 'num' }, p.priority), h('td', { class: 'num' }, num(p.tokens)), h('td', { class: 'num' }, age(p.oldest_waiting_ms)),
                h('td', {}, s.paused.all || s.paused.priorities.includes(p.priority) ? h('span', { class: 'badge paused' }, 'paused') : null))),
              'No token is waiting.'),
            S.config.actions ? (this.pauseEl = this.pauseEl || pauseControls()) : null)),
        h('div', { class: 'card', id: 'recent' }, h('h2', {}, 'Newest requests'),
          table(REQUEST_HEADERS, ov.recent.requests.map(requestRow), 'No request yet.'),
          h('div', { class: 'pager' }, h('a', { href: '#/requests' }, 'All requests →'))),
        h('p', { class: 'muted' }, `Read ${ago(ov.at_ms)}; live.`));
    },
  },

  requests: {
    render(main, params) {
      this.main = main;
      this.params = params;
      this.cursors = [];
      const f = h('form', { class: 'filters', id: 'filters' },
        h('label', {}, 'State', h('select', { name: 'state' }, ['', 'queued', 'running', 'scheduled', 'waiting', 'open', 'completed', 'failed', 'cancelled'].map(s => h('option', { value: s, selected: params.get('state') === s }, s || 'any')))),
        h('label', {}, 'Priority', h('input', { name: 'priority', type: 'number', min: 0, max: 99, value: params.get('priority') || '' })),
        h('label', {}, 'Tag', h('input', { name: 'tag', value: params.get('tag') || '', placeholder: 'customer:42' })),
        h('label', {}, 'Older than', h('input', { name: 'older_than', value: params.get('older_than') || '', placeholder: '15m, 2h, 7d' })),
        h('button', { type: 'submit' }, 'Filter'));
      f.addEventListener('submit', e => {
        e.preventDefault();
        const q = new URLSearchParams();
        for (const [k, v] of new FormData(f)) if (v) q.set(k, v);
        location.hash = '#/requests' + (q.toString() ? '?' + q : '');
      });
      this.list = h('div', {});
      fill(main, h('h1', {}, 'Requests'), f, h('div', { class: 'card' }, this.list));
      this.cursor = null;
      return this.tick();
    },
    async tick() {
      const q = new URLSearchParams(this.params);
      q.set('limit', '50');
      if (this.cursor) q.set('cursor', this.cursor);
      let page;
      try { page = await api('/api/requests?' + q); } catch (e) { fill(this.list, h('p', { class: 'error' }, e.message)); return; }
      const next = page.cursor;
      fill(this.list, 
        table(REQUEST_HEADERS, page.requests.map(requestRow), 'No request matches.'),
        h('div', { class: 'pager' },
          h('button', { class: 'secondary', type: 'button', disabled: !this.cursors.length, onclick: () => { this.cursor = this.cursors.pop() || null; this.tick(); } }, '← Newer'),
          h('button', { class: 'secondary', type: 'button', disabled: !next, onclick: () => { this.cursors.push(this.cursor); this.cursor = next; this.tick(); } }, 'Older →'),
          h('span', { class: 'muted' }, `${page.requests.length} shown, ${num(page.looked_at)} index entries looked at`)));
    },
  },

  request: {
    render(main, params, id) {
      this.main = main; this.id = id; this.dead = null; this.lastFailed = -1; this.actionsKey = null;
      this.graph = null; this.graphAt = 0;
      return this.tick();
    },
    async tick() {
      const id = this.id, enc = encodeURIComponent(id);
      let st, tokens = null;
      try { st = await api(`/api/requests/${enc}`); } catch (e) { fill(this.main, h('h1', {}, id), h('p', { class: 'error', id: 'detail-error' }, e.message)); return; }
      try { tokens = await api(`/api/requests/${enc}/tokens`); } catch (_) { tokens = null; }
      if (st.failed !== this.lastFailed) {
        this.lastFailed = st.failed;
        try { this.dead = st.failed ? await api(`/api/requests/${enc}/dead`) : { total: 0, dead: [] }; } catch (_) { this.dead = null; }
      }
      // The graph costs a status per node: read at the first reading, then every few seconds.
      const linked = (st.upstreams || []).length + (st.downstreams || []).length > 0;
      if (!linked) this.graph = null;
      else if (!this.graph || Date.now() - this.graphAt >= GRAPH_EVERY_MS) {
        try { this.graph = await api(`/api/requests/${enc}/graph`); this.graphAt = Date.now(); } catch (_) { /* the last one stays */ }
      }
      const terminal = ['completed', 'failed', 'cancelled'].includes(st.state);
      const step = (label, ms, from) => h('div', { class: 'step' + (ms ? ' on' : '') }, h('b', {}, label), ms ? when(ms) : 'not yet', ms && from ? h('div', { class: 'muted' }, `after ${age(ms - from)}`) : null);
      const main = this.main;
      fill(main, 
        h('h1', {}, 'Request ', h('span', { class: 'mono', id: 'request-id' }, id), ' ', h('span', { id: 'request-state' }, badge(st.state, st.paused))),
        h('div', { class: 'card' },
          progress(st.done, st.failed, st.total, true),
          h('div', { class: 'timeline' }, step('Submitted', st.created_ms), step('Started', st.started_ms, st.created_ms), step('Finished', st.finished_ms, st.started_ms || st.created_ms)),
          h('div', { class: 'facts' },
            ...[['Priority', st.priority], ['Concurrency limit', st.concurrency], ['Parts', num(st.total)], ['Done', num(st.done)], ['Dead-lettered', num(st.failed)],
              ['Running now', num(st.running)], ['Retrying', num(st.retrying)], ['Max attempts seen', st.max_attempts_seen], ['Succeeded after retry', num(st.succeeded_after_retry)],
              ['Tags', (st.tags || []).join(', ') || '–'], ['Tracked', st.tracked ? 'yes' : 'no'], ['Streamed', st.open ? 'open' : st.window ? `window ${st.window}` : 'no'],
              ['Deadline', st.deadline_ms ? when(st.deadline_ms) : '–'], ['Rate limit', st.rate ? `${st.rate.n} per ${age(st.rate.per_ms)}` : '–'],
              ...(st.reason ? [['Ended by', st.reason.startsWith('upstream:') ? ['upstream ', h('a', { href: requestLink(st.reason.slice(9)) }, st.reason.slice(9))] : st.reason]] : [])]
              .map(([k, v]) => h('div', {}, h('span', {}, k), v)))),
        S.config.actions ? this.actionsFor(st, terminal) : null,
        linked ? dependencies(st, this.graph) : null,
        st.completion || terminal ? h('div', { class: 'card', id: 'completion' }, h('h2', {}, 'Completion event'),
          st.completion ? h('p', {}, badge(st.completion.state), ` written ${ago(st.completion.at_ms)} · cursor `, h('code', {}, st.completion.cursor))
            : h('p', { class: 'muted' }, `Finished ${st.state} ${ago(st.finished_ms)}; its event is older than the 200 this dashboard keeps (sluicegate events shows every retained one).`)) : null,
        tokens ? h('div', { class: 'card', id: 'tokens' }, h('h2', {}, terminal ? 'Tokens' : `Tokens: ${tokens.expected} owned, ${tokens.queued} queued, ${tokens.held} held, ${tokens.parked} parked`),
          table([['Token', 'num'], ['Shard', 'num'], ['State'], ['Holder (worker/slot)'], ['Since'], ['Batch', 'num'], ['Lease lapses in']],
            tokens.tokens.map(t => h('tr', {}, h('td', { class: 'num' }, t.k), h('td', { class: 'num' }, t.shard), h('td', {}, t.state),
              h('td', { class: 'mono' }, t.holder || ''), h('td', {}, t.since_ms ? ago(t.since_ms) : ''), h('td', { class: 'num' }, t.batch || ''),
              h('td', {}, t.state !== 'held' ? '' : t.lease_expires_ms ? age(t.lease_expires_ms - Date.now()) : 'worker gone: recovery reclaims it'))),
            terminal ? 'A finished request owns no tokens.' : 'No token states recorded.')) : null,
        st.errors && st.errors.length ? h('div', { class: 'card' }, h('h2', {}, 'Errors'),
          table([['Part', 'num'], ['Attempts', 'num'], ['Error']], st.errors.map(e => h('tr', {}, h('td', { class: 'num' }, e.index), h('td', { class: 'num' }, e.error.attempts), h('td', {}, e.error.error, e.error.permanent ? ' (permanent)' : ''))))) : null,
        this.dead && this.dead.total ? h('div', { class: 'card', id: 'dead' }, h('h2', {}, `Dead letters (${this.dead.total})`),
          table([['Part', 'num'], ['Error'], ['Payload']], this.dead.dead.map(d => h('tr', {},
            h('td', { class: 'num' }, d.index), h('td', {}, d.error.error),
            h('td', {}, h('pre', {}, typeof d.payload === 'string' && d.truncated ? d.payload + '…' : JSON.stringify(d.payload, null, 1)),
              d.truncated ? h('button', { class: 'secondary', type: 'button', onclick: async ev => {
                const whole = await api(`/api/requests/${enc}/dead?index=${d.index}`);
                ev.target.previousSibling.textContent = JSON.stringify(whole.dead[0].payload, null, 1);
                ev.target.remove();
              } }, `Show all ${num(d.payload_bytes)} bytes`) : null))))) : null);
    },
    /** The actions card, kept across readings while the same actions apply: a button armed for
     *  its confirmation, or a priority being typed, survives the next reading. */
    actionsFor(st, terminal) {
      const key = `${this.id}|${terminal}|${st.failed > 0}`;
      if (this.actionsKey !== key) { this.actionsKey = key; this.actionsEl = this.actions(st, terminal); }
      return this.actionsEl;
    },
    actions(st, terminal) {
      const enc = encodeURIComponent(this.id);
      const done = async (what, promise) => { const r = await promise; toast(what); this.tick(); return r; };
      const prio = h('input', { type: 'number', min: 0, max: 99, value: st.priority, id: 'new-priority' });
      return h('div', { class: 'card' }, h('h2', {}, 'Actions'), h('div', { class: 'actions' },
        !terminal ? h('span', { id: 'action-cancel' }, confirmButton('Cancel', 'danger', () => done('Cancelled.', act(`/api/requests/${enc}/cancel`)))) : null,
        st.failed ? confirmButton('Requeue dead letters', '', async () => { const r = await act(`/api/requests/${enc}/requeue`); toast(`Requeued ${r.requeued}.`); this.lastFailed = -1; this.tick(); }) : null,
        !terminal ? h('label', {}, 'Priority', prio) : null,
        !terminal ? h('button', { type: 'button', class: 'secondary', onclick: async () => {
          try { const r = await act(`/api/requests/${enc}/reprioritize`, { priority: Number(prio.value) }); toast(`Priority ${r.from} → ${r.to}; ${r.moved} waiting tokens moved.`); this.tick(); } catch (e) { toast(e.message, true); }
        } }, 'Reprioritize') : null,
        terminal ? confirmButton('Purge', 'danger', async () => { await act(`/api/requests/${enc}/purge`); toast('Purged.'); location.hash = '#/requests'; }) : null));
    },
  },

  workers: {
    // Each reading brings the registry; what the slots hold comes from /api/workers (the take
    // records), read again at each reading while this page is open.
    render(main) { this.main = main; this.busy = null; this.tick(); },
    tick() {
      const ov = S.overview;
      if (!ov) return;
      if (!this.loading) {
        this.loading = true;
        api('/api/workers').then(r => { this.busy = new Map(r.workers.map(w => [w.id, w.busy || []])); this.draw(); })
          .catch(e => toast(e.message, true)).finally(() => { this.loading = false; });
      }
      this.draw();
    },
    draw() {
      const ws = S.overview.stats.workers;
      const busyOf = w => this.busy ? this.busy.get(w.id) || [] : null;
      const runs = b => b.request ? h('a', { href: requestLink(b.request) }, b.request) : h('span', {}, `lane of priority ${b.lane}`);
      fill(this.main, h('h1', {}, `Workers (${ws.length})`), h('div', { class: 'card' },
        table([['Worker'], ['Host'], ['PID', 'num'], ['Busy / slots', 'num'], ['Token shards', 'num'], ['Version'], ['Runs'], ['Started'], ['Registration lapses in']],
          ws.map(w => {
            const busy = busyOf(w);
            return h('tr', {}, h('td', { class: 'mono' }, w.id), h('td', {}, w.host), h('td', { class: 'num' }, w.pid),
              h('td', { class: 'num' }, `${busy ? busy.length : '…'} / ${w.slots}`),
              h('td', { class: 'num' }, w.shards), h('td', {}, w.version || '–'), h('td', { class: 'mono' }, w.label || '–'), h('td', {}, ago(w.started_ms)),
              h('td', {}, w.registration_expires_ms ? age(w.registration_expires_ms - Date.now()) : '–'));
          }),
          'No worker is registered.'),
        h('p', { class: 'muted' }, 'A worker renews its registration at every heartbeat; one that lapses is declared dead and its tokens are reclaimed.')),
        h('div', { class: 'card', id: 'slots' }, h('h2', {}, 'Busy slots'),
          table([['Slot'], ['Runs'], ['Token', 'num'], ['Shard', 'num']],
            ws.flatMap(w => (busyOf(w) || []).map(b => h('tr', {}, h('td', { class: 'mono' }, b.slot), h('td', { class: 'mono' }, runs(b)),
              h('td', { class: 'num' }, b.token), h('td', { class: 'num' }, b.shard)))),
            this.busy ? 'Every slot is idle (waiting for a token).' : 'Reading the take records…')));
    },
  },

  events: {
    render(main) {
      this.main = main;
      api('/api/events').then(r => { S.events = r.events; this.tick(); }).catch(e => toast(e.message, true));
      this.tick();
    },
    tick() {
      fill(this.main, h('h1', {}, 'Completion events'), h('p', { class: 'muted' }, 'Requests reaching their terminal state, newest first, live; those written before the dashboard started were read from the retained ones.'),
        h('div', { class: 'card' }, table([['Written'], ['Request'], ['State'], ['Cursor']],
          S.events.map(e => h('tr', { class: 'link', onclick: () => { location.hash = requestLink(e.id); } },
            h('td', {}, new Date(e.at_ms).toLocaleString()), h('td', { class: 'mono' }, h('a', { href: requestLink(e.id) }, e.id)), h('td', {}, badge(e.state)), h('td', { class: 'mono muted' }, e.cursor))),
          'No completion event is retained.')));
    },
  },

  tokens: {
    render(main) { this.main = main; this.groups = null; this.groupsAt = 0; return this.tick(); },
    async tick() {
      let audit;
      const groups = (!this.groups || Date.now() - this.groupsAt >= GROUPS_EVERY_MS)
        ? api('/api/groups').then(g => { this.groups = g; this.groupsAt = Date.now(); this.groupsError = null; }).catch(e => { this.groupsError = e.message; })
        : null;
      try { audit = await api('/api/tokens'); } catch (e) { fill(this.main, h('p', { class: 'error' }, e.message)); return; }
      await groups;
      const t = audit.totals;
      fill(this.main, h('h1', {}, 'Token audit'),
        h('div', { class: 'grid' },
          stat('Capacity', num(t.capacity), 'tokens the unfinished requests own'),
          stat('Waiting', num(t.waiting), `in priority lists (${audit.token_shards} shard${audit.token_shards > 1 ? 's' : ''})`),
          stat('Held', num(t.held), 'by worker slots'),
          stat('Parked', num(t.parked), 'nothing to hand out'),
          t.drift === null ? stat('Drift', '–', `with the next tally (this one is ${age(t.tally_age_ms)} old)`) : stat('Drift', num(t.drift), t.drift === 0 ? 'capacity = waiting + held + parked' : 'recovery repairs this', t.drift === 0 ? 'ok' : 'warn')),
        h('div', { class: 'card' }, h('h2', {}, `Unfinished requests (${num(audit.requests.length)} of ${num(audit.unfinished)})`),
          table([['Request'], ['State'], ['Priority', 'num'], ['Shards', 'num'], ['Expected', 'num'], ['Queued', 'num'], ['Held', 'num'], ['Parked', 'num'], ['Difference', 'num']],
            audit.requests.map(r => h('tr', r.lane ? {} : { class: 'link', onclick: () => { location.hash = requestLink(r.id); } },
              h('td', { class: 'mono' }, r.lane ? `lane ${r.id}` : h('a', { href: requestLink(r.id) }, r.id)), h('td', {}, r.state ? badge(r.state) : '–'),
              h('td', { class: 'num' }, r.priority), h('td', { class: 'num' }, r.shards), h('td', { class: 'num' }, r.expected), h('td', { class: 'num' }, r.queued),
              h('td', { class: 'num' }, r.held), h('td', { class: 'num' }, r.parked), h('td', { class: 'num ' + (r.drift ? 'warn' : 'ok') }, r.drift))),
            'No unfinished request.')),
        groupsCard(this.groups, this.groupsError),
        h('p', { class: 'muted' }, 'A request\'s tokens are counted from its own record; the namespace totals compare what the records own with what the priority lists, take records and parked counts hold. Both read zero drift on a healthy system, but for a moment while a token moves.'));
    },
  },
};

/** How often the token audit reads the tenant groups again (Admin::groups: a few calls per group). */
const GROUPS_EVERY_MS = 5000;

/** The token audit's tenant groups: each group's limit, its tokens by state, its rate and the work waiting in it. */
function groupsCard(g, error) {
  const card = (...c) => h('div', { class: 'card', id: 'groups' }, ...c);
  if (!g) return card(h('h2', {}, 'Tenant groups'), h('p', { class: error ? 'error' : 'muted' }, error || 'Reading the groups…'));
  const sum = k => g.groups.reduce((a, x) => a + x[k], 0);
  const waiting = x => x.waiting.length ? x.waiting.map(([p, n]) => `${num(n)} at priority ${p}`).join(', ') : '–';
  return card(h('h2', {}, `Tenant groups (${num(g.groups.length)})`),
    table([['Group'], ['Limit', 'num'], ['Held', 'num'], ['Queued', 'num'], ['Parked', 'num'], ['Rate-waiting', 'num'], ['Rate'], ['Waiting work'], ['Shard', 'num']],
      g.groups.map(x => h('tr', { 'data-name': x.name },
        h('td', { class: 'mono' }, x.name),
        h('td', { class: 'num' }, num(x.limit), x.configured ? null : h('span', { class: 'muted' }, ' (default)')),
        h('td', { class: 'num' }, num(x.held)), h('td', { class: 'num' }, num(x.queued)), h('td', { class: 'num' }, num(x.parked)),
        h('td', { class: 'num' }, num(x.rate_waiting)),
        h('td', {}, x.rate ? `${num(x.rate.n)} per ${age(x.rate.per_ms)}` : '–'),
        h('td', {}, waiting(x)), h('td', { class: 'num' }, x.shard))),
      `No tenant group is in use or configured (a group nobody set has limit ${g.default_limit}).`),
    g.groups.length ? h('p', { class: 'muted' }, `A group holds "limit" tokens of its own: held by the slots running its requests' sub-requests, queued in the priority lists, parked while it has nothing to run, or waiting for its rate to refill. Its requests' tokens wait in the group's queues ("Waiting work", by priority: ${num(g.groups.reduce((a, x) => a + x.waiting.reduce((b, [, n]) => b + n, 0), 0))} now); the priority lists hold the groups' tokens instead (${num(sum('queued'))} now).`) : null);
}

function pauseControls() {
  const p = h('input', { type: 'number', min: 0, max: 99, placeholder: 'all' });
  const run = (what) => async () => {
    const body = p.value === '' ? {} : { priority: Number(p.value) };
    try { await act(`/api/${what}`, body); toast(`${what === 'pause' ? 'Paused' : 'Resumed'} ${p.value === '' ? 'the namespace' : 'priority ' + p.value}.`); } catch (e) { toast(e.message, true); }
  };
  return h('div', { class: 'actions', style: 'margin-top:10px' }, h('label', {}, 'Priority', p),
    h('button', { type: 'button', class: 'secondary', onclick: run('pause') }, 'Pause'),
    h('button', { type: 'button', class: 'secondary', onclick: run('resume') }, 'Resume'));
}

// ---- routing and the live stream -----------------------------------------------------------------

function route() {
  const hash = location.hash.replace(/^#/, '') || '/';
  const [path, query] = hash.split('?');
  const params = new URLSearchParams(query || '');
  let name, arg;
  if (path.startsWith('/request/')) { name = 'request'; arg = decodeURIComponent(path.slice('/request/'.length)); }
  else name = { '/': 'overview', '/requests': 'requests', '/workers': 'workers', '/events': 'events', '/tokens': 'tokens' }[path] || 'overview';
  for (const a of document.querySelectorAll('#nav a')) a.classList.toggle('active', a.dataset.page === (name === 'request' ? 'requests' : name));
  const main = document.getElementById('main');
  fill(main);
  main.dataset.page = name;
  S.page = pages[name];
  S.page.render(main, params, arg);
}

/** A reading arrived: the page shows it, reading more if it must (one read at a time). */
async function tick() {
  if (!S.page || S.refreshing) return;
  S.refreshing = true;
  try { await S.page.tick(); } catch (e) { console.error(e); } finally { S.refreshing = false; }
}

function connect() {
  const live = document.getElementById('live');
  const es = new EventSource('/api/live');
  es.onopen = () => { live.className = 'live on'; live.textContent = 'live'; };
  es.onerror = () => { live.className = 'live off'; live.textContent = 'reconnecting'; };
  es.addEventListener('overview', e => {
    S.overview = JSON.parse(e.data);
    // A reading that carries an earlier (large) tally has no drift: the streak waits for the next.
    const drift = S.overview.tokens.drift;
    if (drift !== null) S.driftStreak = drift === 0 ? 0 : S.driftStreak + 1;
    tick();
  });
  es.addEventListener('completion', e => {
    S.events.unshift(JSON.parse(e.data));
    S.events.length = Math.min(S.events.length, 200);
    if (S.page === pages.events) pages.events.tick();
  });
}

async function start() {
  try { S.config = await api('/api/config'); } catch (e) { document.getElementById('main').replaceChildren(h('p', { class: 'error' }, e.message)); return; }
  document.getElementById('ns').textContent = S.config.namespace;
  const mode = document.getElementById('mode');
  mode.textContent = S.config.actions ? 'actions allowed' : 'read-only';
  mode.className = 'mode' + (S.config.actions ? ' actions' : '');
  try { S.overview = await api('/api/overview'); } catch (e) { toast(e.message, true); }
  window.addEventListener('hashchange', route);
  route();
  connect();
}

start();
