// The usage dashboard: reads GET /v2/account and GET /v2/account/usage with the key the account
// holder types, and shows what they return as they return it (credits are the API's decimal
// strings, never re-rounded; journal amounts are integer micro-credits, written out exactly).
// Numbers are parsed only to size bars. No library and no request to anywhere but this gateway;
// every value reaches the page as text (textContent), never as markup.
"use strict";

const STORE = "inference-gateway.key"; // sessionStorage: this tab only, gone when it closes
const SVG_NS = "http://www.w3.org/2000/svg"; // a namespace name, not a request
const DAYS_CHARTED = 60;
const PAGE_SIZE = 50;
const COLUMNS = [
  ["requests", "Requests"], ["prompt_tokens", "Prompt tokens"],
  ["completion_tokens", "Completion tokens"], ["characters", "Characters"],
  ["audio_seconds", "Audio seconds"], ["images", "Images"],
  ["video_seconds", "Video seconds"], ["cost", "Credits"],
];

const $ = (id) => document.getElementById(id);
let key = null;
let loading = null; // the AbortController of the requests in flight: a sign-out cancels them
let nextBefore = null;

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// ---- the account API -------------------------------------------------------------------------

async function api(path, signal) {
  let response;
  try {
    response = await fetch(path, {
      headers: { Authorization: `Bearer ${key}`, Accept: "application/json" },
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
      return `This key was not accepted (${detail}). Check that it was pasted whole and has ` +
        "not been revoked.";
    case 429:
      return `Too many requests with this key for its tier (${detail}).${later}`;
    case 503:
      return `The gateway cannot answer right now (${detail}).${later}`;
    default:
      return `The gateway answered ${response.status} (${detail}).`;
  }
}

function reasonOf(body) {
  if (body && typeof body.detail === "string") return body.detail;
  if (body && body.error && typeof body.error.message === "string") return body.error.message;
  return "no details given";
}

// ---- signing in and out ----------------------------------------------------------------------

function signIn(event) {
  event.preventDefault();
  const input = $("key");
  const typed = input.value.trim();
  input.value = "";
  if (!/^[\x21-\x7e]+$/.test(typed)) { // a header carries printable ASCII only
    say("That is not a key: a key or token is printable ASCII without spaces.", "error");
    return;
  }
  key = typed;
  sessionStorage.setItem(STORE, key);
  showSignedIn();
  load();
}

function signOut() {
  if (loading) loading.abort();
  loading = null;
  forget();
  clearData();
  showForm();
  say("Signed out: this page no longer holds the key.", "info");
}

function forget() {
  key = null;
  nextBefore = null;
  sessionStorage.removeItem(STORE);
}

function showForm() {
  $("dashboard").hidden = true;
  $("actions").hidden = true;
  $("who").hidden = true;
  $("key-form").hidden = false;
  $("key").focus();
}

function showSignedIn() {
  $("key-form").hidden = true;
  $("actions").hidden = false;
  say(null);
}

function say(text, kind = "error") {
  const message = $("message");
  message.hidden = !text;
  message.textContent = text || "";
  message.className = `message ${kind}`;
}

function busy(on) {
  for (const id of ["refresh", "older"]) $(id).disabled = on;
  $("dashboard").setAttribute("aria-busy", String(on));
}

// ---- loading ---------------------------------------------------------------------------------

async function load() {
  if (loading) loading.abort();
  const mine = new AbortController();
  loading = mine;
  busy(true);
  try {
    const [account, usage] = await Promise.all([
      api("/v2/account", mine.signal),
      api(`/v2/account/usage?limit=${PAGE_SIZE}`, mine.signal),
    ]);
    if (loading !== mine) return;
    render(account, usage);
    say(null);
  } catch (err) {
    if (loading !== mine || err.name === "AbortError") return;
    mine.abort(); // the other request's answer is no longer wanted
    if (err.status === 401) {
      forget();
      clearData();
      showForm();
    }
    say(err.message, "error");
  } finally {
    if (loading === mine) {
      loading = null;
      busy(false);
    }
  }
}

async function loadOlder() {
  if (!nextBefore || loading) return;
  const mine = new AbortController();
  loading = mine;
  busy(true);
  try {
    const query = `limit=${PAGE_SIZE}&before=${encodeURIComponent(nextBefore)}`;
    const usage = await api(`/v2/account/usage?${query}`, mine.signal);
    if (loading !== mine) return;
    journalRows($("journal").tBodies[0], usage.entries);
    setNextBefore(usage.next_before);
  } catch (err) {
    if (loading !== mine || err.name === "AbortError") return;
    say(err.message, "error");
  } finally {
    if (loading === mine) {
      loading = null;
      busy(false);
    }
  }
}

// ---- rendering -------------------------------------------------------------------------------

function render(account, usage) {
  const who = $("who");
  who.textContent = `Account ${account.account} · tier ${account.tier}` +
    (account.key_id ? ` · key ${account.key_id}` : "");
  who.hidden = false;
  const b = account.balance;
  const rate = account.rate_limit;
  definitions($("balance"), [
    ["available", "Available", b.available.credits],
    ["held", "Held by requests running", b.held.credits],
    ["spent", "Spent", b.spent.credits],
    ["credited", "Credited", b.credited.credits],
    ["rate-remaining", `Requests left this ${rate.per}`, shown(rate.remaining)],
    ["rate-limit", `Rate limit per ${rate.per}`, shown(rate.limit)],
    ["rate-reset", "Seconds until a slot frees", shown(rate.reset_s)],
    ["price-version", "Price list", shown(account.price_version)],
  ]);
  definitions($("limits"), limitRows(account));
  definitions($("totals"), COLUMNS.map(([field, label]) => [field, label,
    fieldText(usage.totals, field)]));

  const models = Object.entries(usage.by_model);
  barChart($("chart-models"), models.map(([model, view]) => ({
    label: model, value: view.cost.micro_credits, text: view.cost.credits,
    title: `${model}: ${view.cost.credits} credits, ${view.requests} requests`,
  })));
  const days = chartedDays(usage.by_day);
  columnChart($("chart-day-credits"), days.map(([day, view]) => ({
    label: day, value: view ? view.cost.micro_credits : 0, text: view ? view.cost.credits : "0",
    title: `${day}: ${view ? view.cost.credits : "no"} credits`,
  })));
  columnChart($("chart-day-requests"), days.map(([day, view]) => ({
    label: day, value: view ? view.requests : 0, text: view ? shown(view.requests) : "0",
    title: `${day}: ${view ? view.requests : "no"} requests`,
  })));

  usageTable($("by-model"), "Model", models, usage.totals);
  usageTable($("by-day"), "Day", Object.entries(usage.by_day).reverse(), usage.totals);
  const journal = $("journal");
  clear(journal);
  journal.append(head(["Time (UTC)", "Type", "Model", "Route or reason", "Status", "Prompt tokens",
    "Completion tokens", "Credits"]));
  journal.append(document.createElement("tbody"));
  journalRows(journal.tBodies[0], usage.entries);
  setNextBefore(usage.next_before);
  $("dashboard").hidden = false;
}

// The tier's token windows and the budgets (the account's, the key's), as /v2/account has them.
function limitRows(account) {
  const rows = [];
  for (const w of account.token_limits) {
    const what = w.kind.replace("_", " ").replace(/^tokens$/, "chat tokens");
    const where = w.group === null ? "" : ` (${w.group} models)`;
    rows.push([`${w.kind}-${w.period}${w.group === null ? "" : "-" + w.group}`,
      `${what[0].toUpperCase()}${what.slice(1)} left this ${w.period}${where}`,
      `${w.remaining} of ${w.limit}`]);
  }
  for (const b of account.budgets) {
    const whose = b.scope === "key" ? `Key ${b.key_id}` : "Account";
    rows.push([`budget-${b.scope}-${b.period}`, `${whose} budget per ${b.period}`,
      `${b.remaining.credits} of ${b.limit.credits} left (spent ${b.spent.credits}, ` +
      `held ${b.held.credits}); resets ${b.resets_at}`]);
  }
  if (account.postpaid) rows.push(["postpaid", "Billing", "postpaid: budgets only"]);
  if (!rows.length) rows.push(["none", "Limits", "requests per minute only"]);
  return rows;
}

function setNextBefore(value) {
  nextBefore = value;
  $("older").hidden = !value;
}

function clearData() {
  for (const id of ["balance", "limits", "totals", "chart-models", "chart-day-credits",
    "chart-day-requests", "by-model", "by-day", "journal"]) clear($(id));
  $("who").textContent = "";
  $("older").hidden = true;
}

function clear(node) {
  node.replaceChildren();
}

function shown(value) {
  return value === null || value === undefined ? "—" : String(value);
}

function fieldText(view, field) {
  return field === "cost" ? view.cost.credits : shown(view[field]);
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

function head(labels) {
  const thead = element("thead");
  const row = element("tr");
  for (const label of labels) row.append(element("th", { scope: "col" }, label));
  thead.append(row);
  return thead;
}

function usageTable(table, first, rows, totals) {
  clear(table);
  table.append(head([first, ...COLUMNS.map(([, label]) => label)]));
  const body = element("tbody");
  for (const [name, view] of rows) body.append(usageRow(name, view, "td"));
  if (!rows.length) {
    const empty = element("tr");
    empty.append(element("td", { colspan: String(COLUMNS.length + 1) }, "No usage yet."));
    body.append(empty);
  }
  const foot = element("tfoot");
  foot.append(usageRow("Total", totals, "td"));
  table.append(body, foot);
}

function usageRow(name, view, cell) {
  const row = element("tr", { "data-key": name });
  row.append(element("th", { scope: "row" }, name));
  for (const [field] of COLUMNS) {
    row.append(element(cell, { "data-field": field }, fieldText(view, field)));
  }
  return row;
}

function journalRows(body, entries) {
  for (const entry of entries) {
    const row = element("tr", { "data-id": entry.id });
    const amount = entry.type === "credit" ? entry.amount : entry.cost;
    const cells = [
      ["time", entryTime(entry)], ["type", shown(entry.type)], ["model", shown(entry.model)],
      ["route", shown(entry.route ?? entry.reason)], ["status", shown(entry.status)],
      ["prompt_tokens", shown(entry.prompt_tokens)],
      ["completion_tokens", shown(entry.completion_tokens)], ["cost", microCredits(amount)],
    ];
    for (const [field, text] of cells) row.append(element("td", { "data-field": field }, text));
    body.append(row);
  }
}

// When it was journaled: its id starts with the milliseconds Redis stamped it with.
function entryTime(entry) {
  const ms = Number(String(entry.id).split("-")[0]);
  if (!Number.isFinite(ms)) return "—";
  return new Date(ms).toISOString().replace("T", " ").slice(0, 19);
}

// ---- charts: inline SVG ----------------------------------------------------------------------

function svg(tag, attributes = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

function shorten(text, most) {
  return text.length <= most ? text : `${text.slice(0, most - 1)}…`;
}

// One horizontal bar per item, its exact value written beside it.
function barChart(chart, bars) {
  clear(chart);
  const width = 720;
  const row = 28;
  const labelWidth = 220;
  const plotWidth = width - labelWidth - 130;
  const height = Math.max(1, bars.length) * row + 8;
  chart.setAttribute("viewBox", `0 0 ${width} ${height}`);
  if (!bars.length) {
    chart.append(svg("text", { x: 8, y: 22, class: "empty" }, "No usage yet."));
    return;
  }
  const most = Math.max(...bars.map((bar) => bar.value));
  bars.forEach((bar, i) => {
    const y = 4 + i * row;
    const length = most > 0 ? Math.max(bar.value > 0 ? 1 : 0, (bar.value / most) * plotWidth) : 0;
    const group = svg("g", { "data-label": bar.label });
    group.append(
      svg("title", {}, bar.title),
      svg("text", { x: labelWidth - 8, y: y + row / 2, class: "label", "text-anchor": "end",
        "dominant-baseline": "middle" }, shorten(bar.label, 30)),
      svg("rect", { x: labelWidth, y: y + 4, width: length.toFixed(2), height: row - 8,
        rx: 2, class: "bar", "data-label": bar.label }),
      svg("text", { x: labelWidth + length + 6, y: y + row / 2, class: "value",
        "dominant-baseline": "middle" }, bar.text),
    );
    chart.append(group);
  });
}

// One column per day; the tallest column's value marks the scale.
function columnChart(chart, columns) {
  clear(chart);
  const width = 400;
  const height = 170;
  const left = 8;
  const top = 24;
  const bottom = 28;
  chart.setAttribute("viewBox", `0 0 ${width} ${height}`);
  if (!columns.length) {
    chart.append(svg("text", { x: left, y: 22, class: "empty" }, "No usage yet."));
    return;
  }
  const plotHeight = height - top - bottom;
  const slot = (width - 2 * left) / columns.length;
  const tallest = columns.reduce((a, b) => (b.value > a.value ? b : a));
  const baseline = top + plotHeight;
  chart.append(
    svg("line", { x1: left, x2: width - left, y1: baseline, y2: baseline, class: "axis" }),
    svg("text", { x: left, y: 14, class: "scale" }, `highest: ${tallest.text} (${tallest.label})`),
  );
  const every = Math.ceil(columns.length / 6);
  const barWidth = Math.max(1, Math.min(slot * 0.7, 40));
  columns.forEach((column, i) => {
    const size = tallest.value > 0
      ? Math.max(column.value > 0 ? 1 : 0, (column.value / tallest.value) * plotHeight) : 0;
    const x = left + i * slot + (slot - barWidth) / 2;
    const group = svg("g", { "data-day": column.label });
    group.append(
      svg("title", {}, column.title),
      svg("rect", { x: x.toFixed(2), y: (baseline - size).toFixed(2),
        width: barWidth.toFixed(2), height: size.toFixed(2), class: "bar",
        "data-day": column.label }),
    );
    const last = columns.length - 1;
    // The first and last days always, some between; the ends' labels kept inside the chart.
    if (i === 0 || i === last || (i % every === 0 && last - i > every / 2)) {
      const [anchor, at] = i === 0 ? ["start", 0] : i === last ? ["end", 1] : ["middle", 0.5];
      group.append(svg("text", { x: (x + barWidth * at).toFixed(2), y: height - 8, class: "tick",
        "text-anchor": anchor }, column.label.slice(5)));
    }
    chart.append(group);
  });
}

// The days from the first with usage (at most DAYS_CHARTED back) to today or the last one, UTC;
// a day without usage is charted as zero.
function chartedDays(byDay) {
  const known = Object.keys(byDay).sort();
  if (!known.length) return [];
  const dayMs = 86400000;
  const parse = (day) => Date.parse(`${day}T00:00:00Z`);
  const today = Math.floor(Date.now() / dayMs) * dayMs;
  const end = Math.max(parse(known[known.length - 1]), today);
  const start = Math.max(parse(known[0]), end - (DAYS_CHARTED - 1) * dayMs);
  const days = [];
  for (let ms = start; ms <= end; ms += dayMs) {
    const day = new Date(ms).toISOString().slice(0, 10);
    days.push([day, byDay[day] || null]);
  }
  return days;
}

// ---- start -----------------------------------------------------------------------------------

$("key-form").addEventListener("submit", signIn);
$("sign-out").addEventListener("click", signOut);
$("refresh").addEventListener("click", load);
$("older").addEventListener("click", loadOlder);
key = sessionStorage.getItem(STORE);
if (key) {
  showSignedIn();
  load();
} else {
  showForm();
}
