// The decoder view of one answer and its numbers.
//
// The server sends, for a request with `flashtree_trace: true`, every decode step: the text of the
// tokens it emitted and its tree (each node's token text and parent, and the accepted path). Here
// each step becomes one span of the raw output, coloured by how many tokens that step emitted, so
// long runs of cheap tokens and single-token steps show at a glance; hovering a span shows the
// step's tree with the accepted path marked (clicking keeps it open). Steps are kept in memory only: they are
// large, and local storage keeps the conversation's text and numbers.

import { escapeHtml } from "./markdown.js";

const MOST_COLOURS = 8; // steps emitting this many tokens or more share the warmest colour

export function visible(text) {
  return text.replace(/ /g, "\u2423").replace(/\n/g, "\u23ce").replace(/\t/g, "\u21e5") || "\u2205";
}

function seconds(s) {
  return s >= 1 ? `${s.toFixed(2)} s` : `${Math.round(s * 1000)} ms`;
}

// The one-line summary of an answer: speed, prefill, cache reuse, acceptance, tokens, how it ended.
export function statsText(stats, usage, finish) {
  const parts = [];
  if (stats && stats.tokens_per_s) parts.push(`${stats.tokens_per_s.toFixed(1)} tok/s`);
  if (stats && stats.prefill_s !== undefined) parts.push(`prefill ${seconds(stats.prefill_s)}`);
  const prompt = (stats && stats.prompt_tokens) ?? (usage && usage.prompt_tokens);
  const cached = (stats && stats.cached_tokens) ?? (usage && usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens);
  if (prompt !== undefined && prompt !== null) parts.push(`cached ${cached || 0}/${prompt} prompt tokens`);
  if (stats && stats.mean_accept_length) parts.push(`accept ${stats.mean_accept_length.toFixed(2)} tokens/step`);
  const completion = (usage && usage.completion_tokens) ?? (stats && stats.completion_tokens);
  if (completion !== undefined && completion !== null) parts.push(`${completion} tokens`);
  if (finish && finish !== "stop") parts.push(finish);
  return parts.join(" \u00b7 ");
}

// The tree as nested lists, a chain of single children on one line (a DDTree is mostly a long
// chain with short branches: drawn one node a line it would be as tall as the block is deep).
function treeHtml(tree, bonus) {
  const children = tree.parents.map(() => []);
  let root = 0;
  tree.parents.forEach((p, i) => (p < 0 ? (root = i) : children[p].push(i)));
  const accepted = new Set(tree.accepted);
  const last = tree.accepted[tree.accepted.length - 1];
  const label = (i) => {
    const cls = i === root ? "node root" : accepted.has(i) ? "node accepted" : "node";
    let html = `<span class="${cls}">${escapeHtml(visible(tree.tokens[i]))}</span>`;
    if (i === last && bonus !== null && bonus !== undefined) {
      html += `<span class="node bonus" title="drawn by the target after the accepted path">${escapeHtml(visible(bonus))}</span>`;
    }
    return html;
  };
  const branch = (i) => {
    let html = label(i);
    let at = i;
    while (children[at].length === 1) {
      at = children[at][0];
      html += label(at);
    }
    const kids = children[at].map((c) => `<li>${branch(c)}</li>`).join("");
    return kids ? `${html}<ul>${kids}</ul>` : html;
  };
  return `<ul class="tree"><li>${branch(root)}</li></ul>`;
}

// The popup's content for one step.
export function stepDetail(step) {
  if (!step.tree) {
    return `<div class="step-head">step ${step.i}: ${step.n} token${step.n === 1 ? "" : "s"} from the prefill (no tree)</div>`;
  }
  const drafted = step.tree.accepted.length - 1;
  const head = `step ${step.i}: ${step.n} token${step.n === 1 ? "" : "s"} \u00b7 tree of ${step.tree.tokens.length} nodes` +
    ` \u00b7 ${drafted} drafted accepted${step.bonus !== null && step.bonus !== undefined ? " + 1 from the target" : ""}`;
  return `<div class="step-head">${head}</div>${treeHtml(step.tree, step.bonus)}` +
    `<div class="step-legend"><span class="node root">root</span> the token the step before ended with \u00b7 ` +
    `<span class="node accepted">accepted</span> <span class="node">proposed, rejected</span> ` +
    `<span class="node bonus">the target's own token</span></div>`;
}

let popup = null;
let pinned = false; // a clicked step's tree stays until a click elsewhere (to scroll a large tree)

// The popup goes below the decoder view, or above it, where it fits whole, so that the coloured
// text stays in sight; else below the hovered step.
function showPopup(step, anchor, view) {
  if (!popup) {
    popup = document.createElement("div");
    popup.className = "tree-popup";
    popup.addEventListener("mouseleave", () => { if (!pinned) hidePopup(); });
    document.body.appendChild(popup);
    document.addEventListener("click", (event) => {
      if (!event.target.closest(".tree-popup, .decoder .step")) hidePopup();
    });
  }
  popup.innerHTML = stepDetail(step);
  popup.hidden = false;
  const span = anchor.getBoundingClientRect();
  const box = view.getBoundingClientRect();
  const width = Math.min(560, window.innerWidth - 16);
  popup.style.maxWidth = `${width}px`;
  popup.style.left = `${Math.max(8, Math.min(span.left, window.innerWidth - width - 8))}px`;
  const height = popup.getBoundingClientRect().height;
  let top = span.bottom + 6;
  if (box.bottom + 6 + height <= window.innerHeight) top = box.bottom + 6;
  else if (box.top - 6 - height >= 0) top = box.top - 6 - height;
  popup.style.top = `${top}px`;
}

export function hidePopup() {
  pinned = false;
  if (popup) popup.hidden = true;
}

// The decoder view of `steps`: one span a step, coloured by its token count.
export function decoderView(steps) {
  const view = document.createElement("div");
  view.className = "decoder";
  const legend = document.createElement("div");
  legend.className = "decoder-legend";
  legend.innerHTML = "tokens per step: " + Array.from({ length: MOST_COLOURS }, (_, k) =>
    `<span class="acc-${k + 1}">${k + 1}${k + 1 === MOST_COLOURS ? "+" : ""}</span>`).join("") +
    " \u00b7 hover a step for its tree";
  const text = document.createElement("div");
  text.className = "decoder-text";
  steps.forEach((step) => {
    if (!step.text) return;
    const span = document.createElement("span");
    span.className = `step acc-${Math.max(1, Math.min(step.n, MOST_COLOURS))}${step.tree ? "" : " prefill"}`;
    span.textContent = step.text;
    span.dataset.step = String(step.i);
    span.addEventListener("mouseenter", () => { if (!pinned) showPopup(step, span, view); });
    span.addEventListener("click", () => { showPopup(step, span, view); pinned = true; });
    text.appendChild(span);
  });
  text.addEventListener("mouseleave", (event) => {
    if (!pinned && (!popup || !popup.contains(event.relatedTarget))) hidePopup();
  });
  view.append(legend, text);
  return view;
}

// Tokens per step over the steps that had a tree (the first token comes from the prefill).
export function meanAccept(steps) {
  const traced = steps.filter((s) => s.tree);
  return traced.length ? traced.reduce((sum, s) => sum + s.n, 0) / traced.length : 0;
}
