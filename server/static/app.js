// The lineage page: a git-style graph of every version (layout computed by the server, fetched in pages,
// rows virtualized so 10,000 versions scroll smoothly), a version's record and its diff on click.
"use strict";
const API = "api/v1";
const ROW_H = 24, LANE_W = 14, PAGE = 500, OVERSCAN = 20;
const COLORS = ["#0969da", "#1a7f37", "#8250df", "#bf3989", "#bc4c00", "#0a3069", "#4d2d00", "#116329"];

const state = { filter: "", color: "", total: 0, lanes: 1, rows: [], pages: new Map(), selected: null,
                second: null, sort: { key: "rel_change", desc: true }, diffRows: [], generation: 0 };
const $ = (id) => document.getElementById(id);

function esc(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

async function getJSON(path, params) {
  const url = new URL(path, document.baseURI);
  for (const [k, v] of Object.entries(params || {})) if (v !== undefined && v !== null && v !== "") url.searchParams.set(k, v);
  const r = await fetch(url);
  const body = await r.json();
  if (!r.ok) throw new Error(body.error ? `${body.error.code}: ${body.error.message}` : `HTTP ${r.status}`);
  return body;
}

function setStatus(text, error) {
  const s = $("status");
  s.textContent = text;
  s.className = error ? "error" : "";
}

// ---------------------------------------------------------------- graph pages
async function loadPage(index) {
  if (state.pages.has(index)) return state.pages.get(index);
  const gen = state.generation;
  const p = (async () => {
    let token = null;
    // Tokens are opaque: walk from the previous page's token (pages are loaded in order when needed).
    if (index > 0) {
      const prev = await loadPage(index - 1);
      token = prev.next_page_token;
      if (!token) return { items: [], next_page_token: null };
    }
    const body = await getJSON(`${API}/graph`, { filter: state.filter, color: state.color, limit: PAGE, page_token: token });
    if (gen !== state.generation) return body;
    state.total = body.total;
    state.lanes = Math.max(1, body.lanes);
    for (const row of body.items) state.rows[row.row] = row;
    return body;
  })();
  state.pages.set(index, p);
  return p;
}

async function reload() {
  state.generation += 1;
  state.rows = [];
  state.pages = new Map();
  state.total = 0;
  $("scroller").scrollTop = 0;
  try {
    await loadPage(0);
    setStatus(`${state.total} versions`);
  } catch (e) {
    setStatus(String(e.message || e), true);
    state.total = 0;
  }
  render();
}

// ---------------------------------------------------------------- drawing
function metricRange() {
  let lo = Infinity, hi = -Infinity;
  for (const r of state.rows) if (r && typeof r.metric === "number") { lo = Math.min(lo, r.metric); hi = Math.max(hi, r.metric); }
  return [lo, hi];
}

function nodeColor(row, range) {
  if (typeof row.metric === "number" && range[1] >= range[0]) {
    const t = range[1] > range[0] ? (row.metric - range[0]) / (range[1] - range[0]) : 0.5;
    return `hsl(${Math.round(240 - 240 * t)}, 70%, 45%)`;  // blue (low) to red (high)
  }
  return COLORS[row.lane % COLORS.length];
}

const x = (lane) => 8 + lane * LANE_W;
const y = (row) => row * ROW_H + ROW_H / 2;

function render() {
  const scroller = $("scroller");
  $("spacer").style.height = `${state.total * ROW_H}px`;
  const first = Math.max(0, Math.floor(scroller.scrollTop / ROW_H) - OVERSCAN);
  const last = Math.min(state.total, Math.ceil((scroller.scrollTop + scroller.clientHeight) / ROW_H) + OVERSCAN);
  for (let p = Math.floor(first / PAGE); p <= Math.floor(Math.max(first, last - 1) / PAGE); p++) {
    if (!state.pages.has(p) && p * PAGE < state.total) loadPage(p).then(render, (e) => setStatus(String(e.message || e), true));
  }
  const width = x(state.lanes) + 4;
  const range = metricRange();
  const svg = $("edges");
  svg.setAttribute("width", width);
  svg.setAttribute("height", state.total * ROW_H);
  let paths = "", dots = "", html = "";
  // Edges that cross the window: from loaded rows above it down to parents inside or below it.
  for (let i = 0; i < last; i++) {
    const r = state.rows[i];
    if (!r) continue;
    r.parents.forEach((p, k) => {
      if (p.row < first) return;
      // As git draws it: the first parent's line runs down the child's lane and joins the parent's lane
      // one row above it (where lanes merge); a merge's other parents leave at once for their own lane.
      const color = COLORS[(k === 0 ? r.lane : p.lane) % COLORS.length];
      const d = k === 0
        ? `M${x(r.lane)},${y(r.row)} L${x(r.lane)},${Math.max(y(r.row), y(p.row) - ROW_H)} L${x(p.lane)},${y(p.row)}`
        : `M${x(r.lane)},${y(r.row)} L${x(p.lane)},${Math.min(y(r.row) + ROW_H, y(p.row))} L${x(p.lane)},${y(p.row)}`;
      paths += `<path d="${d}" stroke="${color}" fill="none" stroke-width="2"/>`;
    });
  }
  for (let i = first; i < last; i++) {
    const r = state.rows[i];
    if (!r) continue;
    const radius = r.merge || r.fork ? 5 : 4;
    dots += `<circle class="node" data-id="${r.id}" cx="${x(r.lane)}" cy="${y(r.row)}" r="${radius}" fill="${nodeColor(r, range)}"` +
            `${r.fork ? ' stroke="#000" stroke-dasharray="2,1"' : ""}><title>${esc(r.id.slice(0, 12))}</title></circle>`;
    const refs = r.refs.map((n) => `<span class="ref${n.startsWith("tag: ") ? " tag" : ""}">${esc(n)}</span>`).join("");
    const cls = r.id === state.selected ? " selected" : r.id === state.second ? " second" : "";
    html += `<div class="row${cls}" data-id="${r.id}" data-row="${r.row}" style="top:${r.row * ROW_H}px;padding-left:${width + 4}px">` +
            `<span class="id">${r.id.slice(0, 10)}</span>${refs}` +
            `${r.pruned ? '<span class="pruned">[pruned]</span>' : ""}` +
            `<span class="step">${r.step === null ? "" : "step " + r.step}</span>` +
            `<span class="msg">${esc(r.message)}${r.fork ? " (fork)" : ""}${r.merge ? " (merge)" : ""}</span></div>`;
  }
  svg.innerHTML = paths + dots;
  $("rows").innerHTML = html;
}

// ---------------------------------------------------------------- details
function kvRows(prefix, obj) {
  return Object.entries(obj || {}).map(([k, v]) => `<tr><td>${esc(prefix + k)}</td><td>${esc(JSON.stringify(v))}</td></tr>`).join("");
}

async function walk(path, params) {
  const out = [];
  let token = null;
  do {
    const body = await getJSON(path, { ...params, limit: 1000, page_token: token });
    out.push(...body.items);
    token = body.next_page_token;
  } while (token);
  return out;
}

function fmt(v) {
  if (v === null || v === undefined) return "";
  if (typeof v === "number" && Number.isInteger(v)) return String(v);
  if (typeof v === "number") return Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(3) : v.toFixed(4);
  return esc(v);
}

const DIFF_COLS = ["key", "status", "l2_change", "rel_change", "cosine", "max_abs_diff"];

function renderDiff() {
  const { key, desc } = state.sort;
  const rows = [...state.diffRows].sort((a, b) => {
    const u = a[key], v = b[key];
    if (u === v) return 0;
    if (u === null || u === undefined) return 1;
    if (v === null || v === undefined) return -1;
    return (u < v ? -1 : 1) * (desc ? -1 : 1);
  });
  const head = DIFF_COLS.map((c) => `<th data-col="${c}">${c}${c === key ? (desc ? " \u25bc" : " \u25b2") : ""}</th>`).join("");
  const body = rows.map((r) => `<tr data-key="${esc(r.key)}">` + DIFF_COLS.map((c) =>
    `<td${typeof r[c] === "number" ? ' class="num"' : ""}>${fmt(r[c])}</td>`).join("") + "</tr>").join("");
  const table = document.getElementById("diff-table");
  if (table) table.innerHTML = `<thead><tr>${head}</tr></thead><tbody>${body}</tbody>`;
}

async function showDiff(a, b, title) {
  const box = document.getElementById("diff");
  box.innerHTML = `<h3>${esc(title)}</h3><p class="hint">loading\u2026</p>`;
  try {
    state.diffRows = await walk(`${API}/versions/${a}/diff/${b}`, {});
    box.innerHTML = `<h3>${esc(title)}</h3><table id="diff-table"></table>`;
    renderDiff();
  } catch (e) {
    box.innerHTML = `<h3>${esc(title)}</h3><p class="error">${esc(e.message || e)}</p>`;
  }
}

async function select(id, shift) {
  if (shift && state.selected && state.selected !== id) {
    state.second = id;
    render();
    await showDiff(state.selected, id, `diff ${state.selected.slice(0, 10)} \u2192 ${id.slice(0, 10)}`);
    return;
  }
  state.selected = id;
  state.second = null;
  render();
  const pane = $("detail");
  pane.innerHTML = `<p class="hint">loading\u2026</p>`;
  try {
    const [v, where] = await Promise.all([getJSON(`${API}/versions/${id}`), getJSON(`${API}/versions/${id}/where`)]);
    const created = new Date(v.created * 1000).toISOString();
    pane.innerHTML = `<h2>${esc(v.id.slice(0, 16))}</h2><table class="kv record">` +
      `<tr><td>id</td><td>${esc(v.id)}</td></tr><tr><td>step</td><td>${fmt(v.step)}</td></tr>` +
      `<tr><td>epoch</td><td>${fmt(v.epoch)}</td></tr><tr><td>branch</td><td>${esc(v.branch || "")}</td></tr>` +
      `<tr><td>created</td><td>${created}</td></tr><tr><td>message</td><td>${esc(v.message || "")}</td></tr>` +
      `<tr><td>parents</td><td>${v.parents.map((p) => esc(p.slice(0, 10))).join(", ")}</td></tr>` +
      `<tr><td>tiers</td><td class="tiers">${esc(where.tiers.join(", "))}</td></tr>` +
      kvRows("hparams.", v.hparams) + kvRows("metrics.", v.metrics) + kvRows("annotations.", v.annotations) +
      `</table><div id="diff"></div>`;
    if (v.parents.length) await showDiff(v.parents[0], v.id, `diff against parent ${v.parents[0].slice(0, 10)}`);
    else document.getElementById("diff").innerHTML = `<p class="hint">no parent: the first version of its line</p>`;
  } catch (e) {
    pane.innerHTML = `<p class="error">${esc(e.message || e)}</p>`;
  }
}

// ---------------------------------------------------------------- wiring
$("scroller").addEventListener("scroll", () => window.requestAnimationFrame(render));
$("rows").addEventListener("click", (ev) => {
  const row = ev.target.closest(".row");
  if (row) select(row.dataset.id, ev.shiftKey);
});
$("detail").addEventListener("click", (ev) => {
  const th = ev.target.closest("th[data-col]");
  if (!th) return;
  const col = th.dataset.col;
  state.sort = { key: col, desc: state.sort.key === col ? !state.sort.desc : col !== "key" && col !== "status" };
  renderDiff();
});
$("filter-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  state.filter = $("filter").value.trim();
  state.color = $("color").value.trim();
  reload();
});
window.addEventListener("resize", render);
reload();
