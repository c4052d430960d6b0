// qkv attention explorer: reads the controls, asks POST /api/attention (tools/qkv/serve_api.hpp)
// for weights and draws them: per-head heatmaps and their average (canvas, one pixel block per
// weight), a head view (SVG), and for a trained model a layers x heads overview (canvas). Nothing
// is loaded from anywhere but this server.
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
  for (const [k, v] of Object.entries(attributes)) node.setAttribute(k, v);
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
  render();
  const drawnAt = performance.now();
  // Input to drawn, and its parts: waiting for the server (and the JSON), drawing.
  window.qkvLastRedraw = { total: drawnAt - inputAt, server: receivedAt - sentAt, draw: drawnAt - receivedAt,
                           tokens: answer.tokens.length, panels: panels().length };
  window.qkvLastRedrawMs = drawnAt - inputAt;
  // And to the frame after it: the browser's own layout and paint of what was drawn.
  const shown = window.qkvLastRedraw;
  requestAnimationFrame(() => setTimeout(() => { shown.painted = performance.now() - inputAt; }, 0));
  // What the page shows, for anyone (the browser test) who wants to ask the API the same.
  document.body.dataset.request = JSON.stringify(request);
  document.body.dataset.renders = String(Number(document.body.dataset.renders || 0) + 1);
  $("status").textContent = (answer.kind === "pretrained"
    ? `model ${answer.model}: ${answer.note}; ${answer.first_layer_why}`
    : answer.model
    ? `model ${answer.model} (task ${answer.task}), ${answer.tokens.length} tokens ${answer.note}`
    : `${answer.tokens.length} tokens, ${answer.heads} heads x ${answer.embed / answer.heads} dims, ` +
      `T = ${answer.temperature}, mask ${answer.mask}, seed ${answer.seed}`) +
    `; drawn ${Math.round(drawnAt - inputAt)} ms after the input`;
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

function render() {
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
  if (pretrained) drawHeadViewAll(); else drawHeadView();
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

// ---- Heatmaps on canvas

const LABEL_FONT = '11px "DejaVu Sans", system-ui, sans-serif';
const PANEL_PAD = 8, PANEL_GAP = 12, MAX_LABEL = 90, MAX_GRID = 460;
let measurer = null;
function textWidth(text) {
  measurer ??= document.createElement("canvas").getContext("2d");
  measurer.font = LABEL_FONT;
  return measurer.measureText(text).width;
}
// A label cut to fit `room` px, with an ellipsis.
function fitLabel(text, room) {
  if (textWidth(text) <= room) return text;
  while (text.length > 1 && textWidth(text + "\u2026") > room) text = text.slice(0, -1);
  return text + "\u2026";
}

// Sizes for n tokens and `count` panels in the width the page has: as many columns as fit with
// grids of at least minGrid px, then the grids as large as the columns allow (up to MAX_GRID).
// Labels are thinned, as `qkv viz` does (tools/qkv/plot.cpp), to every k-th token when cells
// are smaller than the text.
function heatmapGeometry(tokens, count) {
  // The width as the ResizeObserver last saw it: reading clientWidth here, after the render's
  // other changes, would force a layout of the whole page (the head view's thousands of lines).
  state.width ??= $("heatmaps").clientWidth;
  const n = tokens.length, width = Math.max(320, state.width);
  const label = Math.ceil(Math.min(MAX_LABEL, Math.max(...tokens.map(textWidth)))) + 8;
  const minGrid = Math.min(260, Math.max(150, 4 * n));
  const outer = (grid) => grid + label + 2 * PANEL_PAD + 2;
  const columns = Math.max(1, Math.min(count, Math.floor((width + PANEL_GAP) / (outer(minGrid) + PANEL_GAP))));
  const grid = Math.min(MAX_GRID, Math.floor((width + PANEL_GAP) / columns - PANEL_GAP - (outer(0))));
  const cell = Math.max(2, Math.floor(grid / n));
  const every = Math.max(1, Math.ceil(13.75 / cell));  // a label is 11 px tall, 1.25 x for room
  return { cell, label, size: cell * n, every, columns, n };
}

// The 6 x 6 tile of the masked cells' hatching (a canvas pattern, anchored at the grid's corner):
// grey, with the pixels where (x - y) mod 6 == 3 darker.
let hatchTile = null;
function hatchPattern(ctx) {
  if (!hatchTile) {
    hatchTile = document.createElement("canvas");
    hatchTile.width = hatchTile.height = HATCH_STEP;
    const g = hatchTile.getContext("2d"), img = g.createImageData(HATCH_STEP, HATCH_STEP);
    for (let y = 0; y < HATCH_STEP; y++) for (let x = 0; x < HATCH_STEP; x++) {
      const c = (((x - y) % HATCH_STEP) + HATCH_STEP) % HATCH_STEP === 3 ? HATCH : MASKED, o = 4 * (y * HATCH_STEP + x);
      img.data[o] = c[0]; img.data[o + 1] = c[1]; img.data[o + 2] = c[2]; img.data[o + 3] = 255;
    }
    g.putImageData(img, 0, 0);
  }
  return ctx.createPattern(hatchTile, "repeat");
}

// An n x n image, one pixel per weight (masked pairs the MASKED grey), to be scaled up without
// smoothing: one drawImage per panel instead of n * n rectangles.
let cellsCanvas = null;
function cellImage(weights, top) {
  const n = weights.length;
  cellsCanvas ??= document.createElement("canvas");
  cellsCanvas.width = cellsCanvas.height = n;
  const g = cellsCanvas.getContext("2d"), img = g.createImageData(n, n), data = img.data;
  for (let i = 0, o = 0; i < n; i++) {
    const row = weights[i];
    for (let j = 0; j < n; j++, o += 4) {
      const c = isVisible(i, j) ? rampRgb(row[j] / top) : MASKED;
      data[o] = c[0]; data[o + 1] = c[1]; data[o + 2] = c[2]; data[o + 3] = 255;
    }
  }
  g.putImageData(img, 0, 0);
  return cellsCanvas;
}

// The masked cells as one path (grid coordinates), filled with the hatching in every panel.
function maskedPath(g) {
  const r = state.response;
  if (!r.visible || r.visible.every((row) => !row.includes("0"))) return null;
  const path = new Path2D();
  for (let i = 0; i < g.n; i++) for (let j = 0; j < g.n; j++) if (!isVisible(i, j)) path.rect(j * g.cell, i * g.cell, g.cell, g.cell);
  return path;
}

function panelView(index) {
  const view = { div: el("div", { class: "panel" }), title: el("h3"), entropy: el("p", { class: "entropy" }),
                 wrap: el("div", { class: "canvas-wrap" }), canvas: el("canvas", { tabindex: 0, role: "img" }),
                 cursor: el("div", { class: "cursor", hidden: "" }), at: [0, 0], index };
  view.wrap.append(view.canvas, view.cursor);
  view.div.append(view.title, view.entropy, view.wrap);
  const cellAt = (e) => {
    const g = state.geometry, rect = view.canvas.getBoundingClientRect();
    const i = Math.floor((e.clientY - rect.top - g.label) / g.cell), j = Math.floor((e.clientX - rect.left - g.label) / g.cell);
    return i >= 0 && j >= 0 && i < g.n && j < g.n ? [i, j] : null;
  };
  view.canvas.addEventListener("mousemove", (e) => {
    const at = cellAt(e), tip = $("tooltip");
    if (!at) { tip.hidden = true; return; }
    tip.textContent = describe(view, at[0], at[1]);
    tip.hidden = false;
    askNeuron(view, at[0], at[1]);
    tip.style.left = `${e.clientX + 14}px`;
    tip.style.top = `${e.clientY + 14}px`;
  });
  view.canvas.addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
  view.canvas.addEventListener("focus", () => showCursor(view));
  view.canvas.addEventListener("blur", () => { view.cursor.hidden = true; });
  view.canvas.addEventListener("keydown", (e) => {
    const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] };
    if (!moves[e.key]) return;
    e.preventDefault();
    const n = state.geometry.n;
    view.at = [Math.min(n - 1, Math.max(0, view.at[0] + moves[e.key][0])), Math.min(n - 1, Math.max(0, view.at[1] + moves[e.key][1]))];
    showCursor(view);
    askNeuron(view, view.at[0], view.at[1]);
  });
  return view;
}

function describe(view, i, j) {
  const panel = panels()[view.index], tokens = state.response.tokens;
  const pair = `${panel.title}: "${tokens[i]}" (query ${i}) \u2192 "${tokens[j]}" (key ${j})`;
  return isVisible(i, j) ? `${pair} = ${formatWeight(panel.weights[i][j])}` : `${pair}: masked, no weight`;
}

function showCursor(view) {
  const g = state.geometry, [i, j] = view.at = view.at.map((a) => Math.min(a, g.n - 1));
  Object.assign(view.cursor.style, { left: `${g.label + j * g.cell - 1}px`, top: `${g.label + i * g.cell - 1}px`,
                                     width: `${g.cell + 2}px`, height: `${g.cell + 2}px` });
  view.cursor.hidden = document.activeElement !== view.canvas;
  $("readout").textContent = describe(view, i, j);
}

function drawHeatmaps() {
  const r = state.response, all = panels(), tokens = r.tokens, n = tokens.length;
  const g = state.geometry = heatmapGeometry(tokens, all.length);
  const container = $("heatmaps");
  container.style.gridTemplateColumns = `repeat(${g.columns}, max-content)`;
  if (state.views.length !== all.length) {
    state.views = all.map((_, p) => panelView(p));
    container.replaceChildren(...state.views.map((v) => v.div));
  }
  const dpr = window.devicePixelRatio || 1, side = g.label + g.size + 2, hatched = maskedPath(g);
  const colLabels = [], rowLabels = [];
  for (let i = 0; i < n; i += g.every) {
    rowLabels.push([i, fitLabel(tokens[i], g.label - 6)]);
    colLabels.push([i, fitLabel(tokens[i], g.label - 6)]);
  }
  g.labels = rowLabels.map(([i, text]) => [i, text]);  // what each axis shows, for the browser test
  all.forEach((panel, p) => {
    const view = state.views[p], canvas = view.canvas, top = scaleTop(panel.weights);
    view.div.dataset.head = panel.head;
    view.title.textContent = panel.title;
    if (panel.role && panel.role !== "-") view.title.append(badge(panel.role));
    view.entropy.textContent = `entropy ${panel.entropy.toFixed(2)} nats` +
      ($("stretch").checked ? `; colours 0 to ${formatWeight(top)}` : "");
    canvas.setAttribute("aria-label", `${panel.title} heatmap, ${n} by ${n}; arrow keys read the weights`);
    view.div.style.width = `${side}px`;  // longer titles wrap instead of widening the column
    if (canvas.width !== Math.round(side * dpr) || canvas.height !== Math.round(side * dpr)) {
      canvas.width = canvas.height = Math.round(side * dpr);
      canvas.style.width = canvas.style.height = `${side}px`;
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, side, side);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(cellImage(panel.weights, top), 0, 0, n, n, g.label, g.label, g.size, g.size);
    if (hatched) {
      ctx.save();
      ctx.translate(g.label, g.label);
      ctx.fillStyle = hatchPattern(ctx);
      ctx.fill(hatched);
      ctx.restore();
    }
    ctx.strokeStyle = "#888";
    ctx.lineWidth = 1;
    ctx.strokeRect(g.label - 0.5, g.label - 0.5, g.size + 1, g.size + 1);
    ctx.font = LABEL_FONT;
    ctx.fillStyle = "#1b1f24";
    ctx.textAlign = "right";
    for (const [i, text] of rowLabels) ctx.fillText(text, g.label - 4, g.label + i * g.cell + g.cell / 2 + 4);
    ctx.textAlign = "left";
    for (const [j, text] of colLabels) {
      ctx.save();
      ctx.translate(g.label + j * g.cell + g.cell / 2 + 4, g.label - 4);
      ctx.rotate(-Math.PI / 2);
      ctx.fillText(text, 0, 0);
      ctx.restore();
    }
    if (document.activeElement === canvas) showCursor(view);
  });
}

// For the browser test: where panel `head`'s cells are on its canvas, in canvas pixels.
window.qkvExplorer = {
  geometry() {
    const g = state.geometry, dpr = window.devicePixelRatio || 1;
    return { ...g, dpr, x0: g.label * dpr, y0: g.label * dpr, step: g.cell * dpr };
  },
  colour: rampRgb,
};

// BertViz-style: queries on the left, keys on the right, a line per weight.
function drawHeadView() {
  const r = state.response, all = panels();
  const chosen = all.find((p) => String(p.head) === $("headview-head").value) || all[all.length - 1];
  const n = r.tokens.length, row = 22, width = 420, left = 110, right = width - 110;
  const svg = el("svg:svg", { width, height: n * row + 10, role: "img", "aria-label": `head view of ${chosen.title}` });
  const lines = el("svg:g");
  const maxW = largest(chosen.weights);
  // One markup string, parsed once: 64 x 64 lines built element by element took 30-120 ms.
  const markup = [];
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < n; j++) {
      const w = chosen.weights[i][j];
      if (w < 0.01 * maxW) continue;
      markup.push(`<line x1="${left + 6}" y1="${i * row + 16}" x2="${right - 6}" y2="${j * row + 16}" data-q="${i}" ` +
        `data-k="${j}" data-w="${w}" stroke-width="${(0.5 + 7 * w).toFixed(2)}" stroke-opacity="${(0.15 + 0.85 * w / maxW).toFixed(2)}"/>`);
    }
  }
  lines.innerHTML = markup.join("");
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

// ---- A model folder's views: role badges, the prediction, every head overlaid, the neuron view

const ROLE_SHORT = { "previous-token": "prev", "first-token": "first", self: "self", induction: "induction", broad: "broad" };
function badge(role) {
  return el("span", { class: `badge ${role}`, title: `role: ${role}` }, ROLE_SHORT[role] || role);
}

// The next token's top 5, or each [MASK]'s top 5 fills, as bars.
function drawPrediction() {
  const p = state.response.prediction, box = $("prediction");
  if (!p) { box.replaceChildren(); return; }
  const list = (top) => {
    const ol = el("ol");
    for (const t of top) {
      const li = el("li", {}, `${t.token}  ${(100 * t.p).toFixed(1)}%`);
      li.dataset.p = t.p;
      li.append(el("span", { class: "bar", style: `width: ${Math.max(1, Math.round(160 * t.p))}px` }));
      ol.append(li);
    }
    return ol;
  };
  const items = [];
  if (p.kind === "next") {
    items.push(el("p", { class: "help" }, "The next token, most likely first (softmax of the last position's logits):"), list(p.top));
  } else if (!p.masks.length) {
    items.push(el("p", { class: "help" }, `Put ${p.mask_token || "[MASK]"} in the text to see the model fill it.`));
  } else {
    for (const m of p.masks) {
      items.push(el("p", { class: "help" }, `${p.mask_token} at token ${m.position}: the fills, most likely first:`), list(m.top));
    }
  }
  box.replaceChildren(...items);
}

// A head's colour in the head view: hues around the wheel.
function headColour(h, heads) {
  return `hsl(${Math.round((360 * h) / heads)}, 70%, 42%)`;
}

// BertViz's head view: every head of the layer at once, each in its own colour, toggled by its
// checkbox; hovering (or focusing) a query token on the left keeps only its lines.
function drawHeadViewAll() {
  const r = state.response, layer = r.layers[state.layer], heads = layer.weights.length, n = r.tokens.length;
  const toggles = $("headview-toggles");
  toggles.replaceChildren(...layer.weights.map((_, h) => {
    const box = el("input", { type: "checkbox", "data-head": h });
    box.checked = !state.hiddenHeads.has(h);
    box.addEventListener("change", () => {
      if (box.checked) state.hiddenHeads.delete(h); else state.hiddenHeads.add(h);
      for (const g of $("headview").querySelectorAll(`g[data-head="${h}"]`)) g.setAttribute("visibility", box.checked ? "visible" : "hidden");
    });
    const label = el("label");
    label.append(box, el("span", { class: "swatch", style: `background: ${headColour(h, heads)}` }), `head ${h}`);
    if (layer.roles && layer.roles[h] && layer.roles[h].role !== "-") label.append(badge(layer.roles[h].role));
    return label;
  }));
  const row = 22, width = 360, left = 100, right = width - 100;
  const svg = el("svg:svg", { width, height: n * row + 10, role: "img",
                              "aria-label": `head view of layer ${state.layer}, ${heads} heads overlaid` });
  const groups = [];
  layer.weights.forEach((w, h) => {
    const markup = [];
    for (let i = 0; i < n; i++) for (let j = 0; j < n; j++) {
      const x = w[i][j];
      if (x < 0.02) continue;
      markup.push(`<line x1="${left + 6}" y1="${i * row + 16}" x2="${right - 6}" y2="${j * row + 16}" data-q="${i}" ` +
        `data-k="${j}" data-w="${x}" stroke-width="${(0.5 + 3 * x).toFixed(2)}" stroke-opacity="${(0.1 + 0.8 * x).toFixed(2)}"/>`);
    }
    const g = el("svg:g", { "data-head": h, stroke: headColour(h, heads),
                            visibility: state.hiddenHeads.has(h) ? "hidden" : "visible" });
    g.innerHTML = markup.join("");
    groups.push(g);
    svg.append(g);
  });
  const focusQuery = (i) => {
    for (const g of groups) for (const line of g.children) {
      line.setAttribute("visibility", i === null || Number(line.dataset.q) === i ? "inherit" : "hidden");
    }
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

// The neuron view of a hovered head cell (query i, key j): asks the API for that row's q, k and
// scores (one request in flight; a newer cell aborts it; an answer in hand is reused).
function askNeuron(view, i, j) {
  const r = state.response;
  if (!r || r.kind !== "pretrained") return;
  const panel = panels()[view.index];
  if (typeof panel.head !== "number") return;
  const key = `${r.model}|${r.ids.join(",")}|${state.layer}|${panel.head}|${i}`;
  const at = { layer: state.layer, head: panel.head, query: i, key: j };
  if (state.neuron && state.neuron.key === key) {
    state.neuron.at = at;
    if (state.neuron.answer) drawNeuron(state.neuron.answer, at);
    return;
  }
  if (state.neuron && state.neuron.controller) state.neuron.controller.abort();
  const controller = new AbortController();
  const mine = state.neuron = { key, controller, at, answer: null };
  fetch("/api/attention", {
    method: "POST", headers: { "Content-Type": "application/json" }, signal: controller.signal,
    body: JSON.stringify({ model: r.model, ids: r.ids, neuron: { layer: at.layer, head: at.head, query: i } }),
  }).then((reply) => reply.json().then((answer) => [reply.status, answer])).then(([status, answer]) => {
    if (state.neuron !== mine) return;
    mine.controller = null;
    if (status !== 200) { $("neuron").replaceChildren(el("p", { role: "alert" }, answer.error || `HTTP ${status}`)); return; }
    mine.answer = answer.neuron;
    drawNeuron(mine.answer, mine.at);
  }).catch(() => {});
}

// Numbers as the neuron view prints them.
function num(x, digits = 4) {
  return x === null || x === undefined ? "masked" : Number(x).toPrecision(digits);
}

// A vector as a strip of coloured cells (negative red, positive blue, white 0) on a canvas.
function vectorStrip(values, top, label) {
  const cell = Math.max(3, Math.min(14, Math.floor(448 / values.length)));
  const canvas = el("canvas", { width: values.length * cell, height: 14, role: "img", "aria-label": label, title: label });
  const g = canvas.getContext("2d");
  values.forEach((v, e) => {
    const t = Math.min(1, Math.abs(v) / top), c = v >= 0 ? [33, 113, 181] : [203, 24, 29];
    g.fillStyle = `rgb(${c.map((x) => Math.round(255 + (x - 255) * t)).join(",")})`;
    g.fillRect(e * cell, 0, cell, 14);
  });
  return canvas;
}

function drawNeuron(nr, at) {
  const tokens = state.response.tokens, j = at.key, i = nr.query, d = nr.head_dim;
  const q = nr.q, k = nr.k[j], product = q.map((x, e) => x * k[e]);
  const dot = product.reduce((a, b) => a + b, 0);
  const top = Math.max(1e-6, ...q.map(Math.abs), ...k.map(Math.abs));
  const topProduct = Math.max(1e-6, ...product.map(Math.abs));
  const vectors = el("div", { class: "vectors" });
  vectors.append(el("span", {}, `q ("${tokens[i]}", query ${i})`), vectorStrip(q, top, `q: ${q.map((x) => num(x, 3)).join(" ")}`),
    el("span", {}, `k ("${tokens[j]}", key ${j})`), vectorStrip(k, top, `k: ${k.map((x) => num(x, 3)).join(" ")}`),
    el("span", {}, "q × k"), vectorStrip(product, topProduct, `q*k: ${product.map((x) => num(x, 3)).join(" ")}`));
  const sums = el("p", { class: "sums" });
  const seen = nr.visible[j];
  sums.innerHTML = "";
  sums.append(`layer ${nr.layer}, head ${nr.head}${nr.kv_head !== nr.head ? ` (key head ${nr.kv_head})` : ""}, d = ${d}: `,
    "q·k = ", el("b", { id: "neuron-dot" }, num(dot)), `; × 1/√${d} = ${num(nr.scale)}: score `,
    el("b", { id: "neuron-score" }, seen ? num(nr.scores[j]) : "masked"), "; weight ",
    el("b", { id: "neuron-weight" }, seen ? num(nr.weights[j]) : "0 (masked)"),
    ` = exp(${seen ? num(nr.scores[j]) : "-∞"} − ${num(nr.max)}) / ${num(nr.sum)}`);
  const table = el("table", { id: "neuron-table" });
  const head = el("tr");
  for (const h of ["key", "score q·k/√d", "exp(score − max)", "weight = exp / sum"]) head.append(el("th", {}, h));
  table.append(head);
  nr.k.forEach((_, key) => {
    const tr = el("tr", { class: (key === j ? "hovered " : "") + (nr.visible[key] ? "" : "masked"), "data-key": key });
    tr.append(el("td", {}, `${key} "${tokens[key]}"`), el("td", {}, num(nr.scores[key])),
      el("td", {}, nr.visible[key] ? num(nr.exp[key]) : "0"), el("td", {}, nr.visible[key] ? num(nr.weights[key]) : "0"));
    table.append(tr);
  });
  const foot = el("tr");
  foot.append(el("td", {}, "row"), el("td", {}, `max ${num(nr.max)}`), el("td", {}, `sum ${num(nr.sum)}`), el("td", {}, "1"));
  table.append(foot);
  $("neuron").replaceChildren(el("p", { class: "help" },
    `"${tokens[i]}" (query ${i}) → "${tokens[j]}" (key ${j}) in layer ${nr.layer}, head ${nr.head}`), vectors, sums, table);
  $("neuron").dataset.cell = JSON.stringify([nr.layer, nr.head, i, j]);
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
  $("headview-head").addEventListener("change", drawHeadView);
  loadModels().then(update);
}

start();
