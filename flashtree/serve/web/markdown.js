// A small Markdown renderer for model answers: headings, paragraphs, emphasis, inline code, fenced
// code blocks, lists (nested by indentation), block quotes, tables, rules and links. Strong is
// `**` only: `__init__` in an answer about Python is a name, not bold "init".
//
// The rule: everything the model wrote is escaped before any tag is added, so an answer can never
// inject markup or script; links keep only http(s), mailto and same-page targets. It renders a
// half-streamed answer as well as a whole one (an unclosed code fence is code up to the end), so
// the page can re-render on every chunk.

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

const SAFE_URL = /^(https?:|mailto:|#|\/(?!\/))/i;

function inline(text) {
  const codes = [];
  // code spans first: nothing inside them is Markdown
  let out = text.replace(/(`+)([\s\S]*?[^`])\1(?!`)/g, (_, ticks, code) => {
    codes.push(`<code>${escapeHtml(code.trim() ? code.replace(/^ (.*) $/, "$1") : code)}</code>`);
    return `\u0000${codes.length - 1}\u0000`;
  });
  out = escapeHtml(out);
  out = out.replace(/\[([^\]]+)\]\(([^)\s]+)(?:\s+&quot;[^&]*&quot;)?\)/g, (whole, label, url) => {
    const href = url.replace(/&amp;/g, "&");
    if (!SAFE_URL.test(href)) return whole;
    return `<a href="${escapeHtml(href)}" target="_blank" rel="noopener noreferrer">${label}</a>`;
  });
  out = out
    .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*\w])\*(?=[^\s*])([^*]*?[^\s*])\*(?!\*)/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>")
    .replace(/ {2,}\n/g, "<br>")
    .replace(/\n/g, "<br>");
  return out.replace(/\u0000(\d+)\u0000/g, (_, i) => codes[Number(i)]);
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

function codeBlock(lang, lines) {
  const label = lang ? `<span class="lang">${escapeHtml(lang)}</span>` : "";
  return `<div class="code">${label}<button type="button" class="copy" title="copy">copy</button>` +
    `<pre><code>${escapeHtml(lines.join("\n"))}</code></pre></div>`;
}

function cells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split(/(?<!\\)\|/).map((c) => c.trim());
}

function table(header, rule, rows) {
  const aligns = cells(rule).map((c) => (c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : ""));
  const cell = (tag, text, i) => `<${tag}${aligns[i] ? ` class="align-${aligns[i]}"` : ""}>${inline(text)}</${tag}>`;
  const head = cells(header).map((c, i) => cell("th", c, i)).join("");
  const body = rows.map((r) => `<tr>${cells(r).map((c, i) => cell("td", c, i)).join("")}</tr>`).join("");
  return `<table><thead><tr>${head}</tr></thead><tbody>${body}</tbody></table>`;
}

function list(lines, start) {
  // the items at the first item's indentation; deeper lines belong to the item above them
  const first = lines[start].match(ITEM);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const items = [];
  let i = start;
  while (i < lines.length) {
    const m = lines[i].match(ITEM);
    if (m && m[1].length === indent && /\d/.test(m[2]) === ordered) {
      items.push([m[3]]);
    } else if (lines[i].trim() === "" && i + 1 < lines.length && /^\s+\S/.test(lines[i + 1]) && items.length) {
      items[items.length - 1].push("");
    } else if (items.length && (lines[i].startsWith(" ".repeat(indent + 1)) || (m && m[1].length > indent))) {
      items[items.length - 1].push(lines[i].slice(Math.min(indent + 2, lines[i].search(/\S/))));
    } else if (items.length && lines[i].trim() !== "" && !ITEM.test(lines[i]) && !blockStart(lines[i])) {
      items[items.length - 1].push(lines[i]); // a lazy continuation line
    } else {
      break;
    }
    i += 1;
  }
  const startAt = ordered ? parseInt(first[2], 10) : 1;
  const tag = ordered ? "ol" : "ul";
  const open = ordered && startAt !== 1 ? `<ol start="${startAt}">` : `<${tag}>`;
  const html = items.map((body) => {
    const rendered = blocks(body);
    const tight = body.every((l) => l.trim() !== "");
    return `<li>${tight ? rendered.replace(/^<p>([\s\S]*?)<\/p>/, "$1") : rendered}</li>`;
  }).join("");
  return [open + html + `</${tag}>`, i];
}

function blockStart(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line);
}

function blocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (line.trim() === "") {
      i += 1;
    } else if ((m = line.match(FENCE))) {
      const fence = m[1];
      const body = [];
      i += 1;
      while (i < lines.length && !(lines[i].trim().startsWith(fence[0].repeat(fence.length)) && lines[i].trim().replace(/[`~]/g, "") === "")) {
        body.push(lines[i]);
        i += 1;
      }
      i += 1; // the closing fence (or the end of a still-streaming answer)
      out.push(codeBlock(m[2], body));
    } else if ((m = line.match(HEADING))) {
      out.push(`<h${m[1].length}>${inline(m[2])}</h${m[1].length}>`);
      i += 1;
    } else if (RULE.test(line)) {
      out.push("<hr>");
      i += 1;
    } else if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && (m = lines[i].match(QUOTE))) {
        body.push(m[1]);
        i += 1;
      }
      out.push(`<blockquote>${blocks(body)}</blockquote>`);
    } else if (ITEM.test(line)) {
      const [html, next] = list(lines, i);
      out.push(html);
      i = next;
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]) && lines[i + 1].includes("-")) {
      const header = line;
      const rule = lines[i + 1];
      const rows = [];
      i += 2;
      while (i < lines.length && lines[i].includes("|") && lines[i].trim() !== "") {
        rows.push(lines[i]);
        i += 1;
      }
      out.push(table(header, rule, rows));
    } else {
      const para = [];
      while (i < lines.length && lines[i].trim() !== "" && !blockStart(lines[i]) && !(para.length && ITEM.test(lines[i]))) {
        para.push(lines[i]);
        i += 1;
      }
      out.push(`<p>${inline(para.join("\n"))}</p>`);
    }
  }
  return out.join("");
}

// Markdown text -> HTML (a string whose every piece of the input is escaped).
export function renderMarkdown(text) {
  return blocks(text.replace(/\r\n?/g, "\n").replace(/\t/g, "    ").split("\n"));
}
