// /dashboard: live plots from the server's /metrics (Prometheus text, parsed here).
//
// Every POLL_MS the page scrapes /metrics (with the API key, as the chat page sends it) and turns
// counters into rates between two scrapes: decode speed is completion tokens over decode seconds,
// the accept length is the histogram's sum over its count, both over the interval. History lives in
// memory for the last SPAN_S seconds; a reload starts it anew (the counters since the server
// started are in the tiles and the histogram). A counter that grows (OOM, cache cleared, worker
// restarts, cancelled generations) is listed as an event at the scrape that saw it grow.

import { apiFetch, errorText } from "./api.js";
import { barChart, lineChart } from "./charts.js";

const POLL_MS = 2000;
const SPAN_S = 300;
const $ = (id) => document.getElementById(id);

// Prometheus text exposition -> [{name, labels, value}] (comments and timestamps ignored).
export function parseMetrics(text) {
  const samples = [];
  for (const raw of text.split("\n")) {
    const line = raw.trim();
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{(.*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const l of (m[3] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2].replace(/\\(.)/g, (_, ch) => (ch === "n" ? "\n" : ch));
    const value = m[4] === "+Inf" ? Infinity : m[4] === "-Inf" ? -Infinity : parseFloat(m[4]);
    samples.push({ name: m[1], labels, value });
  }
  return samples;
}

function total(samples, name) {
  return samples.filter((s) => s.name === name).reduce((sum, s) => sum + s.value, 0);
}

function byLabel(samples, name, label) {
  const out = {};
  for (const s of samples) if (s.name === name) out[s.labels[label] ?? ""] = (out[s.labels[label] ?? ""] || 0) + s.value;
  return out;
}

function read(samples) {
  return {
    t: Date.now() / 1000,
    completion: total(samples, "flashtree_completion_tokens_total"),
    prompt: total(samples, "flashtree_prompt_tokens_total"),
    cached: total(samples, "flashtree_cached_tokens_total"),
    decode: total(samples, "flashtree_decode_seconds_total"),
    acceptSum: total(samples, "flashtree_accept_length_sum"),
    acceptCount: total(samples, "flashtree_accept_length_count"),
    queue: total(samples, "flashtree_queue_depth"),
    running: total(samples, "flashtree_requests_running"),
    requests: total(samples, "flashtree_requests_total"),
    restarts: total(samples, "flashtree_worker_restarts_total"),
    hits: byLabel(samples, "flashtree_prefix_cache_hits", "tier"),
    entries: byLabel(samples, "flashtree_prefix_cache_entries", "tier"),
    bytes: byLabel(samples, "flashtree_prefix_cache_bytes", "tier"),
    oom: byLabel(samples, "flashtree_oom_total", "site"),
    cleared: byLabel(samples, "flashtree_cache_cleared_total", "reason"),
    generations: byLabel(samples, "flashtree_generations_total", "finish_reason"),
    buckets: samples.filter((s) => s.name === "flashtree_accept_length_bucket")
      .map((s) => [parseFloat(s.labels.le), s.value]).sort((a, b) => a[0] - b[0]),
  };
}

const history = [];
const events = [];
let previous = null;

function rate(now, before, num, den) {
  const d = now[den] - before[den];
  return d > 0 ? (now[num] - before[num]) / d : null;
}

function noteEvents(now, before) {
  const grew = (label, a, b) => {
    for (const [key, value] of Object.entries(a)) {
      const n = value - (b[key] || 0);
      if (n > 0) events.unshift({ t: now.t, text: `${label}${key ? ` (${key})` : ""}${n > 1 ? ` \u00d7${n}` : ""}` });
    }
  };
  grew("out of memory", now.oom, before.oom);
  grew("cache cleared", now.cleared, before.cleared);
  grew("worker restarted", { "": now.restarts }, { "": before.restarts });
  grew("generation cancelled", { "": now.generations.cancelled || 0 }, { "": before.generations.cancelled || 0 });
  events.splice(100);
}

function tiles(now) {
  const gen = now.generations;
  const items = [
    ["requests", now.requests],
    ["generations", Object.values(gen).reduce((a, b) => a + b, 0)],
    ["cancelled", gen.cancelled || 0],
    ["tokens generated", now.completion],
    ["prompt tokens cached", now.prompt ? `${Math.round((100 * now.cached) / now.prompt)}%` : "\u2013"],
    ["mean accept length", now.acceptCount ? (now.acceptSum / now.acceptCount).toFixed(2) : "\u2013"],
    ["OOM", Object.values(now.oom).reduce((a, b) => a + b, 0)],
    ["worker restarts", now.restarts],
  ];
  $("tiles").replaceChildren(...items.map(([label, value]) => {
    const tile = document.createElement("div");
    tile.className = "tile";
    tile.dataset.metric = label;
    const v = document.createElement("div");
    v.className = "value";
    v.textContent = typeof value === "number" ? value.toLocaleString() : value;
    const l = document.createElement("div");
    l.className = "label";
    l.textContent = label;
    tile.append(v, l);
    return tile;
  }));
}

// Each bucket by its upper bound (accept lengths are whole numbers: "12" holds 11 and 12).
function bucketLabels(buckets) {
  return buckets.map(([le], i) => (Number.isFinite(le) ? String(le) : `>${i ? buckets[i - 1][0] : 0}`));
}

function cacheTable(now) {
  const rows = Object.keys({ ...now.hits, ...now.entries }).map((tier) =>
    `<tr><td>${tier.replace(/[<>&]/g, "")}</td><td>${now.hits[tier] || 0}</td><td>${now.entries[tier] || 0}</td>` +
    `<td>${((now.bytes[tier] || 0) / 2 ** 20).toFixed(1)} MiB</td></tr>`).join("");
  $("cache-table").innerHTML = `<tr><th>tier</th><th>hits</th><th>snapshots</th><th>size</th></tr>${rows}`;
}

const TIER_COLOURS = ["#1f6feb", "#2da44e", "#bf8700", "#cf222e"];

function draw(now) {
  tiles(now);
  // the plots span what this page has seen, from half a minute up to SPAN_S
  const span = Math.min(SPAN_S, Math.max(30, Math.ceil(now.t - history[0].t)));
  const series = (key) => history.map((p) => [p.t, p[key]]);
  lineChart($("tps"), [{ name: "decode tokens/s", color: "#1f6feb", points: series("tps") }], span);
  lineChart($("accept"), [{ name: "tokens per step", color: "#2da44e", points: series("accept") }], span);
  const cumulative = now.buckets.map((b) => b[1]);
  barChart($("histogram"), bucketLabels(now.buckets), cumulative.map((v, i) => v - (i ? cumulative[i - 1] : 0)), "#8250df");
  const tiers = Object.keys(now.hits);
  lineChart($("hits"), tiers.map((tier, i) => ({ name: tier, color: TIER_COLOURS[i % TIER_COLOURS.length],
    points: history.map((p) => [p.t, p.hits[tier] ?? null]) })), span);
  lineChart($("queue"), [{ name: "waiting", color: "#bf8700", points: series("queue") },
    { name: "running", color: "#1f6feb", points: series("running") }], span);
  cacheTable(now);
  $("events").replaceChildren(...(events.length ? events : [{ t: null, text: "none since this page opened" }]).map((e) => {
    const li = document.createElement("li");
    if (e.t) {
      const when = document.createElement("span");
      when.className = "when";
      when.textContent = new Date(e.t * 1000).toLocaleTimeString();
      li.append(when);
    }
    li.append(e.text);
    return li;
  }));
}

async function poll() {
  try {
    const response = await apiFetch("/metrics");
    if (!response.ok) throw new Error(await errorText(response));
    const now = read(parseMetrics(await response.text()));
    const point = { t: now.t, queue: now.queue, running: now.running, hits: now.hits, tps: null, accept: null };
    if (previous) {
      point.tps = rate(now, previous, "completion", "decode");
      point.accept = rate(now, previous, "acceptSum", "acceptCount");
      noteEvents(now, previous);
    }
    history.push(point);
    while (history.length && history[0].t < now.t - SPAN_S) history.shift();
    previous = now;
    draw(now);
    $("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    $("status").textContent = `cannot read /metrics: ${e.message}`;
  }
  setTimeout(poll, POLL_MS);
}

poll();
