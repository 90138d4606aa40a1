// Two small canvas charts for the dashboard: lines over time and bars. Hand-written so the page needs
// no library; sized to the canvas's CSS box at the device's pixel ratio, so they stay sharp.

const FONT = "11px system-ui, sans-serif";

function setup(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = FONT;
  const style = getComputedStyle(document.documentElement);
  return { ctx, width, height, muted: style.getPropertyValue("--muted").trim() || "#888",
           line: style.getPropertyValue("--line").trim() || "#ddd" };
}

function niceMax(value) {
  if (!(value > 0)) return 1;
  const step = 10 ** Math.floor(Math.log10(value));
  for (const m of [1, 2, 4, 6, 8, 10]) if (m * step >= value) return m * step; // quarters stay round
  return 10 * step;
}

function format(v) {
  if (Math.abs(v) >= 1000) return `${+(v / 1000).toFixed(1)}k`;
  return Number.isInteger(v) ? String(v) : String(+v.toFixed(Math.abs(v) < 10 ? 2 : 1));
}

function axes(c, max, left, bottom) {
  const { ctx, width, height } = c;
  ctx.strokeStyle = c.line;
  ctx.fillStyle = c.muted;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let k = 0; k <= 4; k += 1) {
    const y = 8 + (height - bottom - 8) * (1 - k / 4);
    ctx.beginPath();
    ctx.moveTo(left, y);
    ctx.lineTo(width - 4, y);
    ctx.stroke();
    ctx.fillText(format((max * k) / 4), left - 4, y);
  }
}

// series: [{name, color, points: [[t, value or null], ...]}]; the x axis is the last `span` seconds.
export function lineChart(canvas, series, span) {
  const c = setup(canvas);
  const { ctx, width, height } = c;
  const left = 40;
  const bottom = 18;
  const now = Date.now() / 1000;
  const values = series.flatMap((s) => s.points.map((p) => p[1]).filter((v) => v !== null && Number.isFinite(v)));
  const max = niceMax(Math.max(0, ...values) * 1.1);
  axes(c, max, left, bottom);
  const x = (t) => left + ((t - (now - span)) / span) * (width - left - 4);
  const y = (v) => 8 + (height - bottom - 8) * (1 - v / max);
  ctx.textBaseline = "top";
  for (let k = 0; k <= 4; k += 1) {
    const ago = (span * (4 - k)) / 4;
    ctx.textAlign = k === 0 ? "left" : k === 4 ? "right" : "center";
    ctx.fillText(ago ? `-${Math.round(ago)}s` : "now", x(now - ago), height - bottom + 4);
  }
  series.forEach((s, index) => {
    ctx.strokeStyle = s.color;
    ctx.fillStyle = s.color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    let drawing = false;
    for (const [t, v] of s.points) {
      if (v === null || !Number.isFinite(v) || t < now - span) { drawing = false; continue; }
      if (drawing) ctx.lineTo(x(t), y(v));
      else ctx.moveTo(x(t), y(v));
      drawing = true;
    }
    ctx.stroke();
    ctx.lineWidth = 1;
    ctx.textAlign = "left";
    ctx.fillText(`\u25a0 ${s.name}`, left + 6 + index * 110, 10);
  });
}

// Bars of `values` under `labels`.
export function barChart(canvas, labels, values, color) {
  const c = setup(canvas);
  const { ctx, width, height } = c;
  const left = 40;
  const bottom = 18;
  const max = niceMax(Math.max(0, ...values));
  axes(c, max, left, bottom);
  const slot = (width - left - 4) / Math.max(1, values.length);
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  values.forEach((v, i) => {
    const h = ((height - bottom - 8) * v) / max;
    ctx.fillStyle = color;
    ctx.fillRect(left + i * slot + slot * 0.15, height - bottom - h, slot * 0.7, h);
    ctx.fillStyle = c.muted;
    ctx.fillText(labels[i], left + i * slot + slot / 2, height - bottom + 4);
  });
}
