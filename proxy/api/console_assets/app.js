// The operator console: reads GET /admin/backends, /admin/overview and /admin/shadow with the
// admin token the operator types, every few seconds and on "Refresh", and shows what they return
// as they return it (credits as the API's decimal strings, shadow credits, integer
// micro-credits, written out exactly; other numbers as JSON has them). Its one action, "Reload
// policies", POSTs /admin/reload. No library and no request to anywhere but this gateway; every
// value reaches the page as text (textContent), never as markup.
"use strict";

const STORE = "inference-gateway.admin-token"; // sessionStorage: this tab only, gone when it closes
const REFRESH_MS = 5000;
const FLEET = [
  ["name", "Backend"], ["kind", "Kind"], ["family", "Family"], ["state", "State"],
  ["healthy", "Healthy"], ["ejected_until", "Ejected until (UTC)"],
  ["waiting", "Engine waiting", "number"], ["running", "Engine running", "number"],
  ["kv_cache_usage", "KV cache usage", "number"], ["slots", "Slots in use / max", "number"],
  ["outstanding", "Outstanding", "number"], ["restarts", "Restarts", "number"],
];

const $ = (id) => document.getElementById(id);
let token = null;
let loading = null; // the AbortController of the reads in flight: a sign-out cancels them
let timer = null;

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// ---- the admin API ---------------------------------------------------------------------------

async function api(path, signal, method = "GET") {
  let response;
  try {
    response = await fetch(path, {
      method, headers: { Authorization: `Bearer ${token}`, Accept: "application/json" },
      cache: "no-store", credentials: "omit", signal,
    });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, "The gateway could not be reached: check the connection and try again.");
  }
  let body = null;
  try {
    body = await response.json();
  } catch {
    // not JSON (a proxy's error page, say): the status alone describes it
  }
  if (!response.ok) throw new ApiError(response.status, explain(response, body));
  return body;
}

function explain(response, body) {
  const detail = reasonOf(body);
  const wait = response.headers.get("Retry-After");
  const later = wait ? ` Try again in ${wait} s.` : " Try again shortly.";
  switch (response.status) {
    case 401:
      return `The gateway refused this token (401 unauthorized: ${detail}). Type the ` +
        "GATEWAY_ADMIN_TOKEN the gateway was started with, or an admin-role JWT.";
    case 503:
      return `The gateway cannot answer right now (503: ${detail}).${later}`;
    default:
      return `The gateway answered ${response.status} (${detail}).`;
  }
}

function reasonOf(body) {
  if (body && body.error && typeof body.error.message === "string") return body.error.message;
  if (body && typeof body.detail === "string") return body.detail;
  return "no details given";
}

// ---- signing in and out ----------------------------------------------------------------------

function signIn(event) {
  event.preventDefault();
  const input = $("token");
  const typed = input.value.trim();
  input.value = "";
  if (!/^[\x21-\x7e]+$/.test(typed)) { // a header carries printable ASCII only
    say("That is not a token: a token is printable ASCII without spaces.", "error");
    return;
  }
  token = typed;
  sessionStorage.setItem(STORE, token);
  showSignedIn();
  load();
}

function signOut(text = "Signed out: this page no longer holds the token.", kind = "info") {
  if (loading) loading.abort();
  loading = null;
  token = null;
  sessionStorage.removeItem(STORE);
  clearInterval(timer);
  timer = null;
  clearData();
  showForm();
  say(text, kind);
}

function showForm() {
  $("console").hidden = true;
  $("actions").hidden = true;
  $("updated").hidden = true;
  $("token-form").hidden = false;
  $("token").focus();
}

function showSignedIn() {
  $("token-form").hidden = true;
  $("actions").hidden = false;
  say(null);
  clearInterval(timer);
  // Every few seconds while the tab is shown; never a second read while one is running.
  timer = setInterval(() => {
    if (!document.hidden && !loading) load();
  }, REFRESH_MS);
}

function say(text, kind = "error", id = "message") {
  const message = $(id);
  message.hidden = !text;
  message.textContent = text || "";
  message.className = `message ${kind}`;
}

// ---- loading ---------------------------------------------------------------------------------

async function load() {
  if (!token) return;
  if (loading) loading.abort();
  const mine = new AbortController();
  loading = mine;
  $("refresh").disabled = true;
  const reads = await Promise.allSettled([
    api("/admin/backends", mine.signal),
    api("/admin/overview", mine.signal),
    api("/admin/shadow", mine.signal),
  ]);
  if (loading !== mine) return; // signed out, or a newer load took over
  loading = null;
  $("refresh").disabled = false;
  const refused = reads.find((read) => read.status === "rejected" && read.reason.status === 401);
  if (refused) {
    signOut(refused.reason.message, "error");
    return;
  }
  const [fleet, overview, shadow] = reads;
  const problems = [];
  if (fleet.status === "fulfilled") renderFleet(fleet.value);
  else problems.push(`The fleet: ${fleet.reason.message}`);
  if (overview.status === "fulfilled") renderOverview(overview.value);
  else problems.push(`Accounts and errors: ${overview.reason.message}`);
  if (shadow.status === "fulfilled") renderShadow(shadow.value);
  else if (shadow.reason.status === 404) renderShadowUnavailable();
  else problems.push(`Tiers: ${shadow.reason.message}`);
  say(problems.join(" "), "error");
  const updated = $("updated");
  updated.textContent = `Updated ${new Date().toISOString().slice(11, 19)} UTC; refreshed ` +
    `every ${REFRESH_MS / 1000} s`;
  updated.hidden = false;
  $("console").hidden = false;
}

async function reload() {
  const button = $("reload");
  button.disabled = true;
  say(null, "info", "reload-result");
  try {
    const answer = await api("/admin/reload", undefined, "POST");
    say(`Policies reloaded: version ${answer.version}.`, "info", "reload-result");
    load();
  } catch (err) {
    if (err.status === 401) signOut(err.message, "error");
    else say(`Not reloaded; the policies in force stay. ${err.message}`, "error", "reload-result");
  } finally {
    button.disabled = false;
  }
}

// ---- rendering -------------------------------------------------------------------------------

function renderFleet(body) {
  $("fleet-note").textContent = `As worker ${body.worker_pid} sees them: health and load are ` +
    "each worker's own; slots in use are the fleet's.";
  fill($("backends"), FLEET, body.data.map((backend) => ({
    key: backend.name, cells: fleetCells(backend),
    bad: backend.healthy ? [] : ["state", "healthy"],
  })), "No backend is configured.");
  const queued = [];
  for (const [pool, tiers] of Object.entries(body.queues)) {
    for (const [tier, waiting] of Object.entries(tiers)) {
      queued.push({ key: `${pool}/${tier}`, cells: { pool, tier, waiting: shown(waiting) } });
    }
  }
  fill($("queues"), [["pool", "Pool"], ["tier", "Tier"], ["waiting", "Waiting", "number"]],
    queued, "No request is waiting in this worker's queue.");
}

function fleetCells(backend) {
  const engine = backend.engine || {};
  return {
    name: backend.name, kind: shown(backend.kind), family: shown(backend.family),
    state: shown(backend.state), healthy: backend.healthy ? "yes" : "no",
    ejected_until: backend.ejected_until === null ? "—" : utc(backend.ejected_until),
    waiting: shown(engine.waiting), running: shown(engine.running),
    kv_cache_usage: shown(engine.kv_cache_usage),
    slots: `${shown(backend.slots.in_use)} / ${shown(backend.slots.max)}`,
    outstanding: shown(backend.outstanding), restarts: shown(backend.restarts),
  };
}

function renderOverview(body) {
  fill($("top-spend"), [["account", "Account"], ["credits", "Credits", "number"]],
    body.top_spend.map((row) => ({
      key: row.account, cells: { account: row.account, credits: row.credits },
    })), "No account has spent anything in 24 h.");
  fill($("top-refused"), [["account", "Account"], ["refusals", "Refusals", "number"]],
    body.top_refused.map((row) => ({
      key: row.account, cells: { account: row.account, refusals: shown(row.refusals) },
    })), "No account was refused in 24 h.");
  fill($("errors-by-type"),
    [["type", "Error type"], ["status", "Status", "number"], ["count", "Answers", "number"]],
    Object.entries(body.errors.by_type).map(([type, seen]) => ({
      key: type, cells: { type, status: shown(seen.status), count: shown(seen.count) },
    })), "No error in the last hour.");
  fill($("recent-errors"), [["time", "Time (UTC)"], ["status", "Status"], ["type", "Error type"],
    ["route", "Route"], ["model", "Model"], ["request_id", "Request id"]],
  body.errors.recent.map((error, i) => ({
    key: String(i), cells: {
      time: utc(error.ts), status: shown(error.status), type: shown(error.type),
      route: shown(error.route), model: shown(error.model), request_id: shown(error.request_id),
    },
  })), "No error yet.");
}

function renderShadow(body) {
  const loaded = body.loaded;
  $("shadow-note").textContent = loaded
    ? `Shadow policies from policies/shadow/ (${body.files.join(", ")}; fingerprint ` +
      `${body.fingerprint}), judging since ${utc(body.since)} UTC; never enforced. ` +
      "Highlighted: what they set differently."
    : "No shadow policies loaded: the live tiers alone.";
  const summary = body.summary;
  definitions($("shadow-summary"), [["version", "Policy version", shown(body.version)],
    ...(loaded ? [["requests", "Requests judged", shown(summary.requests)],
      ["disagreements", "Disagreements", shown(summary.disagreements)]] : [])]);
  // A setting per row, a tier per column (lowest priority first; keyed "tier:<name>", so no
  // tier's name can be taken for another column or a class); where the shadow sets one
  // differently, its cell says "live → shadow", marked.
  const priority = (tier) => (tier.live || tier.shadow).priority;
  const ordered = [...body.tiers].sort((a, b) => priority(a) - priority(b) ||
    (a.name < b.name ? -1 : 1));
  const columns = [["field", "Setting"], ...ordered.map((tier) => [`tier:${tier.name}`, tier.name, "value"])];
  const fields = [...new Set(ordered.flatMap((tier) => [...Object.keys(tier.live || {}),
    ...Object.keys(tier.shadow || {})]))];
  const rows = fields.map((field) => {
    const marked = ordered.filter((tier) => tier.differs.includes(field))
      .map((tier) => `tier:${tier.name}`);
    const cells = { field };
    for (const tier of ordered) {
      const live = setting(tier.live, field);
      const key = `tier:${tier.name}`;
      cells[key] = marked.includes(key) ? `${live} → ${setting(tier.shadow, field)}` : live;
    }
    return { key: field, differs: marked.length > 0, marked, cells };
  });
  fill($("tiers"), columns, rows, "No tier is defined.");
  $("shadow-judged").hidden = !loaded;
  const tiers = Object.entries(summary.by_tier);
  fill($("shadow-tiers"), [["tier", "Tier"], ["requests", "Judged", "number"],
    ["disagreements", "Disagreements", "number"],
    ["live_credits", "Live credits", "number"], ["shadow_credits", "Shadow credits", "number"]],
  tiers.map(([tier, seen]) => ({
    key: tier, cells: { tier, requests: shown(seen.requests),
      disagreements: shown(seen.disagreements), live_credits: microCredits(seen.live_micro_credits),
      shadow_credits: microCredits(seen.shadow_micro_credits) },
  })), "Nothing judged yet.");
  const decisions = tiers.flatMap(([tier, seen]) => seen.decisions.map((d, i) => ({
    key: `${tier}/${i}`, differs: d.live !== d.shadow,
    cells: { tier, live: shown(d.live), shadow: shown(d.shadow),
      reason: shown(d.reason), count: shown(d.count) },
  })));
  fill($("decisions"), [["tier", "Tier"], ["live", "Live decided"], ["shadow", "Shadow decided"],
    ["reason", "Why"], ["count", "Requests", "number"]], decisions, "Nothing judged yet.");
}

function renderShadowUnavailable() {
  $("shadow-note").textContent = "Shadow view unavailable: this gateway has no /admin/shadow.";
  for (const id of ["shadow-summary", "tiers", "shadow-tiers", "decisions"]) clear($(id));
  $("shadow-judged").hidden = true;
}

function clearData() {
  for (const id of ["backends", "queues", "shadow-summary", "tiers", "shadow-tiers", "decisions",
    "top-spend", "top-refused", "errors-by-type", "recent-errors"]) clear($(id));
  for (const id of ["fleet-note", "shadow-note", "updated"]) $(id).textContent = "";
  say(null, "info", "reload-result");
}

// A tier's setting as TOML would say it: scalars as they are, lists and tables as JSON.
function setting(fields, name) {
  if (!fields || !(name in fields)) return "—";
  const value = fields[name];
  return value !== null && typeof value === "object" ? JSON.stringify(value) : shown(value);
}

// ---- building blocks -------------------------------------------------------------------------

function clear(node) {
  node.replaceChildren();
}

function shown(value) {
  return value === null || value === undefined ? "—" : String(value);
}

function utc(seconds) {
  if (typeof seconds !== "number") return shown(seconds);
  return new Date(seconds * 1000).toISOString().replace("T", " ").slice(0, 19);
}

// An integer of micro-credits as the API writes credits (6 places), with no float in between.
function microCredits(micro) {
  if (typeof micro !== "number" || !Number.isSafeInteger(micro)) return shown(micro);
  const digits = String(Math.abs(micro)).padStart(7, "0");
  return `${micro < 0 ? "-" : ""}${digits.slice(0, -6)}.${digits.slice(-6)}`;
}

function element(tag, attributes = {}, text) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function definitions(list, rows) {
  clear(list);
  for (const [name, label, text] of rows) {
    const pair = element("div");
    pair.append(element("dt", {}, label), element("dd", { "data-key": name }, text));
    list.append(pair);
  }
}

// A table: columns [field, label, class?]; rows {key, cells: {field: text}, differs?, bad?}.
function fill(table, columns, rows, empty) {
  clear(table);
  const head = element("thead");
  const labels = element("tr");
  for (const [, label, kind] of columns) {
    labels.append(element("th", { scope: "col", class: kind || "" }, label));
  }
  head.append(labels);
  const body = element("tbody");
  for (const row of rows) {
    const line = element("tr", { "data-key": row.key });
    if (row.differs) line.className = "differs";
    for (const [field, , kind] of columns) {
      const classes = [field, kind, row.bad && row.bad.includes(field) ? "bad" : null,
        row.marked && row.marked.includes(field) ? "differs" : null];
      line.append(element("td", { "data-field": field, class: classes.filter(Boolean).join(" ") },
        row.cells[field]));
    }
    body.append(line);
  }
  if (!rows.length) {
    const none = element("tr", { class: "none" });
    none.append(element("td", { colspan: String(columns.length), class: "empty" }, empty));
    body.append(none);
  }
  table.append(head, body);
}

// ---- start -----------------------------------------------------------------------------------

$("token-form").addEventListener("submit", signIn);
$("sign-out").addEventListener("click", () => signOut());
$("refresh").addEventListener("click", load);
$("reload").addEventListener("click", reload);
token = sessionStorage.getItem(STORE);
if (token) {
  showSignedIn();
  load();
} else {
  showForm();
}
