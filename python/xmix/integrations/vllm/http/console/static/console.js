// xmix console: plain JS, no dependencies. Everything that comes from the server (token text,
// app names, metadata, error messages) is put into the page as text (textContent, text nodes,
// attribute values): never parsed as HTML.
"use strict";

const ROOT = location.pathname.replace(/\/xmix\/ui\/?$/, "");
const KEY_STORE = "xmix-console-key";
// Changes to apps take the server's admin key (--xmix-admin-key), not the inference key.
const ADMIN_STORE = "xmix-console-admin-key";
const state = { model: null, info: null, apps: [], liveTimer: null };

// ------------------------------------------------------------------ helpers
function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v === undefined || v === null) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k in node && typeof v !== "string") node[k] = v;
    else node.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function $(sel) { return document.querySelector(sel); }

function setStatus(node, msg, isError) {
  node.textContent = msg;
  node.classList.toggle("error", !!isError);
}

function headers(extra, admin) {
  const h = Object.assign({}, extra || {});
  const key = (admin && sessionStorage.getItem(ADMIN_STORE)) || sessionStorage.getItem(KEY_STORE) || "";
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function errorText(resp) {
  let body = "";
  try { body = await resp.text(); } catch (e) { /* the status says enough */ }
  try {
    const j = JSON.parse(body);
    const m = (j.error && (j.error.message || j.error)) || j.message || j.detail;
    if (m) return `${resp.status}: ${typeof m === "string" ? m : JSON.stringify(m)}`;
  } catch (e) { /* not JSON */ }
  return `${resp.status}: ${body.slice(0, 300) || resp.statusText}`;
}

async function api(method, path, body, extraHeaders, admin) {
  const init = { method, headers: headers(extraHeaders, admin) };
  if (body !== undefined) {
    if (body instanceof ArrayBuffer || body instanceof Blob) init.body = body;
    else { init.body = JSON.stringify(body); init.headers["Content-Type"] = "application/json"; }
  }
  const resp = await fetch(ROOT + path, init);
  if (!resp.ok) throw new Error(await errorText(resp));
  return resp.json();
}

function fmtNum(v, digits) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  return Number.isInteger(v) ? String(v) : v.toPrecision(digits || 4);
}

function fmtMs(s) { return s === null || s === undefined ? "–" : (s * 1000).toFixed(1) + " ms"; }

function fmtAdded(s) {
  if (s === null || s === undefined) return "–";
  return (s >= 0 ? "+" : "") + (s * 1000).toFixed(1) + " ms";
}

// ------------------------------------------------------------------ connection
async function connect() {
  const status = $("#conn-status");
  sessionStorage.setItem(KEY_STORE, $("#api-key").value);
  sessionStorage.setItem(ADMIN_STORE, $("#admin-key").value);
  setStatus(status, "connecting…");
  try {
    const [models, info] = await Promise.all([api("GET", "/v1/models"), api("GET", "/xmix/v1/console/info")]);
    state.model = models.data && models.data.length ? models.data[0].id : null;
    state.info = info;
    $("#model-name").textContent = `${state.model} · ${info.n_layers} layers · xmix ${info.xmix_version}`;
    setStatus(status, "connected");
    await refreshApps();
  } catch (e) {
    setStatus(status, "not connected: " + e.message, true);
  }
}

async function refreshApps() {
  const body = await api("GET", "/xmix/v1/apps");
  state.apps = body.apps;
  renderAppChoices();
  renderApps();
}

// ------------------------------------------------------------------ views
function showView(name) {
  for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t.dataset.view === name);
  for (const v of document.querySelectorAll(".view")) v.hidden = v.id !== "view-" + name;
  if (name === "live") startLive(); else stopLive();
  if (name === "apps" && state.model) refreshApps().catch(e => setStatus($("#apps-status"), e.message, true));
}

// ------------------------------------------------------------------ playground
function renderAppChoices() {
  const list = $("#pg-app-list");
  const before = {};
  for (const box of list.querySelectorAll("input[type=checkbox]")) before[box.dataset.app] = box.checked;
  list.replaceChildren();
  if (!state.apps.length) list.append(el("span", { class: "muted", text: "no app deployed" }));
  for (const a of state.apps) {
    const box = el("input", { type: "checkbox", dataset: { app: a.name }, disabled: a.mode === "off" });
    box.checked = a.mode !== "off" && !!before[a.name];
    const row = el("div", { class: "app-choice", dataset: { app: a.name } },
      el("label", {}, box, " ", el("strong", { text: a.name })),
      el("span", { class: "muted", text: `mode ${a.mode}` + (a.mode === "all" ? " (applies to every request, the vanilla one too)" : a.mode === "off" ? " (switched off)" : "") }));
    for (const [p, def] of Object.entries(a.params || {})) {
      row.append(el("label", { class: "param" }, p + " ",
        el("input", { type: "number", step: "any", placeholder: String(def), dataset: { app: a.name, param: p } })));
    }
    list.append(row);
  }
}

function chosenControls() {
  const apps = [], params = {}, xargs = {};
  for (const box of document.querySelectorAll("#pg-app-list input[type=checkbox]")) {
    if (box.checked) apps.push(box.dataset.app);
  }
  for (const inp of document.querySelectorAll("#pg-app-list input[data-param]")) {
    if (inp.value === "" || !apps.includes(inp.dataset.app)) continue;
    const v = Number(inp.value);
    (params[inp.dataset.app] = params[inp.dataset.app] || {})[inp.dataset.param] = v;
    xargs[`xmix.${inp.dataset.app}.${inp.dataset.param}`] = v;
  }
  if (apps.length) xargs["xmix_apps"] = apps;
  return { apps, params, xargs };
}

function mergeResults(acc, add) {
  for (const [app, reads] of Object.entries(add || {})) {
    if (!reads || typeof reads !== "object") continue;
    const a = acc[app] = acc[app] || {};
    for (const [read, r] of Object.entries(reads)) {
      const dst = a[read] = a[read] || { positions: [], values: [] };
      dst.positions.push(...(r.positions || []));
      dst.values.push(...(r.values || []));
    }
  }
  return acc;
}

function tokenId(s) {
  const m = /^token_id:(\d+)$/.exec(s);
  return m ? Number(m[1]) : null;
}

async function readSSE(resp, onEvent) {
  const reader = resp.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

// One streamed request; fills the column's answer as it streams; returns ids, results, usage.
async function runOne(kind, prompt, xargs, column) {
  const answer = column.querySelector("pre.answer");
  answer.textContent = "";
  const common = {
    model: state.model, stream: true, stream_options: { include_usage: true },
    max_tokens: Number($("#pg-max-tokens").value) || 16,
    temperature: Number($("#pg-temperature").value) || 0,
    seed: Number($("#pg-seed").value) || 0,
    return_tokens_as_token_ids: true,
  };
  if (Object.keys(xargs).length) common.vllm_xargs = xargs;
  let path, body, tokBody;
  if (kind === "chat") {
    const messages = [{ role: "user", content: prompt }];
    path = "/v1/chat/completions";
    body = Object.assign({ messages, logprobs: true, top_logprobs: 0 }, common);
    tokBody = { model: state.model, messages };
  } else {
    path = "/v1/completions";
    body = Object.assign({ prompt, logprobs: 0 }, common);
    tokBody = { model: state.model, prompt };
  }
  const promptIds = (await api("POST", "/tokenize", tokBody)).tokens;
  const resp = await fetch(ROOT + path, {
    method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body),
  });
  if (!resp.ok) throw new Error(await errorText(resp));
  const genIds = [], results = {};
  let usage = null, finish = null;
  await readSSE(resp, ev => {
    if (ev.error) throw new Error(ev.error.message || JSON.stringify(ev.error));
    if (ev.usage) usage = ev.usage;
    if (ev.xmix) mergeResults(results, ev.xmix);
    for (const c of ev.choices || []) {
      if (kind === "chat") {
        if (c.delta && c.delta.content) answer.append(c.delta.content);
        for (const t of (c.logprobs && c.logprobs.content) || []) genIds.push(tokenId(t.token));
      } else {
        if (c.text) answer.append(c.text);
        for (const t of (c.logprobs && c.logprobs.tokens) || []) genIds.push(tokenId(t));
      }
      if (c.finish_reason) finish = c.finish_reason;
    }
  });
  return { promptIds, genIds, results, usage, finish };
}

function scalarOf(v) {
  if (typeof v === "number") return { heat: v, detail: String(v) };
  if (v === null) return { heat: null, detail: "non-finite" };
  if (Array.isArray(v)) {
    const norm = Math.sqrt(v.reduce((s, x) => s + (typeof x === "number" ? x * x : 0), 0));
    return { heat: norm, detail: `|v| = ${fmtNum(norm)} · [${v.slice(0, 8).map(x => fmtNum(x)).join(", ")}${v.length > 8 ? ", …" : ""}] (${v.length} dims)` };
  }
  if (v && Array.isArray(v.acts)) {
    const top = v.acts.length ? Math.max(...v.acts) : 0;
    const feats = (v.ids || []).map((id, i) => `#${id}: ${fmtNum(v.acts[i])}`).slice(0, 8).join(", ");
    return { heat: top, detail: `top features ${feats || "(none active)"}` };
  }
  return { heat: null, detail: JSON.stringify(v) };
}

function colorScale(values) {
  const finite = values.filter(x => typeof x === "number" && isFinite(x));
  const lo = finite.length ? Math.min(...finite) : 0, hi = finite.length ? Math.max(...finite) : 0;
  const diverging = lo < 0 && hi > 0;
  const span = diverging ? Math.max(-lo, hi) : (hi - lo) || 1;
  const color = x => {
    if (typeof x !== "number" || !isFinite(x)) return "";
    const t = diverging ? x / span : (x - lo) / span;
    const a = Math.min(Math.abs(t), 1) * 0.85;
    return t >= 0 ? `rgba(214, 39, 40, ${a.toFixed(3)})` : `rgba(31, 119, 180, ${a.toFixed(3)})`;
  };
  return { lo, hi, diverging, color };
}

function visible(text) {
  return text.replace(/\n/g, "↵\n").replace(/\t/g, "→\t");
}

function tokenSpan(t, text, promptLen) {
  const span = el("span", { class: "tok", dataset: { pos: t }, text: visible(text) });
  if (t === promptLen - 1) span.classList.add("prompt-end");
  return span;
}

function renderRead(app, read, r, texts, promptLen) {
  const byPos = new Map();
  r.positions.forEach((p, i) => byPos.set(p, r.values[i]));
  const scalars = new Map();
  for (const [p, v] of byPos) scalars.set(p, scalarOf(v));
  const scale = colorScale([...scalars.values()].map(s => s.heat));
  const map = el("div", { class: "heatmap", dataset: { app, read } });
  texts.forEach((text, t) => {
    const span = tokenSpan(t, text, promptLen);
    const s = scalars.get(t);
    if (s) {
      const v = byPos.get(t);
      span.dataset.value = typeof v === "number" ? String(v) : JSON.stringify(v);
      span.style.backgroundColor = scale.color(s.heat);
      span.title = `position ${t} · ${JSON.stringify(text)}\nvalue ${s.detail}`;
    } else {
      span.classList.add("noval");
      span.title = `position ${t} · ${JSON.stringify(text)}\nno value (the read did not run here)`;
    }
    map.append(span);
  });
  const legend = `${r.positions.length} values · ${scale.diverging ? "blue < 0 < red" : "white → red"} · min ${fmtNum(scale.lo)} · max ${fmtNum(scale.hi)} · prompt ends at the bar`;
  return el("div", { class: "read" }, el("h3", {}, `${app} · ${read}`), el("div", { class: "legend", text: legend }), map);
}

function renderDecision(app, op, texts, promptLen) {
  const fired = op.fired.filter(x => x === true).length;
  const unknown = op.fired.filter(x => x === null).length;
  const row = el("div", { class: "heatmap", dataset: { app, op: op.name } });
  texts.forEach((text, t) => {
    const span = tokenSpan(t, text, promptLen);
    const f = t < op.fired.length ? op.fired[t] : undefined;
    if (f === true) span.classList.add("fired");
    else if (f === null) span.classList.add("unknown");
    span.dataset.fired = f === undefined ? "" : String(f);
    span.title = `position ${t} · ${f === true ? "fired" : f === false ? "did not fire" : f === null ? "not known from the results" : "not computed (last token)"}`;
    row.append(span);
  });
  const what = `${op.primitive} ${op.kernel} at ${op.site} when ${op.cond}`;
  const summary = `fired on ${fired} of ${op.fired.length} positions` + (unknown ? ` (${unknown} not known from the results)` : "");
  return el("div", { class: "read decision" }, el("h3", {}, `${app} · ${op.op}: `, el("span", { class: "muted", text: what })),
    el("div", { class: "legend", text: summary }), row);
}

async function renderReads(column, out, params) {
  const box = column.querySelector(".reads");
  box.replaceChildren();
  const ids = out.promptIds.concat(out.genIds);
  const promptLen = out.promptIds.length;
  if (out.usage && out.usage.prompt_tokens !== promptLen) {
    box.append(el("p", { class: "status error", text: `the prompt has ${out.usage.prompt_tokens} tokens in the engine but ${promptLen} from /tokenize: positions are not shown` }));
    return;
  }
  if (out.genIds.some(x => x === null)) {
    box.append(el("p", { class: "status error", text: "the server did not return token ids: positions are not shown" }));
    return;
  }
  const apps = Object.keys(out.results);
  if (!apps.length) { box.append(el("p", { class: "muted", text: "no reads" })); return; }
  const texts = (await api("POST", "/xmix/v1/console/tokens", { ids })).texts;
  for (const app of apps) {
    for (const [read, r] of Object.entries(out.results[app])) box.append(renderRead(app, read, r, texts, promptLen));
  }
  for (const app of apps.concat(Object.keys(params).filter(a => !apps.includes(a)))) {
    if (!state.apps.some(a => a.name === app)) continue;
    const d = await api("POST", "/xmix/v1/console/decisions",
      { app, ids, prompt_len: promptLen, results: out.results[app] || {}, params: params[app] || {} });
    for (const op of d.ops) box.append(renderDecision(app, op, texts, promptLen));
  }
  box.append(el("details", {}, el("summary", { text: "results as JSON" }),
    el("pre", { class: "metadata", text: JSON.stringify(out.results, null, 1) })));
}

async function run() {
  const status = $("#pg-status");
  const kind = $("#pg-kind").value, prompt = $("#pg-prompt").value;
  const ctl = chosenControls();
  const van = $("#pg-vanilla"), st = $("#pg-steered");
  st.querySelector(".apps-used").textContent = ctl.apps.length ? "(" + ctl.apps.join(", ") + ")" : "(none chosen)";
  for (const c of [van, st]) c.querySelector(".reads").replaceChildren();
  setStatus(status, "running…");
  $("#pg-run").disabled = true;
  try {
    const [a, b] = await Promise.all([runOne(kind, prompt, {}, van), runOne(kind, prompt, ctl.xargs, st)]);
    await renderReads(van, a, {});
    await renderReads(st, b, ctl.params);
    setStatus(status, `done · vanilla ${a.genIds.length} tokens (${a.finish}) · with apps ${b.genIds.length} tokens (${b.finish})`);
  } catch (e) {
    setStatus(status, e.message, true);
  } finally {
    $("#pg-run").disabled = false;
  }
}

// ------------------------------------------------------------------ apps
function siteGrid(sites) {
  const info = state.info;
  if (!info) return el("span", { text: sites.join(", ") });
  const on = new Set(sites);
  const table = el("table", { class: "site-grid" });
  const head = el("tr", {}, el("th", { text: "layer" }));
  for (const s of info.layer_sites) head.append(el("th", { text: s }));
  table.append(head);
  for (let l = 0; l < info.n_layers; l++) {
    const tr = el("tr", {}, el("th", { text: String(l) }));
    for (const s of info.layer_sites) {
      const name = `layers.${l}.${s}`;
      tr.append(el("td", { class: on.has(name) ? "on" : "", title: name, text: on.has(name) ? "●" : "" }));
    }
    table.append(tr);
  }
  for (const s of info.model_sites) {
    table.append(el("tr", {}, el("th", { text: s }),
      el("td", { colspan: info.layer_sites.length, class: on.has(s) ? "on" : "", text: on.has(s) ? "●" : "" })));
  }
  return table;
}

function renderApps() {
  const list = $("#apps-list");
  list.replaceChildren();
  list.dataset.renders = String(Number(list.dataset.renders || 0) + 1);  // lets tests wait for a re-render
  if (!state.apps.length) list.append(el("p", { class: "muted", text: "no app deployed" }));
  for (const a of state.apps) {
    const mode = el("select", { dataset: { app: a.name }, class: "mode-select" });
    for (const m of ["off", "request", "all"]) mode.append(el("option", { value: m, text: m }));
    mode.value = a.mode;
    mode.addEventListener("change", () => patchApp(a.name, { mode: mode.value }));
    const params = el("div", { class: "params" });
    for (const [p, def] of Object.entries(a.params || {})) {
      params.append(el("label", {}, p + " ", el("input", { type: "number", step: "any", value: String(def), dataset: { app: a.name, param: p } })));
    }
    const save = el("button", { type: "button", class: "save-params", dataset: { app: a.name }, text: "Save parameters" });
    save.addEventListener("click", () => {
      const vals = {};
      for (const inp of params.querySelectorAll("input[data-param]")) vals[inp.dataset.param] = Number(inp.value);
      patchApp(a.name, { params: vals });
    });
    const undeploy = el("button", { type: "button", class: "undeploy", dataset: { app: a.name }, text: "Undeploy" });
    undeploy.addEventListener("click", () => undeployApp(a.name));
    list.append(el("div", { class: "app-card", dataset: { app: a.name } },
      el("h3", {}, a.name, " ", el("span", { class: "muted", text: `version ${a.version}` })),
      el("div", { class: "row" },
        el("div", {}, el("label", {}, "mode ", mode),
          el("div", { text: `reads: ${a.reads.length ? a.reads.join(", ") : "none"}` }),
          el("div", { text: `writes: ${a.writes ? "yes" : "no"} · per-request state: ${a.stateful ? "yes" : "no"}` }),
          params, Object.keys(a.params || {}).length ? save : null, el("div", {}, undeploy)),
        siteGrid(a.sites),
        el("pre", { class: "metadata", text: "metadata " + JSON.stringify(a.metadata, null, 1) }))));
  }
}

// Each change re-reads the app list before it reports, so what the page says has happened
// is what the page shows.
async function change(what, call) {
  const status = $("#apps-status");
  setStatus(status, "working…");
  let msg, failed = false;
  try {
    msg = await call();
  } catch (e) {
    msg = `${what}: ${e.message}`;
    failed = true;
  }
  await refreshApps().catch(() => {});
  setStatus(status, msg, failed);
}

function patchApp(name, body) {
  return change(name, async () => {
    await api("PATCH", "/xmix/v1/apps/" + encodeURIComponent(name), body, undefined, true);
    return `${name}: ${Object.keys(body).join(" and ")} changed`;
  });
}

function undeployApp(name) {
  return change(name, async () => {
    await api("DELETE", "/xmix/v1/apps/" + encodeURIComponent(name), undefined, undefined, true);
    return `${name}: undeployed`;
  });
}

async function deployApp() {
  const file = $("#deploy-file").files[0];
  if (!file) { setStatus($("#apps-status"), "choose an app file first", true); return; }
  return change("deploy failed", async () => {
    const buf = await file.arrayBuffer();
    const info = await api("POST", "/xmix/v1/apps?mode=" + encodeURIComponent($("#deploy-mode").value), buf,
      { "Content-Type": "application/octet-stream" }, true);
    return `${info.name}: deployed (mode ${info.mode})`;
  });
}

// ------------------------------------------------------------------ live
async function refreshLive() {
  const status = $("#live-status");
  try {
    const snap = await api("GET", "/xmix/v1/console/live");
    const body = $("#live-table tbody");
    body.replaceChildren();
    for (const a of snap.apps) {
      const gates = el("td", { class: "gates" });
      for (const g of a.gates) {
        gates.append(el("div", { dataset: { gate: g.gate }, text: `${g.gate}: ${fmtNum(g.fired)} / ${fmtNum(g.tokens)}` + (g.rate === null ? "" : ` = ${(100 * g.rate).toFixed(1)} %`) }));
      }
      if (!a.gates.length) gates.append(el("span", { class: "muted", text: "no gate fired or evaluated yet" }));
      const mons = el("td", { class: "monitors" });
      for (const m of a.monitors || []) {
        const what = m.action === "stopped" ? "stopped" : "switched";
        mons.append(el("div", { dataset: { action: m.action, read: m.read }, text: `${what} by ${m.read || "tokens"}: ${fmtNum(m.requests)}` }));
      }
      if (!(a.monitors || []).length) mons.append(el("span", { class: "muted", text: "none" }));
      body.append(el("tr", { dataset: { app: a.name } },
        el("td", { text: a.name }), el("td", { text: a.mode }),
        el("td", { class: "admitted", text: fmtNum(a.requests_admitted) }),
        el("td", { class: "finished", text: fmtNum(a.requests_finished) }),
        el("td", { text: fmtMs(a.ttft_mean_s) }), el("td", { text: fmtAdded(a.ttft_added_s) }),
        el("td", { text: fmtMs(a.tpot_mean_s) }), el("td", { text: fmtAdded(a.tpot_added_s) }),
        gates, mons));
    }
    const b = snap.no_app;
    $("#live-baseline").textContent = `Requests that used no app: ${fmtNum(b.requests_finished)} finished · mean TTFT ${fmtMs(b.ttft_mean_s)} · mean time / token ${fmtMs(b.tpot_mean_s)}`;
    setStatus(status, "updated " + new Date().toLocaleTimeString());
  } catch (e) {
    setStatus(status, e.message, true);
  }
}

function startLive() {
  stopLive();
  refreshLive();
  state.liveTimer = setInterval(() => { if (document.visibilityState === "visible") refreshLive(); }, 2000);
}

function stopLive() {
  if (state.liveTimer !== null) clearInterval(state.liveTimer);
  state.liveTimer = null;
}

// ------------------------------------------------------------------ start
document.addEventListener("DOMContentLoaded", () => {
  for (const t of document.querySelectorAll(".tab")) t.addEventListener("click", () => showView(t.dataset.view));
  $("#api-key").value = sessionStorage.getItem(KEY_STORE) || "";
  $("#admin-key").value = sessionStorage.getItem(ADMIN_STORE) || "";
  $("#key-connect").addEventListener("click", connect);
  $("#api-key").addEventListener("keydown", e => { if (e.key === "Enter") connect(); });
  $("#pg-run").addEventListener("click", run);
  $("#deploy-button").addEventListener("click", deployApp);
  $("#apps-refresh").addEventListener("click", () => refreshApps().catch(e => setStatus($("#apps-status"), e.message, true)));
  connect();
});
