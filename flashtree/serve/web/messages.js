// One message of a conversation as DOM: the user's text with its edit button, or an answer with its
// reasoning (collapsed), its Markdown, its tool calls (as calls, with a form for their results
// when it is the last message), its numbers and its decoder view.
//
// The rule: this module only builds elements from a message and the callbacks it is given; the
// conversation and the requests belong to chat.js. Model text reaches the DOM only through
// renderMarkdown or textContent, never as markup.

import { decoderView, meanAccept, statsText } from "./decoder.js";
import { renderMarkdown } from "./markdown.js";

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(label, className, onClick) {
  const b = el("button", className, label);
  b.type = "button";
  b.addEventListener("click", onClick);
  return b;
}

function userBody(msg, actions) {
  const body = el("div", "content plain", msg.content);
  const edit = button("Edit", "edit", () => {
    const box = el("div", "editing");
    const area = el("textarea");
    area.value = msg.content;
    area.rows = Math.min(12, msg.content.split("\n").length + 1);
    const row = el("div", "row");
    row.append(button("Cancel", "", () => box.replaceWith(body, edit)),
      button("Save & resend", "primary resend", () => actions.resend(msg, area.value)));
    box.append(area, row);
    body.replaceWith(box);
    edit.remove();
    area.focus();
  });
  return actions.busy() ? [body] : [body, edit]; // no edits while an answer streams
}

function toolCallsElement(msg, isLast, actions) {
  const box = el("div", "tool-calls");
  const areas = [];
  for (const call of msg.tool_calls) {
    const item = el("div", "tool-call");
    const head = el("div", "call-head");
    head.append(el("span", "call-label", "call"), el("span", "fn", call.function.name), el("span", "call-id", call.id || ""));
    let args = call.function.arguments;
    try {
      args = JSON.stringify(JSON.parse(args), null, 2);
    } catch { /* not JSON (yet, while it streams): shown as sent */ }
    item.append(head, el("pre", "args", args));
    if (isLast && !actions.busy()) {
      const area = el("textarea", "tool-result");
      area.placeholder = `result of ${call.function.name}`;
      area.rows = 2;
      areas.push([call, area]);
      item.append(area);
    }
    box.append(item);
  }
  if (areas.length) {
    box.append(button("Send results", "primary send-results", () =>
      actions.toolResults(areas.map(([call, area]) => ({ call, content: area.value })))));
  }
  return box;
}

function assistantBody(msg, live, isLast, actions) {
  const parts = [];
  if (msg.reasoning) {
    const details = el("details", "reasoning");
    details.open = Boolean(live && live.open);
    details.addEventListener("toggle", () => { if (live) live.open = details.open; });
    const summary = el("summary", "", live && live.streaming && !msg.content ? "Thinking\u2026" : "Reasoning");
    const inner = el("div", "md");
    inner.innerHTML = renderMarkdown(msg.reasoning);
    details.append(summary, inner);
    parts.push(details);
  }
  const content = el("div", "content md");
  content.innerHTML = renderMarkdown(msg.content);
  if (live && live.streaming) content.classList.add("streaming");
  parts.push(content);
  if (msg.tool_calls && msg.tool_calls.length) parts.push(toolCallsElement(msg, isLast, actions));
  if (msg.error) parts.push(el("div", "error", msg.error));
  const steps = live ? live.steps : [];
  let stats = msg.stats;
  if (!stats && steps.length) { // stopped: the server never sent its numbers; the steps tell some
    stats = { mean_accept_length: meanAccept(steps), completion_tokens: steps.reduce((s, x) => s + x.n, 0) };
  }
  const foot = el("div", "foot");
  const line = statsText(stats, msg.usage, msg.finish);
  if (line) foot.append(el("span", "stats", line));
  if (steps.length) {
    const toggle = button(live.decoder ? "Hide decoder view" : "Decoder view", "decoder-toggle", () => {
      live.decoder = !live.decoder;
      actions.refresh(msg);
    });
    foot.append(toggle);
  }
  if (isLast && !actions.busy()) foot.append(button("Retry", "retry", () => actions.retry()));
  parts.push(foot);
  if (steps.length && live.decoder) parts.push(decoderView(steps));
  return parts;
}

function toolBody(msg) {
  const box = el("div", "tool-result-shown");
  box.append(el("span", "call-label", `result of ${msg.name || "call"}`), el("pre", "args", msg.content));
  return [box];
}

const ROLE_NAMES = { user: "You", tool: "Tool" };

// The element of `msg`; `live` holds what is not stored (steps, open states).
export function messageElement(msg, { live, isLast, model, actions }) {
  const node = el("div", `msg ${msg.role}`);
  node.append(el("div", "role", ROLE_NAMES[msg.role] || model || "Assistant"));
  const parts = msg.role === "user" ? userBody(msg, actions)
    : msg.role === "tool" ? toolBody(msg) : assistantBody(msg, live, isLast, actions);
  node.append(...parts);
  return node;
}
