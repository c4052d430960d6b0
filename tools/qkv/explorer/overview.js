// qkv attention explorer: the overview of a long document (up to 8192 tokens) for one layer of a
// model folder, from POST /api/overview - the attention summaries of the fused kernel, never the
// N x N weights. Per head, one canvas: the entropy of each token's row along the sequence (blue;
// grey: ln of the keys it sees, the uniform row's), the mass each key receives (bars; red: the
// keys that collect most), and the strongest links as arcs from query to key. A click on a head's
// strip zooms: the exact weights of the 64 tokens around it come from /api/attention (that
// window's own attention, computed as a short document). Loaded after explorer.js, whose $ and
// el() it uses. window.qkvOverview.draw({model, ids | text, layer}) is what the page's button
// calls; it resolves to the milliseconds from request to drawn, also left in
// document.body.dataset.overviewMs (the browser test's timing).
"use strict";

const OVERVIEW_STRIP = { links: 46, entropy: 44, received: 30, gap: 8 };
const ZOOM_TOKENS = 64;

function longDocumentCanvas(width) {
  const height = OVERVIEW_STRIP.links + OVERVIEW_STRIP.entropy + OVERVIEW_STRIP.received;
  const canvas = el("canvas", { class: "longdoc-head", width: String(width), height: String(height) });
  return canvas;
}

// One head's strip: links (arcs), entropy (line), received mass (bars, collectors in red).
function drawLongDocumentHead(canvas, answer, h) {
  const ctx = canvas.getContext("2d"), w = canvas.width, n = answer.n;
  const x = (i) => (i + 0.5) * w / n;
  const S = OVERVIEW_STRIP;
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, w, canvas.height);
  const links = answer.links[h], top = links.length ? links[0][2] : 1;
  ctx.lineWidth = 1;
  for (const [q, k, weight] of links) {
    const a = x(q), b = x(k), mid = (a + b) / 2, r = Math.abs(a - b) / 2;
    ctx.strokeStyle = `rgba(8, 48, 107, ${Math.max(0.08, weight / top).toFixed(3)})`;
    ctx.beginPath();
    ctx.moveTo(a, S.links);
    ctx.quadraticCurveTo(mid, S.links - Math.min(S.links - 2, 4 + r), b, S.links);
    ctx.stroke();
  }
  const e0 = S.links, emax = Math.max(1e-6, ...answer.uniform);
  const line = (values, colour) => {
    ctx.strokeStyle = colour;
    ctx.beginPath();
    values.forEach((v, i) => { const y = e0 + S.entropy - 2 - (S.entropy - 4) * v / emax; i ? ctx.lineTo(x(i), y) : ctx.moveTo(x(i), y); });
    ctx.stroke();
  };
  line(answer.uniform, "#bbb");
  line(answer.entropy[h], "#2171b5");
  const r0 = S.links + S.entropy, mass = answer.received[h], most = Math.max(1e-6, ...mass);
  ctx.fillStyle = "#6baed6";
  const bar = Math.max(1, w / n);
  mass.forEach((m, i) => { const hgt = (S.received - 2) * m / most; ctx.fillRect(x(i) - bar / 2, r0 + S.received - hgt, bar, hgt); });
  ctx.fillStyle = "#cb181d";
  for (const [k, m] of answer.collectors[h].slice(0, 5)) {
    const hgt = (S.received - 2) * m / most;
    ctx.fillRect(x(k) - Math.max(1.5, bar / 2), r0 + S.received - hgt, Math.max(3, bar), hgt);
  }
}

function describeLongDocumentHead(answer, h) {
  const e = answer.entropy[h], mean = e.reduce((a, b) => a + b, 0) / e.length;
  const sinks = answer.collectors[h].slice(0, 3).map(([k, m]) => `${k} (${m.toFixed(1)})`).join(", ");
  return `head ${h}: mean entropy ${mean.toFixed(2)} nats; keys collecting most: ${sinks}`;
}

// The exact weights of ZOOM_TOKENS tokens around `center` for head h, from /api/attention.
async function zoomLongDocument(request, answer, h, center) {
  const box = $("longdoc-zoom");
  const first = Math.max(0, Math.min(center - ZOOM_TOKENS / 2, answer.n - ZOOM_TOKENS));
  const ids = state.overviewIds.slice(first, first + ZOOM_TOKENS);
  box.replaceChildren(el("p", { class: "help" }, `head ${h}, tokens ${first} to ${first + ids.length - 1}: loading...`));
  const reply = await fetch("/api/attention", { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ model: request.model, ids }) });
  const zoom = await reply.json();
  if (!reply.ok) { box.replaceChildren(el("p", { role: "alert" }, zoom.error)); return; }
  const weights = zoom.layers[answer.layer].weights[h], m = weights.length, cell = Math.max(3, Math.floor(384 / m));
  const canvas = el("canvas", { id: "longdoc-zoom-canvas", width: String(m * cell), height: String(m * cell) });
  const ctx = canvas.getContext("2d");
  for (let i = 0; i < m; ++i) for (let j = 0; j < m; ++j) {
    ctx.fillStyle = colour(weights[i][j]);
    ctx.fillRect(j * cell, i * cell, cell, cell);
  }
  box.replaceChildren(el("p", { class: "help" }, `head ${h}, tokens ${first} to ${first + m - 1}: exact weights of ` +
    "this window attended on its own (rows: queries, columns: keys, 0 to 1)"), canvas);
}

async function drawLongDocument(request) {
  const started = performance.now();
  const reply = await fetch("/api/overview", { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(request) });
  const answer = await reply.json();
  const box = $("longdoc"), status = $("longdoc-status");
  if (!reply.ok) {
    status.textContent = answer.error;
    status.setAttribute("role", "alert");
    document.body.dataset.overviewError = answer.error;
    return null;
  }
  state.overviewIds = request.ids || [];
  $("longdoc-layer").value = String(answer.layer);
  const width = Math.max(320, Math.floor(box.clientWidth || 960));
  const rows = [];
  for (let h = 0; h < answer.heads; ++h) {
    const canvas = longDocumentCanvas(width);
    drawLongDocumentHead(canvas, answer, h);
    canvas.dataset.head = String(h);
    canvas.addEventListener("click", (e) => {
      const rect = canvas.getBoundingClientRect();
      zoomLongDocument(request, answer, h, Math.floor((e.clientX - rect.left) / rect.width * answer.n));
    });
    rows.push(el("p", { class: "help" }, describeLongDocumentHead(answer, h)), canvas);
  }
  box.replaceChildren(...rows);
  await new Promise((done) => requestAnimationFrame(() => done()));
  const ms = performance.now() - started;
  status.removeAttribute("role");
  status.textContent = `${answer.n} tokens, layer ${answer.layer}, ${answer.heads} heads: drawn in ${ms.toFixed(0)} ms`;
  document.body.dataset.overviewMs = ms.toFixed(1);
  state.overview = answer;
  return ms;
}

function startLongDocument() {
  $("longdoc-draw").addEventListener("click", () => {
    const text = $("longdoc-text").value.trim(), model = $("source").value;
    const request = { model, layer: Number($("longdoc-layer").value) || 0 };
    if (/^[\d\s,]+$/.test(text)) request.ids = text.split(/[\s,]+/).filter(Boolean).map(Number);
    else request.text = text;
    drawLongDocument(request);
  });
  window.qkvOverview = { draw: drawLongDocument };
}

startLongDocument();
