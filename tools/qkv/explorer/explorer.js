// qkv attention explorer: reads the controls, asks POST /api/attention (tools/qkv/serve_api.hpp)
// for weights and draws them: per-head heatmaps and their average, a head view, and for a
// trained model a layers x heads overview. Everything is drawn here as SVG or canvas; nothing is
// loaded from anywhere but this server.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

// The slider's 0..1000 on a log scale from 0.05 to 5, rounded to 3 significant digits.
const T_MIN = 0.05, T_MAX = 5, SLIDER_MAX = 1000;
function sliderToTemperature(v) {
  return Number((T_MIN * Math.pow(T_MAX / T_MIN, v / SLIDER_MAX)).toPrecision(3));
}
function temperatureToSlider(t) {
  return Math.round(SLIDER_MAX * Math.log(t / T_MIN) / Math.log(T_MAX / T_MIN));
}

// Sequential colour scale (white to dark blue), t in [0, 1].
const RAMP = [[255, 255, 255], [198, 219, 239], [107, 174, 214], [33, 113, 181], [8, 48, 107]];
function colour(t) {
  t = Math.min(1, Math.max(0, t));
  const x = t * (RAMP.length - 1), i = Math.min(RAMP.length - 2, Math.floor(x)), f = x - i;
  const c = RAMP[i].map((a, k) => Math.round(a + (RAMP[i + 1][k] - a) * f));
  return `rgb(${c[0]}, ${c[1]}, ${c[2]})`;
}

// The largest value of nested arrays (a loop: spreading 16 heads x 64 x 64 numbers into
// Math.max could overflow the call stack), at least 1e-6 so a scale never divides by 0.
function largest(nested) {
  let m = 1e-6;
  for (const v of nested.flat(Infinity)) if (v > m) m = v;
  return m;
}

function el(tag, attributes = {}, text) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attributes)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

const state = {
  models: [],       // GET /api/models
  response: null,   // the last good answer of /api/attention
  layer: 0,         // the layer shown (trained model)
  sequence: 0,      // requests sent; a late answer to an old one is dropped
  preset: null,     // a preset button's exact temperature, until the slider moves
};

function temperature() {
  return state.preset ?? sliderToTemperature(Number($("temperature").value));
}

// ---- Controls -> request

function maskExpression() {
  const kind = document.querySelector('input[name="mask-kind"]:checked').value;
  if (kind === "window") return `window(${$("window-left").value || 0}, ${$("window-right").value || 0})`;
  if (kind === "padding") return `padding(${$("padding-length").value || 1})`;
  if (kind === "expression") return $("mask-text").value;
  return kind;  // none, causal
}

function buildRequest() {
  const request = { text: $("text").value, mask: maskExpression(), chars: $("chars").checked };
  const seed = Number($("seed").value);
  if ($("source").value) {
    request.model = $("source").value;
    if (Number.isInteger(seed) && seed >= 0) request.seed = seed;
  } else {
    request.heads = Number($("heads").value);
    request.embed = Number($("embed").value);
    request.temperature = temperature();
    request.seed = Number.isInteger(seed) && seed >= 0 ? seed : 42;
  }
  return request;
}

function syncControls() {
  const kind = document.querySelector('input[name="mask-kind"]:checked').value;
  for (const name of ["window", "padding", "expression"]) {
    $(`${name}-options`).classList.toggle("shown", kind === name);
  }
  $("mask-applied").textContent = maskExpression() || "none";
  $("temperature-value").textContent = temperature();
  const model = $("source").value !== "";
  $("layer-controls").disabled = model;
  $("temperature-controls").disabled = model;
  $("temperature-help").textContent = model
    ? "A trained model runs as trained (T = 1); the temperature is the untrained layer's."
    : "Logarithmic, 0.05 to 5. Low T: nearly one-hot; high T: nearly uniform.";
}

let timer = null;
function update() {
  syncControls();
  clearTimeout(timer);
  timer = setTimeout(send, 60);
}

async function send() {
  const request = buildRequest();
  const sequence = ++state.sequence;
  $("status").textContent = "computing...";
  let answer, status;
  try {
    const reply = await fetch("/api/attention", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(request),
    });
    status = reply.status;
    answer = await reply.json();
  } catch (e) {
    if (sequence !== state.sequence) return;
    showError(`the server did not answer (${e.message}); is qkv serve still running?`);
    return;
  }
  if (sequence !== state.sequence) return;
  if (status !== 200) {
    showError(answer.error || `HTTP ${status}`);
    return;
  }
  $("error").hidden = true;
  state.response = answer;
  if (answer.layers) state.layer = Math.min(state.layer, answer.layers.length - 1);
  render();
  // What the page shows, for anyone (the browser test) who wants to ask the API the same.
  document.body.dataset.request = JSON.stringify(request);
  document.body.dataset.renders = String(Number(document.body.dataset.renders || 0) + 1);
  $("status").textContent = answer.model
    ? `model ${answer.model} (task ${answer.task}), ${answer.tokens.length} tokens ${answer.note}`
    : `${answer.tokens.length} tokens, ${answer.heads} heads x ${answer.embed / answer.heads} dims, ` +
      `T = ${answer.temperature}, mask ${answer.mask}, seed ${answer.seed}`;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
  $("status").textContent = "";
  document.body.dataset.errors = String(Number(document.body.dataset.errors || 0) + 1);
}

// ---- Drawing

// The heads of the layer on show: [{title, weights, entropy}], the average last when H > 1.
function panels() {
  const r = state.response;
  let heads, entropy, average, averageEntropy;
  if (r.layers) {
    const layer = r.layers[state.layer];
    heads = layer.weights;
    entropy = layer.entropy;
    const n = r.tokens.length;
    average = Array.from({ length: n }, (_, i) => Array.from({ length: n }, (_, j) =>
      heads.reduce((s, h) => s + h[i][j], 0) / heads.length));
    averageEntropy = meanEntropy(average);
  } else {
    heads = r.weights;
    entropy = r.entropy;
    average = r.average;
    averageEntropy = r.average_entropy;
  }
  const out = heads.map((w, h) => ({ title: `head ${h}`, weights: w, entropy: entropy[h], head: h }));
  if (heads.length > 1) {
    out.push({ title: `average of ${heads.length} heads`, weights: average, entropy: averageEntropy, head: "average" });
  }
  return out;
}

function meanEntropy(rows) {
  let total = 0;
  for (const row of rows) for (const w of row) if (w > 0) total -= w * Math.log(w);
  return total / rows.length;
}

function render() {
  const r = state.response, all = panels();
  const scaleMax = largest(all.map((p) => p.weights));
  state.scaleMax = scaleMax;
  drawLegend(scaleMax);
  $("uniform-note").textContent = `uniform over all ${r.tokens.length} keys = ${r.uniform_entropy.toFixed(2)} nats.`;
  $("layer-picker").hidden = !r.layers;
  if (r.layers) {
    const picker = $("layer");
    if (picker.options.length !== r.layers.length) {
      picker.replaceChildren(...r.layers.map((_, l) => el("option", { value: l }, `layer ${l}`)));
    }
    picker.value = state.layer;
  }
  const container = $("heatmaps");
  container.replaceChildren(...all.map((p) => heatmapPanel(p, r.tokens, scaleMax)));
  const chosen = $("headview-head").value;
  $("headview-head").replaceChildren(...all.map((p) => el("option", { value: p.head }, p.title)));
  $("headview-head").value = all.some((p) => String(p.head) === chosen) ? chosen : String(all[all.length - 1].head);
  drawHeadView();
  $("overview-section").hidden = !r.layers;
  if (r.layers) drawOverview();
}

function drawLegend(scaleMax) {
  const width = 240, svg = el("svg:svg", { width: width + 80, height: 34, role: "img" });
  const steps = 48;
  for (let s = 0; s < steps; s++) {
    svg.append(el("svg:rect", { x: 10 + (s * width) / steps, y: 2, width: width / steps + 0.5, height: 14, fill: colour(s / (steps - 1)) }));
  }
  svg.append(el("svg:rect", { x: 10, y: 2, width, height: 14, fill: "none", stroke: "#888" }));
  svg.append(el("svg:text", { x: 10, y: 30, "font-size": 11 }, "0"));
  svg.append(el("svg:text", { x: 10 + width, y: 30, "font-size": 11, "text-anchor": "end" }, scaleMax.toFixed(3)));
  svg.append(el("svg:text", { x: width + 18, y: 14, "font-size": 11 }, "weight"));
  $("legend").replaceChildren(svg);
}

// One heatmap: rows are queries, columns keys, token labels on both axes.
function heatmapPanel(panel, tokens, scaleMax) {
  const n = tokens.length;
  const cell = Math.max(8, Math.min(34, Math.floor(260 / n)));
  const label = Math.min(90, 12 + 7 * Math.max(...tokens.map((t) => t.length)));
  const size = n * cell;
  const div = el("div", { class: "panel", "data-head": panel.head });
  div.append(el("h3", {}, panel.title));
  div.append(el("p", { class: "entropy" }, `entropy ${panel.entropy.toFixed(2)} nats`));
  const svg = el("svg:svg", {
    width: label + size + 4, height: label + size + 4, tabindex: 0, role: "img",
    "aria-label": `${panel.title} heatmap, ${n} by ${n}; arrow keys read the weights`,
  });
  const grid = el("svg:g", { transform: `translate(${label},${label})` });
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < n; j++) {
      const w = panel.weights[i][j];
      grid.append(el("svg:rect", {
        x: j * cell, y: i * cell, width: cell, height: cell, fill: colour(w / scaleMax),
        class: "cell", "data-q": i, "data-k": j, "data-w": String(w),
      }));
    }
  }
  grid.append(el("svg:rect", { x: 0, y: 0, width: size, height: size, fill: "none", stroke: "#888" }));
  const cursor = el("svg:rect", { class: "cursor", width: cell, height: cell, visibility: "hidden" });
  grid.append(cursor);
  svg.append(grid);
  tokens.forEach((t, i) => {
    svg.append(el("svg:text", { x: label - 4, y: label + i * cell + cell / 2 + 4, "text-anchor": "end" }, t));
    const x = label + i * cell + cell / 2 + 4;
    svg.append(el("svg:text", { x, y: label - 4, transform: `rotate(-90 ${x} ${label - 4})` }, t));
  });

  const describe = (i, j) => `${panel.title}: "${tokens[i]}" (query ${i}) \u2192 "${tokens[j]}" (key ${j}) = ` +
    panel.weights[i][j].toFixed(6);
  grid.addEventListener("mousemove", (e) => {
    const c = e.target.closest(".cell");
    if (!c) return;
    const tip = $("tooltip");
    tip.textContent = describe(Number(c.dataset.q), Number(c.dataset.k));
    tip.hidden = false;
    tip.style.left = `${e.clientX + 14}px`;
    tip.style.top = `${e.clientY + 14}px`;
  });
  grid.addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
  let at = [0, 0];
  const show = () => {
    cursor.setAttribute("x", at[1] * cell);
    cursor.setAttribute("y", at[0] * cell);
    cursor.setAttribute("visibility", "visible");
    $("readout").textContent = describe(at[0], at[1]);
  };
  svg.addEventListener("focus", show);
  svg.addEventListener("blur", () => cursor.setAttribute("visibility", "hidden"));
  svg.addEventListener("keydown", (e) => {
    const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] };
    if (!moves[e.key]) return;
    e.preventDefault();
    at = [Math.min(n - 1, Math.max(0, at[0] + moves[e.key][0])), Math.min(n - 1, Math.max(0, at[1] + moves[e.key][1]))];
    show();
  });
  div.append(svg);
  return div;
}

// BertViz-style: queries on the left, keys on the right, a line per weight.
function drawHeadView() {
  const r = state.response, all = panels();
  const chosen = all.find((p) => String(p.head) === $("headview-head").value) || all[all.length - 1];
  const n = r.tokens.length, row = 22, width = 420, left = 110, right = width - 110;
  const svg = el("svg:svg", { width, height: n * row + 10, role: "img", "aria-label": `head view of ${chosen.title}` });
  const lines = el("svg:g");
  const maxW = largest(chosen.weights);
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < n; j++) {
      const w = chosen.weights[i][j];
      if (w < 0.01 * maxW) continue;
      lines.append(el("svg:line", {
        x1: left + 6, y1: i * row + 16, x2: right - 6, y2: j * row + 16, "data-q": i, "data-k": j, "data-w": String(w),
        "stroke-width": (0.5 + 7 * w).toFixed(2), "stroke-opacity": (0.15 + 0.85 * w / maxW).toFixed(2),
      }));
    }
  }
  svg.append(lines);
  const focusQuery = (i) => {
    for (const line of lines.children) line.setAttribute("visibility", i === null || Number(line.dataset.q) === i ? "visible" : "hidden");
    for (const t of svg.querySelectorAll("text.query")) t.classList.toggle("active", Number(t.dataset.q) === i);
  };
  r.tokens.forEach((t, i) => {
    const q = el("svg:text", { x: left, y: i * row + 20, "text-anchor": "end", class: "query", "data-q": i, tabindex: 0 }, t);
    q.addEventListener("mouseenter", () => focusQuery(i));
    q.addEventListener("focus", () => focusQuery(i));
    q.addEventListener("mouseleave", () => focusQuery(null));
    q.addEventListener("blur", () => focusQuery(null));
    svg.append(q);
    svg.append(el("svg:text", { x: right, y: i * row + 20 }, t));
  });
  $("headview").replaceChildren(svg);
}

// A trained model's every head, small, layers as rows.
function drawOverview() {
  const r = state.response, n = r.tokens.length, heads = r.layers[0].weights.length;
  const box = $("overview");
  box.style.gridTemplateColumns = `auto repeat(${heads}, auto)`;
  const items = [el("span")];
  for (let h = 0; h < heads; h++) items.push(el("span", { class: "col-label" }, `head ${h}`));
  const scale = Math.max(4, Math.floor(72 / n)), size = n * scale;
  r.layers.forEach((layer, l) => {
    items.push(el("span", { class: "row-label" }, `layer ${l}`));
    layer.weights.forEach((w, h) => {
      const canvas = el("canvas", {
        width: size, height: size, tabindex: 0, role: "button", class: "thumb" + (l === state.layer ? " selected" : ""),
        "aria-label": `layer ${l} head ${h}, entropy ${layer.entropy[h].toFixed(2)} nats`,
        title: `layer ${l} head ${h}: entropy ${layer.entropy[h].toFixed(2)} nats`,
      });
      const g = canvas.getContext("2d");
      const m = largest(w);
      for (let i = 0; i < n; i++) for (let j = 0; j < n; j++) {
        g.fillStyle = colour(w[i][j] / m);
        g.fillRect(j * scale, i * scale, scale, scale);
      }
      const choose = () => { state.layer = l; render(); $("headview-head").value = String(h); drawHeadView(); };
      canvas.addEventListener("click", choose);
      canvas.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); choose(); } });
      items.push(canvas);
    });
  });
  box.replaceChildren(...items);
}

// ---- Start

async function loadModels() {
  try {
    const reply = await fetch("/api/models");
    state.models = (await reply.json()).models || [];
  } catch (e) {
    state.models = [];
  }
  for (const m of state.models) {
    $("source").append(el("option", { value: m.name },
      `model ${m.name}: ${m.layers} layers x ${m.heads} heads, task ${m.task}`));
  }
}

function start() {
  $("controls").addEventListener("submit", (e) => e.preventDefault());
  $("temperature").addEventListener("input", () => { state.preset = null; });
  for (const id of ["text", "seed", "window-left", "window-right", "padding-length", "mask-text", "temperature"]) {
    $(id).addEventListener("input", update);
  }
  for (const id of ["chars", "heads", "embed", "source"]) $(id).addEventListener("change", update);
  for (const radio of document.querySelectorAll('input[name="mask-kind"]')) radio.addEventListener("change", update);
  for (const button of document.querySelectorAll("[data-temperature]")) {
    button.addEventListener("click", () => {
      $("temperature").value = temperatureToSlider(Number(button.dataset.temperature));
      state.preset = Number(button.dataset.temperature);
      update();
    });
  }
  $("layer").addEventListener("change", () => { state.layer = Number($("layer").value); render(); });
  $("headview-head").addEventListener("change", drawHeadView);
  loadModels().then(update);
}

start();
