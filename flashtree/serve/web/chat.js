// The chat page: conversations in local storage, settings, and streaming answers from
// /v1/chat/completions (the OpenAI API, stream: true) with flashtree's per-step extension.
//
// Rules the page keeps:
// - It is a client of the public API like any other: every call is an ordinary request, and the
//   decoder data comes only because the page asks for it (`flashtree_trace: true`).
// - Stop aborts the fetch; the server sees the connection close and cancels the generation in
//   the engine (its /metrics count it under flashtree_generations_total{finish_reason="cancelled"}).
// - What is stored (localStorage) is the conversations' text, tool calls and per-answer numbers,
//   and the settings; decode steps stay in memory (see decoder.js).

import { apiFetch, errorText, forgetApiKey, sseEvents } from "./api.js";
import { hidePopup } from "./decoder.js";
import { messageElement } from "./messages.js";

const STORE = "flashtree.conversations";
const CURRENT = "flashtree.current";
const SETTINGS = "flashtree.settings";
// empty numbers are left out of the request: the server's defaults apply (greedy, up to the context)
const DEFAULTS = { system: "", temperature: "", top_p: "", max_tokens: "", seed: "", thinking: false, tools: "" };

const $ = (id) => document.getElementById(id);
const load = (key, fallback) => {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
};

let conversations = load(STORE, []);
let currentId = localStorage.getItem(CURRENT);
const settings = { ...DEFAULTS, ...load(SETTINGS, {}) };
const live = new WeakMap(); // message -> {steps, open, decoder, streaming}: not stored
let running = null; // {controller, msg}
let model = null;
const pendingFrames = new Set();

function save() {
  for (;;) {
    try {
      localStorage.setItem(STORE, JSON.stringify(conversations));
      localStorage.setItem(CURRENT, currentId || "");
      return;
    } catch (e) { // full: the oldest conversations go first, never the current one
      const oldest = conversations.findIndex((c) => c.id !== currentId);
      if (oldest < 0) return;
      conversations.splice(oldest, 1);
    }
  }
}

function newConversation() {
  const conv = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat", messages: [] };
  conversations.unshift(conv);
  currentId = conv.id;
  save();
  return conv;
}

function current() {
  return conversations.find((c) => c.id === currentId) || newConversation();
}

// --- rendering -------------------------------------------------------------------------------

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conv of conversations) {
    const item = document.createElement("li");
    item.className = conv.id === currentId ? "active" : "";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "conv-title";
    open.textContent = conv.title;
    open.addEventListener("click", () => { if (!running) { currentId = conv.id; save(); render(); } });
    const del = document.createElement("button");
    del.type = "button";
    del.className = "conv-delete";
    del.title = "delete";
    del.textContent = "\u00d7";
    del.addEventListener("click", () => {
      if (running) return;
      conversations = conversations.filter((c) => c !== conv);
      if (currentId === conv.id) currentId = conversations.length ? conversations[0].id : null;
      save();
      render();
    });
    item.append(open, del);
    list.append(item);
  }
}

const actions = {
  busy: () => Boolean(running),
  refresh: (msg) => update(msg),
  resend: (msg, text) => { // the edited message replaces itself and everything after it
    const conv = current();
    const index = conv.messages.indexOf(msg);
    conv.messages.splice(index < 0 ? conv.messages.length : index);
    ask(text);
  },
  retry: () => {
    const conv = current();
    conv.messages.pop();
    generate(conv);
  },
  toolResults: (results) => {
    const conv = current();
    for (const { call, content } of results) {
      conv.messages.push({ role: "tool", tool_call_id: call.id, name: call.function.name, content });
    }
    generate(conv);
  },
};

const elements = new WeakMap(); // message -> its element on the page

function elementOf(conv, msg) {
  const node = messageElement(msg, { live: live.get(msg), isLast: conv.messages[conv.messages.length - 1] === msg, model, actions });
  elements.set(msg, node);
  return node;
}

function render() {
  hidePopup();
  renderSidebar();
  const conv = current();
  const box = $("messages");
  box.replaceChildren(...conv.messages.map((m) => elementOf(conv, m)));
  $("empty").hidden = conv.messages.length > 0;
  box.scrollTop = box.scrollHeight;
  $("send").hidden = Boolean(running);
  $("stop").hidden = !running;
}

function update(msg) {
  const old = elements.get(msg);
  if (!old || !old.isConnected) return;
  const box = $("messages");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  old.replaceWith(elementOf(current(), msg));
  if (atBottom) box.scrollTop = box.scrollHeight;
}

function scheduleUpdate(msg) { // at most once a frame, however fast the chunks come
  if (pendingFrames.has(msg)) return;
  pendingFrames.add(msg);
  requestAnimationFrame(() => { if (pendingFrames.delete(msg)) update(msg); });
}

// --- requests --------------------------------------------------------------------------------

function requestBody(conv, answer) {
  const messages = settings.system.trim() ? [{ role: "system", content: settings.system }] : [];
  for (const m of conv.messages) {
    if (m === answer) continue;
    if (m.role === "user") messages.push({ role: "user", content: m.content });
    else if (m.role === "tool") messages.push({ role: "tool", tool_call_id: m.tool_call_id, content: m.content });
    else if (m.content || (m.tool_calls && m.tool_calls.length)) {
      const out = { role: "assistant", content: m.content };
      if (m.tool_calls && m.tool_calls.length) out.tool_calls = m.tool_calls;
      messages.push(out);
    }
  }
  const body = { messages, stream: true, stream_options: { include_usage: true }, flashtree_trace: true,
                 chat_template_kwargs: { enable_thinking: Boolean(settings.thinking) } };
  if (model) body.model = model;
  for (const [key, parse] of [["temperature", parseFloat], ["top_p", parseFloat], ["max_tokens", (v) => parseInt(v, 10)], ["seed", (v) => parseInt(v, 10)]]) {
    const value = parse(String(settings[key]).trim());
    if (!Number.isNaN(value)) body[key] = value;
  }
  if (settings.tools.trim()) {
    let tools;
    try {
      tools = JSON.parse(settings.tools);
    } catch (e) {
      throw new Error(`Settings \u203a Tools is not JSON: ${e.message}`);
    }
    body.tools = Array.isArray(tools) ? tools : [tools];
  }
  return body;
}

function applyChunk(msg, state, chunk) {
  if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
  if (chunk.flashtree && chunk.flashtree.steps) state.steps.push(...chunk.flashtree.steps);
  if (chunk.flashtree && chunk.flashtree.stats) msg.stats = chunk.flashtree.stats;
  if (chunk.usage) msg.usage = chunk.usage;
  const choice = chunk.choices && chunk.choices[0];
  if (!choice) return;
  const delta = choice.delta || {};
  if (delta.content) msg.content += delta.content;
  if (delta.reasoning_content) msg.reasoning += delta.reasoning_content;
  for (const part of delta.tool_calls || []) {
    const call = msg.tool_calls[part.index] || (msg.tool_calls[part.index] = { id: "", type: "function", function: { name: "", arguments: "" } });
    if (part.id) call.id = part.id;
    if (part.function && part.function.name) call.function.name += part.function.name;
    if (part.function && part.function.arguments) call.function.arguments += part.function.arguments;
  }
  if (choice.finish_reason) msg.finish = choice.finish_reason;
}

async function generate(conv) {
  const msg = { role: "assistant", content: "", reasoning: "", tool_calls: [], finish: null, stats: null, usage: null, error: null };
  const state = { steps: [], open: false, decoder: false, streaming: true };
  live.set(msg, state);
  conv.messages.push(msg);
  running = { controller: new AbortController(), msg };
  save();
  render();
  try {
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody(conv, msg)), signal: running.controller.signal });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const chunk of sseEvents(response)) {
      applyChunk(msg, state, chunk);
      scheduleUpdate(msg);
    }
  } catch (e) {
    if (e.name === "AbortError") msg.finish = "stopped";
    else msg.error = e.message;
  } finally {
    state.streaming = false;
    running = null;
    pendingFrames.delete(msg); // the render below shows the end: no frame replaces it after
    save();
    render();
  }
}

function ask(text) {
  const conv = current();
  if (!conv.messages.length) conv.title = text.trim().split("\n")[0].slice(0, 48) || "New chat";
  conv.messages.push({ role: "user", content: text });
  generate(conv);
}

// --- settings and start-up ---------------------------------------------------------------------

function bindSettings() {
  const fields = { system: "s-system", temperature: "s-temperature", top_p: "s-top-p", max_tokens: "s-max-tokens",
                   seed: "s-seed", thinking: "s-thinking", tools: "s-tools" };
  for (const [key, id] of Object.entries(fields)) {
    const input = $(id);
    if (input.type === "checkbox") input.checked = Boolean(settings[key]);
    else input.value = settings[key];
    const store = () => {
      settings[key] = input.type === "checkbox" ? input.checked : input.value;
      localStorage.setItem(SETTINGS, JSON.stringify(settings));
    };
    input.addEventListener("input", store);
    input.addEventListener("change", store);
  }
  $("settings-toggle").addEventListener("click", () => { $("settings").hidden = !$("settings").hidden; });
  $("forget-key").addEventListener("click", () => { forgetApiKey(); location.reload(); });
}

async function describeServer() {
  try {
    const models = await apiFetch("/v1/models");
    if (models.ok) model = (await models.json()).data[0].id;
    const props = await apiFetch("/props");
    if (props.ok) {
      const s = (await props.json()).speculative || {};
      $("server-info").textContent = [s.mode, s.budget && `budget ${s.budget}`, s.block_size && `block ${s.block_size}`]
        .filter(Boolean).join(" \u00b7 ");
    }
  } catch (e) {
    $("server-info").textContent = e.message;
  }
  $("model-name").textContent = model || "";
}

function start() {
  bindSettings();
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("input").value;
    if (!text.trim() || running) return;
    $("input").value = "";
    ask(text);
  });
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => { if (running) running.controller.abort(); });
  $("new-chat").addEventListener("click", () => { if (!running) { newConversation(); render(); $("input").focus(); } });
  $("messages").addEventListener("click", (event) => {
    const copy = event.target.closest(".copy");
    if (copy && navigator.clipboard) navigator.clipboard.writeText(copy.parentElement.querySelector("code").textContent);
  });
  render();
  describeServer().then(() => { // names the answers' author without redrawing what the user may be editing
    for (const role of document.querySelectorAll(".msg.assistant > .role")) role.textContent = model || "Assistant";
  });
}

start();
