// qkv attention explorer: reads the controls, asks POST /api/attention (tools/qkv/serve_api.hpp)
// for weights and draws them: per-head heatmaps and their average (canvas, one pixel block per
// weight), a head view (canvas, headview.js), and for a trained model a layers x heads overview
// (canvas). Nothing is loaded from anywhere but this server.
//
// Colours are honest by default: one fixed scale, 0 white to 1 dark blue, for every panel, so a
// near-uniform head at T = 5 looks pale; "stretch" rescales each panel to its own largest
// weight. Pairs the mask hides (the answer's "visible") are hatched grey, never a weight's colour.
//
// A Hugging Face model folder (an answer of "kind": "pretrained") adds BertViz's views: the model
// view (layers x heads thumbnails, with role badges) at the top, opened at the layer whose heads
// have the most named roles; the head view with every head of the layer overlaid in its own
// colour, each toggled on or off, beside the heatmaps; the model's prediction; and the neuron
// view of a hovered cell (q, k, q*k, the score, the row's softmax; asked of the API's "neuron").
//
// Speed: an input sends at once, further inputs within THROTTLE_MS are folded into one later
// request, a newer request aborts the one in flight (AbortController), and only the newest
// answer is drawn. window.qkvLastRedraw holds the last input-to-drawn times (ms).
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

// Sequential colour scale (white to dark blue), t in [0, 1]; tests/serve/test_browser.py
// computes the same colours to check the pixels.
const RAMP = [[255, 255, 255], [198, 219, 239], [107, 174, 214], [33, 113, 181], [8, 48, 107]];
function rampRgb(t) {
  t = t > 0 ? Math.min(1, t) : 0;
  const x = t * (RAMP.length - 1), i = Math.min(RAMP.length - 2, Math.floor(x)), f = x - i;
  const a = RAMP[i], b = RAMP[i + 1];
  return [Math.round(a[0] + (b[0] - a[0]) * f), Math.round(a[1] + (b[1] - a[1]) * f), Math.round(a[2] + (b[2] - a[2]) * f)];
}
function colour(t) {
  const c = rampRgb(t);
  return `rgb(${c[0]}, ${c[1]}, ${c[2]})`;
}
// A masked pair: light grey, hatched with darker grey lines at 45 degrees (every 6 px).
const MASKED = [222, 222, 222], HATCH = [140, 140, 140], HATCH_STEP = 6;

// The largest value of nested arrays (a loop: spreading 16 heads x 64 x 64 numbers into
// Math.max could overflow the call stack), at least 1e-6 so a scale never divides by 0.
function largest(nested) {
  let m = 1e-6;
  for (const v of nested.flat(Infinity)) if (v > m) m = v;
  return m;
}

// A weight as the page prints it: 4 significant digits, what the API sends.
function formatWeight(w) {
  return w === 0 ? "0" : w.toPrecision(4);
}

function el(tag, attributes = {}, text) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  // "style" through the CSSOM: the page's Content-Security-Policy (default-src 'self') drops
  // style attributes set as markup or by setAttribute, but not style.cssText.
  for (const [k, v] of Object.entries(attributes)) {
    if (k === "style") node.style.cssText = v; else node.setAttribute(k, v);
  }
  if (text !== undefined) node.textContent = text;
  return node;
}

const state = {
  models: [],        // GET /api/models
  response: null,    // the last good answer of /api/attention
  layer: 0,          // the layer shown (trained model)
  controller: null,  // the AbortController of the request in flight; a newer one aborts it
  preset: null,      // a preset button's exact temperature, until the slider moves
  inputAt: 0,        // performance.now() of the latest input event
  views: [],         // the heatmap panels' elements, reused while their number stays
  geometry: null,    // the heatmaps' sizes: {cell, label, size, every, columns}
  width: null,       // the heatmaps' container's width (px), kept by a ResizeObserver
  shownModel: null,  // the model folder whose first layer was last chosen (a new model opens at its first_layer)
  hiddenHeads: new Set(),  // heads the head view's toggles turned off (a model folder's)
  neuron: null,      // {key, controller, at}: the neuron view's request and the cell it is for
};

// The chosen source is a Hugging Face model folder.
function pretrainedSelected() {
  const m = state.models.find((x) => x.name === $("source").value);
  return !!m && m.kind === "pretrained";
}

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
  if (pretrainedSelected()) return { text: $("text").value, model: $("source").value };
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
  $("temperature-value").textContent = temperature();
  const model = $("source").value !== "";
  $("layer-controls").disabled = model;
  $("temperature-controls").disabled = model;
  $("mask-controls").disabled = pretrainedSelected();
  $("chars").disabled = pretrainedSelected();
  $("temperature-help").textContent = model
    ? "A trained model runs as trained (T = 1); the temperature is the untrained layer's."
    : "Logarithmic, 0.05 to 5. Low T: nearly one-hot; high T: nearly uniform.";
}

// Every input: send at once when nothing was sent in the last THROTTLE_MS, else once when that
// time is up, with the controls as they are then (a slider dragged or a word typed is one
// request per THROTTLE_MS, not one per event).
const THROTTLE_MS = 40;
let cooling = false, dirty = false;
function update() {
  state.inputAt = performance.now();
  syncControls();
  dirty = true;
  if (!cooling) flush();
}
function flush() {
  cooling = dirty;
  if (!dirty) return;
  dirty = false;
  send(state.inputAt);
  setTimeout(flush, THROTTLE_MS);
}

async function send(inputAt) {
  const request = buildRequest();
  if (state.controller) state.controller.abort();  // its answer would be stale
  const controller = new AbortController();
  state.controller = controller;
  $("status").textContent = "computing...";
  const sentAt = performance.now();
  let answer, status;
  try {
    const reply = await fetch("/api/attention", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(request),
      signal: controller.signal,
    });
    status = reply.status;
    answer = await reply.json();
  } catch (e) {
    if (state.controller !== controller) return;  // aborted for a newer request
    state.controller = null;
    showError(`the server did not answer (${e.message}); is qkv serve still running?`);
    return;
  }
  if (state.controller !== controller) return;
  state.controller = null;
  const receivedAt = performance.now();
  if (status !== 200) {
    showError(answer.error || `HTTP ${status}`);
    return;
  }
  $("error").hidden = true;
  $("mask-error").hidden = true;
  state.response = answer;
  if (answer.kind === "pretrained" && state.shownModel !== answer.model) {
    state.layer = answer.first_layer;  // the layer whose heads have the most named roles
    state.shownModel = answer.model;
    state.hiddenHeads.clear();
  }
  if (answer.kind !== "pretrained") state.shownModel = null;
  if (answer.layers) state.layer = Math.min(state.layer, answer.layers.length - 1);
  render(true);
  const drawnAt = performance.now();
  // Input to drawn, and its parts: waiting for the server (and the JSON), drawing.
  window.qkvLastRedraw = { total: drawnAt - inputAt, server: receivedAt - sentAt, draw: drawnAt - receivedAt,
                           tokens: answer.tokens.length, panels: panels().length };
  window.qkvLastRedrawMs = drawnAt - inputAt;
  // What the page shows, for anyone (the browser test) who wants to ask the API the same.
  document.body.dataset.request = JSON.stringify(request);
  // Then to the frame after it (`painted`: the browser's own layout, paint and compositing of what
  // was drawn), and only then the head view's lines, whose rasterising (thousands of anti-aliased
  // lines at 64 tokens, about 15 ms, done when the task ends) would otherwise hold that frame back;
  // `complete`: to the frame after them. The render counts as done (data-renders) once all is.
  const shown = window.qkvLastRedraw;
  afterNextFrame(() => {
    shown.painted = performance.now() - inputAt;
    if (state.response === answer) paintHeadView();
    afterNextFrame(() => { shown.complete = performance.now() - inputAt; });
    document.body.dataset.renders = String(Number(document.body.dataset.renders || 0) + 1);
  });
  $("status").textContent = (answer.kind === "pretrained"
    ? `model ${answer.model}: ${answer.note}; ${answer.first_layer_why}`
    : answer.model
    ? `model ${answer.model} (task ${answer.task}), ${answer.tokens.length} tokens ${answer.note}`
    : `${answer.tokens.length} tokens, ${answer.heads} heads x ${answer.embed / answer.heads} dims, ` +
      `T = ${answer.temperature}, mask ${answer.mask}, seed ${answer.seed}`) +
    `; drawn ${Math.round(drawnAt - inputAt)} ms after the input`;
}

// Runs `then` once the browser has shown the next frame (its rendering steps done).
function afterNextFrame(then) {
  requestAnimationFrame(() => setTimeout(then, 0));
}

// A mask the server refused (its message starts "mask") is shown beside the mask's inputs, and
// "Applied:" keeps the mask the heatmaps were drawn with; any other error above the heatmaps.
function showError(message) {
  const mask = message.startsWith("mask");
  $("mask-error").textContent = mask ? message : "";
  $("mask-error").hidden = !mask;
  $("error").textContent = mask ? "" : message;
  $("error").hidden = mask;
  $("status").textContent = mask ? "the heatmaps still show the last mask that worked" : "";
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
  const roles = r.layers ? r.layers[state.layer].roles : null;
  const out = heads.map((w, h) => ({ title: `head ${h}`, weights: w, entropy: entropy[h], head: h,
                                     role: roles && roles[h] ? roles[h].role : null }));
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

// True when the mask lets query i see key j (an answer without "visible" hides nothing).
function isVisible(i, j) {
  const v = state.response.visible;
  return !v || v[i].charCodeAt(j) === 49;  // "1"
}

// The top of a panel's colour scale: 1, or with "stretch" the panel's own largest weight.
function scaleTop(weights) {
  return $("stretch").checked ? largest(weights) : 1;
}

// Draws the answer in hand; `deferHeadView`: all but the head view's lines (send paints them after
// the heatmaps' frame).
function render(deferHeadView = false) {
  const r = state.response, all = panels();
  drawLegend();
  $("mask-applied").textContent = r.mask;
  $("uniform-note").textContent = `uniform over all ${r.tokens.length} keys = ${r.uniform_entropy.toFixed(2)} nats.`;
  $("layer-picker").hidden = !r.layers;
  if (r.layers) {
    const picker = $("layer");
    if (picker.options.length !== r.layers.length) {
      picker.replaceChildren(...r.layers.map((_, l) => el("option", { value: l }, `layer ${l}`)));
    }
    picker.value = state.layer;
  }
  const pretrained = r.kind === "pretrained";
  document.body.classList.toggle("pretrained", pretrained);
  $("headview-picker").hidden = pretrained;
  $("headview-toggles").hidden = !pretrained;
  $("roles-help").hidden = !pretrained;
  $("prediction-section").hidden = !pretrained || !r.prediction;
  $("neuron-section").hidden = !pretrained;
  if (pretrained) drawPrediction();
  drawHeatmaps();
  const chosen = $("headview-head").value;
  $("headview-head").replaceChildren(...all.map((p) => el("option", { value: p.head }, p.title)));
  $("headview-head").value = all.some((p) => String(p.head) === chosen) ? chosen : String(all[all.length - 1].head);
  if (pretrained) drawHeadViewAll(deferHeadView); else drawHeadView(deferHeadView);
  $("overview-section").hidden = !r.layers;
  if (r.layers) drawOverview();
}

function drawLegend() {
  const width = 240, stretch = $("stretch").checked;
  const svg = el("svg:svg", { width: width + 230, height: 34, role: "img" });
  const steps = 48;
  for (let s = 0; s < steps; s++) {
    svg.append(el("svg:rect", { x: 10 + (s * width) / steps, y: 2, width: width / steps + 0.5, height: 14, fill: colour(s / (steps - 1)) }));
  }
  svg.append(el("svg:rect", { x: 10, y: 2, width, height: 14, fill: "none", stroke: "#888" }));
  svg.append(el("svg:text", { x: 10, y: 30, "font-size": 11 }, "0"));
  svg.append(el("svg:text", { x: 10 + width, y: 30, "font-size": 11, "text-anchor": "end" },
    stretch ? "each panel's largest" : "1"));
  svg.append(el("svg:text", { x: width + 18, y: 14, "font-size": 11 }, "weight"));
  // The masked swatch: grey with the heatmaps' hatching.
  const x = width + 70;
  svg.append(el("svg:rect", { x, y: 2, width: 14, height: 14, fill: `rgb(${MASKED})`, stroke: "#888" }));
  for (let c = -14 + 3; c < 14; c += HATCH_STEP) {
    svg.append(el("svg:line", { x1: x + Math.max(0, c), y1: 2 + Math.max(0, -c), x2: x + Math.min(14, 14 + c), y2: 2 + Math.min(14, 14 - c),
      stroke: `rgb(${HATCH})`, "stroke-width": 1 }));
  }
  svg.append(el("svg:text", { x: x + 20, y: 14, "font-size": 11 }, "masked (no weight)"));
  $("legend").replaceChildren(svg);
}

// A trained model's every head, small, layers as rows.
function drawOverview() {
  const r = state.response, n = r.tokens.length, heads = r.layers[0].weights.length;
  const box = $("overview");
  box.style.gridTemplateColumns = `auto repeat(${heads}, auto)`;
  const items = [el("span")];
  for (let h = 0; h < heads; h++) items.push(el("span", { class: "col-label" }, `head ${h}`));
  // A model folder may have 30 layers x 16 heads: its thumbnails stay 64 px whatever the tokens.
  const size = r.kind === "pretrained" ? 64 : n * Math.max(4, Math.floor(72 / n));
  r.layers.forEach((layer, l) => {
    const first = r.kind === "pretrained" && l === r.first_layer;
    items.push(el("span", { class: "row-label" + (first ? " first" : ""), title: first ? r.first_layer_why : "" },
      first ? `layer ${l} ★` : `layer ${l}`));
    layer.weights.forEach((w, h) => {
      const canvas = el("canvas", {
        width: size, height: size, tabindex: 0, role: "button", class: "thumb" + (l === state.layer ? " selected" : ""),
        "aria-label": `layer ${l} head ${h}, entropy ${layer.entropy[h].toFixed(2)} nats`,
        title: `layer ${l} head ${h}: entropy ${layer.entropy[h].toFixed(2)} nats`,
      });
      const g = canvas.getContext("2d");
      g.imageSmoothingEnabled = false;
      g.drawImage(cellImage(w, scaleTop(w)), 0, 0, n, n, 0, 0, size, size);
      const choose = () => {
        state.layer = l;
        render();
        if (r.kind === "pretrained") return;  // its head view overlays every head of the layer
        $("headview-head").value = String(h);
        drawHeadView();
      };
      canvas.addEventListener("click", choose);
      canvas.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); choose(); } });
      canvas.dataset.layer = l;
      canvas.dataset.head = h;
      const role = layer.roles && layer.roles[h] ? layer.roles[h].role : null;
      if (!role) { items.push(canvas); return; }
      const cell = el("div", { class: "cell" });
      cell.append(canvas);
      if (role !== "-") cell.append(badge(role));
      items.push(cell);
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
    $("source").append(el("option", { value: m.name }, m.kind === "pretrained"
      ? `model ${m.name}: ${m.architecture}, ${m.layers} layers x ${m.heads} heads, vocabulary ${m.vocab_size}`
      : `model ${m.name}: ${m.layers} layers x ${m.heads} heads, task ${m.task}`));
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
  $("stretch").addEventListener("change", () => { if (state.response) render(); });
  // A new width: new panel sizes, drawn from the answer in hand (no request).
  new ResizeObserver((entries) => {
    state.width = entries[entries.length - 1].contentRect.width;
    if (!state.response || !state.geometry) return;
    const g = state.geometry, next = heatmapGeometry(state.response.tokens, state.views.length);
    if (g.cell !== next.cell || g.columns !== next.columns) drawHeatmaps();
  }).observe($("heatmaps"));
  $("headview-head").addEventListener("change", () => drawHeadView());
  loadModels().then(update);
}

start();
