// treeserve tree viewer: polls the JSON tree API and draws the selected tree.
//
//   GET /v1/server             every 2 s  -> the pool's gauges
//   GET /v1/trees              every 2 s  -> the caller's live trees
//   GET /v1/trees/{id}?detail=1 every 250 ms (1 s once nothing has changed for 5 s)
//                                          -> the selected tree's branches
//
// Reading a tree renews its lease, so after 2 minutes without a change (?pause_after_s=N) the
// page stops reading it until the user resumes: an open tab does not keep an abandoned tree
// alive.
// Failed calls back off (doubling, up to 8 s) and say why in the status line. The server
// forgets a pruned branch at once, so the page keeps the last state it saw of every branch
// and shows the ones that disappear as pruned. Server text only ever reaches the page through
// textContent / attribute values, never as markup.
'use strict';

(() => {
  const kTreeFastMs = 250;   // while branches change or generate
  const kTreeSlowMs = 1000;  // once the tree has been quiet for kQuietMs
  const kQuietMs = 5000;
  // Reading a tree renews its idle lease: after this long with nothing changing the page
  // stops reading it (a button resumes), so a forgotten tab does not keep a tree alive.
  // ?pause_after_s=N sets another time (the browser test uses a short one).
  const kPauseAfterMs = (() => {
    const s = Number(new URLSearchParams(location.search).get('pause_after_s'));
    return Number.isFinite(s) && s >= 1 ? s * 1000 : 120000;
  })();
  const kListMs = 2000;
  const kMaxBackoffMs = 8000;
  const kRequestTimeoutMs = 5000;
  const kPageSize = 1024;    // branches per GetTree page
  const kMaxPages = 8;       // at most 8192 branches are drawn
  const kListPageSize = 1000;
  const kMaxListPages = 5;   // at most 5000 trees are listed
  const kRowH = 44;
  const kTopPad = 26;
  const kKeyStorage = 'treeserve.viewer.apiKey';
  const kStates = ['idle', 'prefill', 'generating', 'verifying', 'beam', 'pruned'];
  const SVG = 'http://www.w3.org/2000/svg';

  const $ = (id) => document.getElementById(id);

  // DOM helpers: children are nodes or strings (as text nodes), attributes are set as values.
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return node;
  }
  function svgEl(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    return node;
  }
  const num = (v) => (Number.isFinite(Number(v)) ? Number(v) : 0);
  const str = (v) => (v === null || v === undefined ? '' : String(v));
  const fmt = (v) => num(v).toLocaleString('en');
  const plural = (n, one, many) => `${fmt(n)} ${num(n) === 1 ? one : many || one + 's'}`;
  const shortId = (id) => (id.length > 12 ? id.slice(0, 10) + '…' : id);
  const oneLine = (s) => s.replace(/\r?\n/g, '⏎').replace(/\t/g, '⇥');
  const truncate = (s, n) => (s.length > n ? s.slice(0, Math.max(1, n - 1)) + '…' : s);
  function fmtDuration(ms) {
    if (ms <= 0) return 'now';
    const s = Math.round(ms / 1000);
    if (s < 60) return s + ' s';
    const m = Math.floor(s / 60);
    return m < 60 ? `${m} min ${s % 60} s` : `${Math.floor(m / 60)} h ${m % 60} min`;
  }

  // ---- state ----
  const view = {
    key: '',
    treeId: '',
    branches: new Map(),  // id -> record (live and pruned), for treeId only
    order: 0,             // first-seen counter: siblings at one offset keep their order
    tree: null,           // the last GetTree summary
    gone: false,          // the tree answered 404
    paused: false,        // quiet for kPauseAfterMs: not read until resumed
    selected: '',         // branch id shown in the detail panel
    pageSize: 0,          // tokens per KV page (from /v1/server)
    lastChange: 0,
    errors: {},           // source -> message, shown in the status line
    truncated: false,
    rowNodes: new Map(),  // branch id -> its SVG row group, reused across redraws
  };

  // ---- API ----
  async function api(path) {
    const headers = {Accept: 'application/json'};
    if (view.key) headers.Authorization = 'Bearer ' + view.key;
    let res;
    try {
      res = await fetch(path, {headers, cache: 'no-store',
                               signal: AbortSignal.timeout(kRequestTimeoutMs)});
    } catch (e) {
      return {ok: false, status: 0, message: e && e.name === 'TimeoutError'
        ? 'the server did not answer in time' : 'cannot reach the server'};
    }
    let body = null;
    try { body = await res.json(); } catch (e) { body = null; }
    if (res.ok && body && typeof body === 'object') return {ok: true, status: res.status, body};
    const err = body && typeof body === 'object' && body.error;
    const message = err && typeof err.message === 'string' ? err.message
      : (res.ok ? 'the answer is not JSON' : res.statusText || 'no message');
    return {ok: false, status: res.status, message};
  }

  function explain(what, r, retryMs) {
    const retry = retryMs ? ` Retrying in ${fmtDuration(retryMs)}.` : '';
    if (r.status === 401) return `The server wants an API key (401: ${r.message}). Enter it above.`;
    if (r.status === 403) return `This key may not read ${what} (403: ${r.message}).`;
    if (r.status === 0) return `${what}: ${r.message}.${retry}`;
    return `${what}: HTTP ${r.status}: ${r.message}.${retry}`;
  }

  function setError(source, message) {
    if (message) view.errors[source] = message; else delete view.errors[source];
    const msgs = [...new Set(Object.values(view.errors))];
    const status = $('status');
    status.textContent = msgs.join(' ');
    status.classList.toggle('error', msgs.length > 0);
    if (msgs.some((m) => m.includes('(401')) && document.activeElement === document.body) {
      $('api-key').focus();
    }
  }

  // A poller runs `step` again after the delay it returns (null: stop); a failing step
  // (returns false) runs again after `retryMs`, which doubles on each failure in a row.
  // restart() starts over; a step still in flight sees current() turn false and must then
  // leave the page alone.
  function poller(step) {
    let timer = 0, gen = 0, backoff = 0;
    async function tick(g) {
      const retryMs = Math.min(backoff ? backoff * 2 : 500, kMaxBackoffMs);
      let next;
      try {
        next = await step(retryMs, () => g === gen);
      } catch (e) {
        next = false;
        console.error(e);
      }
      if (g !== gen || next === null) return;
      backoff = next === false ? retryMs : 0;
      timer = setTimeout(() => tick(g), next === false ? retryMs : next);
    }
    return {
      restart() { clearTimeout(timer); gen++; backoff = 0; tick(gen); },
      stop() { clearTimeout(timer); gen++; },
    };
  }

  // ---- pool gauges and tree list ----
  async function pollServer(retryMs, current) {
    const r = await api('/v1/server');
    if (!current()) return null;
    if (!r.ok) {
      setError('server', explain('GET /v1/server', r, retryMs));
      return false;
    }
    setError('server', '');
    renderPool(r.body);
    return kListMs;
  }

  function renderPool(s) {
    view.pageSize = num(s.page_size);
    const total = num(s.kv_pages_total), free = num(s.kv_pages_free);
    const evictable = num(s.kv_pages_evictable);
    const used = Math.max(0, total - free - evictable);
    const bar = el('div', {class: 'gauge', 'aria-hidden': 'true'});
    for (const [cls, n] of [['used', used], ['evictable', evictable], ['free', free]]) {
      const part = el('span', {class: 'g-' + cls});
      part.style.width = total > 0 ? (100 * n / total).toFixed(2) + '%' : '0';
      bar.append(part);
    }
    const rows = [
      ['pages in use', `${fmt(used)} of ${fmt(total)}`],
      ['pages evictable (cache)', fmt(evictable)],
      ['pages free', fmt(free)],
      ['cached tokens', fmt(s.radix_cached_tokens)],
      ['live trees', fmt(s.live_trees)],
      ['live branches', fmt(s.live_branches)],
      ['decode steps', fmt(s.decode_steps)],
      ['model', str(s.model) || '—'],
      ['backend', str(s.backend) || '—'],
      ['page size', fmt(s.page_size) + ' tokens'],
    ];
    $('pool').replaceChildren(bar, dl(rows, 'pool-fields'));
  }

  // A <dl> of [term, value] rows; `grouped` wraps each pair in a <div> so a wrapping
  // layout never splits one.
  function dl(rows, id, grouped) {
    const list = el('dl', id ? {id} : {});
    for (const [k, v] of rows) {
      const pair = [el('dt', {}, k), el('dd', {}, v)];
      if (grouped) list.append(el('div', {}, ...pair)); else list.append(...pair);
    }
    return list;
  }

  async function pollList(retryMs, current) {
    const trees = [];
    let token = '';
    for (let page = 0; page < kMaxListPages; page++) {
      let path = `/v1/trees?page_size=${kListPageSize}`;
      if (token) path += '&page_token=' + encodeURIComponent(token);
      const r = await api(path);
      if (!current()) return null;
      if (!r.ok) {
        setError('list', explain('GET /v1/trees', r, retryMs));
        return false;
      }
      if (Array.isArray(r.body.data)) trees.push(...r.body.data);
      token = str(r.body.next_page_token);
      if (!token) break;
    }
    setError('list', '');
    renderTreeList(trees, token !== '');
    return kListMs;
  }

  function renderTreeList(trees, more) {
    const list = $('tree-list');
    const focused = document.activeElement && document.activeElement.dataset
      ? document.activeElement.dataset.treeId : undefined;
    trees.sort((a, b) => num(b.created_at_unix_ms) - num(a.created_at_unix_ms));
    const items = trees.map((t) => {
      const id = str(t.id);
      const current = id === view.treeId;
      const button = el('button', {type: 'button', class: 'tree-item', 'data-tree-id': id,
                                   title: id, 'aria-current': current ? 'true' : 'false'},
        el('span', {class: 'tree-id'}, shortId(id)),
        el('span', {class: 'tree-meta'},
           `${plural(t.live_branches, 'branch', 'branches')} · ${plural(t.total_tokens, 'token')} · ` +
           plural(t.kv_pages, 'page')));
      button.addEventListener('click', () => selectTree(id));
      return el('li', {}, button);
    });
    list.replaceChildren(...items);
    $('tree-count').textContent = `(${trees.length}${more ? '+' : ''})`;
    $('tree-list-empty').hidden = trees.length > 0;
    if (focused) {
      const again = [...list.querySelectorAll('button')].find((b) => b.dataset.treeId === focused);
      if (again) again.focus();
    }
  }

  // ---- the selected tree ----
  const treePoller = poller(pollTree);

  function selectTree(id) {
    if (id === view.treeId && !view.gone) return;
    view.treeId = id;
    view.branches = new Map();
    view.order = 0;
    view.tree = null;
    view.gone = false;
    view.paused = false;
    view.selected = '';
    view.truncated = false;
    view.rowNodes = new Map();
    view.lastChange = Date.now();
    setError('tree', '');
    $('graph').replaceChildren();
    const hash = id ? '#tree=' + encodeURIComponent(id) : '';
    if (location.hash !== hash) history.replaceState(null, '', location.pathname + location.search + hash);
    for (const b of document.querySelectorAll('#tree-list button')) {
      b.setAttribute('aria-current', b.dataset.treeId === id ? 'true' : 'false');
    }
    render();
    if (id) treePoller.restart(); else treePoller.stop();
  }

  async function pollTree(retryMs, current) {
    const id = view.treeId;
    if (!id) return null;
    const branches = [];
    let token = '', tree = null;
    for (let page = 0; page < kMaxPages; page++) {
      let path = `/v1/trees/${encodeURIComponent(id)}?detail=1&page_size=${kPageSize}`;
      if (token) path += '&page_token=' + encodeURIComponent(token);
      const r = await api(path);
      if (!current() || id !== view.treeId) return null;  // restarted or another tree picked
      if (!r.ok) {
        if (r.status === 404) {
          view.gone = true;
          setError('tree', `Tree ${id} is gone (404: ${r.message}): deleted, its lease ran out, or another key owns it.`);
          render();
          return null;
        }
        setError('tree', explain(`GET tree ${shortId(id)}`, r, retryMs));
        return false;
      }
      tree = r.body;
      if (Array.isArray(tree.branches)) branches.push(...tree.branches);
      token = str(tree.next_page_token);
      if (!token) break;
    }
    setError('tree', '');
    view.tree = tree;
    view.truncated = token !== '';
    const changed = merge(branches, !view.truncated);
    const now = Date.now();
    if (changed) view.lastChange = now;
    render();
    const busy = [...view.branches.values()].some((b) => b.live && b.state !== 'idle');
    if (busy) view.lastChange = now;
    if (now - view.lastChange >= kPauseAfterMs) {
      view.paused = true;
      renderSummary();
      return null;
    }
    return now - view.lastChange < kQuietMs ? kTreeFastMs : kTreeSlowMs;
  }

  // Folds one GetTree answer into the records; returns whether anything changed. Branches
  // missing from a complete answer were pruned: they keep their last state, marked pruned.
  function merge(list, complete) {
    const now = Date.now();
    const seen = new Set();
    let changed = false;
    for (const b of list) {
      const id = str(b.id);
      if (!id) continue;
      seen.add(id);
      let rec = view.branches.get(id);
      if (!rec) {
        rec = {id, order: view.order++, parent: '', text: ''};
        view.branches.set(id, rec);
        changed = true;
      }
      // A parent the page saw pruned stays this branch's parent in the drawing.
      const known = view.branches.get(rec.parent);
      if (!(known && !known.live)) rec.parent = str(b.parent);
      const next = {
        fork_offset: num(b.fork_offset),
        length: num(b.length),
        state: kStates.includes(b.state) ? b.state : (b.state ? 'other' : 'idle'),
        finish: str(b.finish_reason),
        text: str(b.text),
        kv_pages: b.kv_pages === undefined ? null : num(b.kv_pages),
        shared_pages: b.shared_pages === undefined ? null : num(b.shared_pages),
      };
      for (const [k, v] of Object.entries(next)) {
        if (rec[k] !== v) { rec[k] = v; changed = true; }
      }
      rec.live = true;
      rec.lastSeen = now;
    }
    if (complete) {
      for (const rec of view.branches.values()) {
        if (rec.live && !seen.has(rec.id)) {
          rec.live = false;
          changed = true;
        }
      }
    }
    return changed;
  }

  // Rows in drawing order: depth first from the roots, children by fork offset, then by when
  // the page first saw them.
  function rows(showPruned) {
    const visible = [...view.branches.values()].filter((b) => b.live || showPruned);
    const ids = new Set(visible.map((b) => b.id));
    const kids = new Map();
    const roots = [];
    for (const b of visible) {
      if (b.parent && ids.has(b.parent)) {
        if (!kids.has(b.parent)) kids.set(b.parent, []);
        kids.get(b.parent).push(b);
      } else {
        roots.push(b);
      }
    }
    const byPlace = (a, b) => a.fork_offset - b.fork_offset || a.order - b.order;
    const out = [];
    const drawn = new Set();  // a parent cycle (a confused answer) must not loop for ever
    const walk = (b, depth) => {
      if (drawn.has(b.id)) return;
      drawn.add(b.id);
      out.push({b, depth});
      for (const c of (kids.get(b.id) || []).sort(byPlace)) walk(c, depth + 1);
    };
    for (const r of roots.sort(byPlace)) walk(r, 0);
    return out;
  }

  const stateLabel = (b) => (b.live ? b.state : 'pruned');

  function describe(b) {
    const own = Math.max(0, b.length - b.fork_offset);
    const parts = [stateLabel(b), `${fmt(own)} tokens (length ${fmt(b.length)})`];
    if (b.finish) parts.push('finished: ' + b.finish);
    if (b.kv_pages !== null) parts.push(`${fmt(b.kv_pages)} pages, ${fmt(b.shared_pages)} shared`);
    return parts.join(' · ');
  }

  function render() {
    renderSummary();
    const showPruned = $('show-pruned').checked;
    const list = view.treeId ? rows(showPruned) : [];
    drawGraph(list);
    renderTable(list);
    renderDetail();
  }

  function renderSummary() {
    const t = view.tree;
    $('tree-h').textContent = view.treeId ? 'Tree ' + view.treeId : 'No tree selected';
    const note = $('tree-note');
    if (!view.treeId) {
      note.textContent = 'Pick a tree on the left, or open /viewer#tree=ID.';
    } else if (view.gone) {
      note.textContent = 'This tree is gone; the drawing shows it as last seen.';
    } else if (view.paused) {
      note.textContent = `Paused: nothing changed for ${fmtDuration(kPauseAfterMs)}, and reading ` +
        'a tree renews its lease, so the page stopped reading it.';
    } else if (!t) {
      note.textContent = 'Loading…';
    } else if (view.truncated) {
      note.textContent = `Showing the first ${fmt(kPageSize * kMaxPages)} branches.`;
    } else {
      note.textContent = '';
    }
    note.hidden = note.textContent === '';
    $('resume').hidden = !(view.treeId && view.paused && !view.gone);
    const pruned = [...view.branches.values()].filter((b) => !b.live).length;
    const fields = !t ? [] : [
      ['live branches', fmt(t.live_branches)],
      ['pruned (seen here)', fmt(pruned)],
      ['tokens', fmt(t.total_tokens)],
      ['KV pages', fmt(t.kv_pages)],
      ['lease expires', t.expires_at_unix_ms ? 'in ' + fmtDuration(num(t.expires_at_unix_ms) - Date.now()) : '—'],
    ];
    $('tree-summary').replaceChildren(...dl(fields, '', true).childNodes);
    $('tree-view').classList.toggle('gone', view.gone);
  }

  // The tree as an SVG: one row per branch; x is the token position, so a branch's bar runs
  // from its fork offset to its length and hangs from its parent's row at the fork offset.
  function drawGraph(list) {
    const graph = $('graph');
    let svg = graph.querySelector('svg');
    if (!list.length) {
      graph.replaceChildren();
      view.rowNodes = new Map();
      return;
    }
    // The panel's width, not the graph's: the graph is hidden while empty.
    const width = Math.max(560, $('tree-view').clientWidth - 2);
    const barW = Math.min(420, Math.max(120, Math.round(width * 0.3)));
    const x0 = 12;
    const labelX = x0 + barW + 18;
    const maxLen = Math.max(1, ...list.map((r) => r.b.length));
    const x = (pos) => x0 + (barW * Math.min(pos, maxLen)) / maxLen;
    const height = kTopPad + list.length * kRowH + 8;
    if (!svg) {
      svg = svgEl('svg', {role: 'group', class: 'tree-svg'});
      const defs = svgEl('defs');
      const hatch = svgEl('pattern', {id: 'hatch', width: 6, height: 6,
                                      patternUnits: 'userSpaceOnUse', patternTransform: 'rotate(45)'});
      hatch.append(svgEl('rect', {width: 6, height: 6, class: 'hatch-bg'}),
                   svgEl('line', {x1: 0, y1: 0, x2: 0, y2: 6, class: 'hatch-line'}));
      // Labels stop at the drawing's right edge.
      const clip = svgEl('clipPath', {id: 'label-clip'});
      clip.append(svgEl('rect', {y: 0}));
      defs.append(hatch, clip);
      const axis = svgEl('g', {class: 'axis', 'aria-hidden': 'true'});
      const edges = svgEl('g', {class: 'edges', 'aria-hidden': 'true'});
      const nodes = svgEl('g', {class: 'nodes'});
      svg.append(defs, axis, edges, nodes);
      graph.replaceChildren(svg);
    }
    svg.setAttribute('width', width);
    svg.setAttribute('height', height);
    svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
    svg.setAttribute('aria-label', `Branches of tree ${view.treeId}`);
    const [defs, axis, edges, nodes] = svg.children;
    setAttrs(defs.querySelector('#label-clip rect'),
             {x: labelX, width: Math.max(0, width - labelX - 6), height});

    const axisText = (tx, label, anchor) => {
      const t = svgEl('text', {x: tx, y: 14, 'text-anchor': anchor});
      t.textContent = label;
      return t;
    };
    axis.replaceChildren(
      svgEl('line', {x1: x0, x2: x0 + barW, y1: 20, y2: 20}),
      axisText(x0, '0', 'start'), axisText(x0 + barW, fmt(maxLen) + ' tokens', 'end'));

    const rowY = new Map();
    list.forEach((r, i) => rowY.set(r.b.id, kTopPad + i * kRowH + 12));
    const edgeNodes = [];
    const keep = new Set();
    const chars = Math.max(12, Math.floor((width - labelX - 8) / 7.3));
    list.forEach(({b}, i) => {
      const y = rowY.get(b.id);
      const cls = b.live ? 'state-' + b.state : 'pruned';
      if (rowY.has(b.parent)) {
        const py = rowY.get(b.parent);
        const fx = x(b.fork_offset);
        edgeNodes.push(svgEl('path', {d: `M${fx},${py} V${y}`, class: 'edge' + (b.live ? '' : ' pruned')}),
                       svgEl('circle', {cx: fx, cy: py, r: 3, class: 'fork'}));
      }
      keep.add(b.id);
      let g = view.rowNodes.get(b.id);
      if (!g) {
        g = svgEl('g', {tabindex: 0, role: 'button', 'data-branch-id': b.id});
        g.append(svgEl('title'), svgEl('rect', {class: 'row-bg'}), svgEl('rect', {class: 'bar'}),
                 svgEl('rect', {class: 'shared'}),
                 svgEl('text', {class: 'l1', 'clip-path': 'url(#label-clip)'}),
                 svgEl('text', {class: 'l2', 'clip-path': 'url(#label-clip)'}));
        g.addEventListener('click', () => selectBranch(b.id));
        g.addEventListener('keydown', (e) => {
          if (e.key === 'Enter' || e.key === ' ') { e.preventDefault(); selectBranch(b.id); }
        });
        view.rowNodes.set(b.id, g);
      }
      // DOM order follows drawing order (tab order); a node already in place is left alone,
      // since moving it would drop its keyboard focus.
      if (nodes.children[i] !== g) nodes.insertBefore(g, nodes.children[i] || null);
      const [title, bg, bar, shared, l1, l2] = g.children;
      g.setAttribute('class', `row ${cls}${b.id === view.selected ? ' selected' : ''}`);
      g.setAttribute('aria-label', `branch ${b.id}: ${describe(b)}`);
      g.setAttribute('aria-pressed', b.id === view.selected ? 'true' : 'false');
      g.dataset.state = stateLabel(b);
      g.dataset.parent = b.parent;
      g.dataset.textLength = String(b.text.length);
      title.textContent = `${b.id}\n${describe(b)}\n\n${truncate(b.text, 4000)}`;
      setAttrs(bg, {x: 2, y: y - 16, width: width - 4, height: kRowH - 4, rx: 4});
      const bx = x(b.fork_offset);
      setAttrs(bar, {x: bx, y: y - 6, width: Math.max(3, x(b.length) - bx), height: 12, rx: 2});
      const sharedEnd = b.shared_pages && view.pageSize
        ? Math.min(b.length, b.shared_pages * view.pageSize) : 0;
      setAttrs(shared, {x: bx, y: y - 6, height: 12,
                        width: sharedEnd > b.fork_offset ? x(sharedEnd) - bx : 0});
      l1.replaceChildren();
      const idSpan = svgEl('tspan', {class: 'bid'});
      idSpan.textContent = shortId(b.id);
      const rest = svgEl('tspan');
      rest.textContent = '  ' + describe(b);
      l1.append(idSpan, rest);
      setAttrs(l1, {x: labelX, y: y - 1});
      l2.textContent = b.text ? truncate(oneLine(b.text), chars) : '(no tokens of its own yet)';
      setAttrs(l2, {x: labelX, y: y + 15});
      l2.classList.toggle('empty', !b.text);
    });
    for (const [id, n] of view.rowNodes) {
      if (!keep.has(id)) { n.remove(); view.rowNodes.delete(id); }
    }
    edges.replaceChildren(...edgeNodes);
  }

  function setAttrs(node, attrs) {
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  }

  function renderTable(list) {
    const table = $('branch-table');
    table.hidden = list.length === 0;
    $('branch-rows').replaceChildren(...list.map(({b, depth}) => {
      const text = oneLine(b.text);
      const own = Math.max(0, b.length - b.fork_offset);
      const tr = el('tr', {'data-branch-id': b.id, 'data-state': stateLabel(b),
                           'data-parent': b.parent, 'data-tokens': own,
                           'data-finish': b.finish, class: b.live ? '' : 'pruned'},
        el('th', {scope: 'row', title: b.id, class: 'indent-' + Math.min(depth, 8)}, shortId(b.id)),
        el('td', {title: b.parent}, b.parent ? shortId(b.parent) : '—'),
        el('td', {class: 'num'}, fmt(b.fork_offset)),
        el('td', {class: 'num'}, `${fmt(own)} / ${fmt(b.length)}`),
        el('td', {}, stateLabel(b)),
        el('td', {}, b.finish || '—'),
        el('td', {class: 'num'}, b.kv_pages === null ? '—' : `${fmt(b.kv_pages)} (${fmt(b.shared_pages)})`),
        el('td', {class: 'text', title: truncate(b.text, 4000)}, truncate(text, 160)));
      tr.addEventListener('click', () => selectBranch(b.id));
      return tr;
    }));
  }

  function selectBranch(id) {
    view.selected = view.selected === id ? '' : id;
    render();
  }

  function renderDetail() {
    const b = view.branches.get(view.selected);
    const panel = $('detail');
    panel.hidden = !b;
    if (!b) return;
    $('detail-h').textContent = 'Branch ' + b.id;
    const fields = [
      ['state', stateLabel(b) + (b.live ? '' : ` (last seen ${new Date(b.lastSeen).toLocaleTimeString()})`)],
      ['parent', b.parent || '— (root)'],
      ['forks at token', fmt(b.fork_offset)],
      ['length', `${fmt(b.length)} tokens, ${fmt(Math.max(0, b.length - b.fork_offset))} of its own`],
      ['finish reason', b.finish || '—'],
      ['KV pages its path reads', b.kv_pages === null ? '—' : fmt(b.kv_pages)],
      ['of them shared or cached', b.shared_pages === null ? '—' : fmt(b.shared_pages)],
    ];
    $('detail-fields').replaceChildren(...dl(fields).childNodes);
    const pre = $('detail-text');
    if (pre.textContent !== b.text) pre.textContent = b.text;
  }

  // ---- wiring ----
  function loadKey() {
    try { return localStorage.getItem(kKeyStorage) || ''; } catch (e) { return ''; }
  }
  function storeKey(key) {
    try {
      if (key) localStorage.setItem(kKeyStorage, key); else localStorage.removeItem(kKeyStorage);
    } catch (e) { /* storage disabled: the key lasts for this page only */ }
  }

  const serverPoller = poller(pollServer);
  const listPoller = poller(pollList);
  function restartAll() {
    serverPoller.restart();
    listPoller.restart();
    if (view.treeId) {
      view.gone = false;
      view.paused = false;
      view.lastChange = Date.now();
      treePoller.restart();
    }
  }

  function treeFromHash() {
    const m = /^#tree=(.+)$/.exec(location.hash);
    return m ? decodeURIComponent(m[1]) : '';
  }

  function start() {
    view.key = loadKey();
    $('api-key').value = view.key;
    $('key-form').addEventListener('submit', (e) => {
      e.preventDefault();
      const key = $('api-key').value.trim();
      // A header value may not hold control characters: say so rather than fail every call.
      if (/[\u0000-\u001f\u007f]/.test(key) || /[^\u0000-\u00ff]/.test(key)) {
        setError('key', 'That key holds characters an HTTP header cannot carry.');
        return;
      }
      setError('key', '');
      view.key = key;
      storeKey(key);
      restartAll();
    });
    $('key-forget').addEventListener('click', () => {
      view.key = '';
      $('api-key').value = '';
      storeKey('');
      restartAll();
    });
    $('show-pruned').addEventListener('change', render);
    $('resume').addEventListener('click', () => {
      view.paused = false;
      view.lastChange = Date.now();
      render();
      treePoller.restart();
    });
    window.addEventListener('hashchange', () => selectTree(treeFromHash()));
    let resizeTimer = 0;
    window.addEventListener('resize', () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(render, 100);
    });
    serverPoller.restart();
    listPoller.restart();
    selectTree(treeFromHash());
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
})();
