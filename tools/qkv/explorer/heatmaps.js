// qkv attention explorer: the heatmaps, one per head and their average, sized to the window,
// labels thinned as `qkv viz` thins them, masked pairs hatched. Loaded before explorer.js, whose
// state, panels() and colour scale it uses when called.
//
// Each panel's cells are a canvas of one pixel per weight (n x n), scaled up by CSS without
// smoothing (image-rendering: pixelated, an integer factor), its masked pixels transparent over a
// CSS background of the hatching; the labels are two images shared by every panel, made again
// only when the tokens or the sizes change. Chrome copies every canvas's pixels again on each
// frame it composites (with software compositing, as headless Chromium runs), whether drawn or
// not, so the canvases' area is time on every frame: 17 full-size panels at 64 tokens were 2.3
// million pixels and 15-34 ms of each frame under load, n x n cells are 70 thousand.
"use strict";

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

// The 6 x 6 tile of the masked cells' hatching, as a CSS background under the cells (anchored at
// the grid's corner): grey, with the pixels where (x - y) mod 6 == 3 darker. A data: URL (the
// page's Content-Security-Policy allows data: images).
let hatchUrl = null;
function hatchBackground() {
  if (!hatchUrl) {
    const tile = document.createElement("canvas");
    tile.width = tile.height = HATCH_STEP;
    const g = tile.getContext("2d"), img = g.createImageData(HATCH_STEP, HATCH_STEP);
    for (let y = 0; y < HATCH_STEP; y++) for (let x = 0; x < HATCH_STEP; x++) {
      const c = (((x - y) % HATCH_STEP) + HATCH_STEP) % HATCH_STEP === 3 ? HATCH : MASKED, o = 4 * (y * HATCH_STEP + x);
      img.data[o] = c[0]; img.data[o + 1] = c[1]; img.data[o + 2] = c[2]; img.data[o + 3] = 255;
    }
    g.putImageData(img, 0, 0);
    hatchUrl = `url("${tile.toDataURL()}")`;
  }
  return hatchUrl;
}

// Draws the weights on `canvas` (made n x n), one pixel per weight; masked pairs `masked` ([r, g,
// b]), or transparent when it is null.
function drawCells(canvas, weights, top, masked) {
  const n = weights.length;
  if (canvas.width !== n || canvas.height !== n) canvas.width = canvas.height = n;
  const g = canvas.getContext("2d"), img = g.createImageData(n, n), data = img.data;
  for (let i = 0, o = 0; i < n; i++) {
    const row = weights[i];
    for (let j = 0; j < n; j++, o += 4) {
      if (isVisible(i, j)) {
        const c = rampRgb(row[j] / top);
        data[o] = c[0]; data[o + 1] = c[1]; data[o + 2] = c[2]; data[o + 3] = 255;
      } else if (masked) {
        data[o] = masked[0]; data[o + 1] = masked[1]; data[o + 2] = masked[2]; data[o + 3] = 255;
      }
    }
  }
  g.putImageData(img, 0, 0);
  return canvas;
}

// An n x n image of the weights (masked pairs the MASKED grey), to be scaled up without
// smoothing (the model view's thumbnails).
let cellsCanvas = null;
function cellImage(weights, top) {
  cellsCanvas ??= document.createElement("canvas");
  return drawCells(cellsCanvas, weights, top, MASKED);
}

// The labels of both axes as two images (data: URLs), for every panel: rows right-aligned left of
// the grid, columns rotated above it. Strips `g.label` deep, the grid's side plus 6 px each end.
function labelImages(g, rowLabels) {
  const dpr = window.devicePixelRatio || 1, length = g.size + 12, canvas = document.createElement("canvas");
  const strip = (width, height, draw) => {
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.font = LABEL_FONT;
    ctx.fillStyle = "#1b1f24";
    draw(ctx);
    return canvas.toDataURL();
  };
  const rows = strip(g.label, length, (ctx) => {
    ctx.textAlign = "right";
    for (const [i, text] of rowLabels) ctx.fillText(text, g.label - 4, 6 + i * g.cell + g.cell / 2 + 4);
  });
  const columns = strip(length, g.label, (ctx) => {
    ctx.textAlign = "left";
    for (const [j, text] of rowLabels) {
      ctx.save();
      ctx.translate(6 + j * g.cell + g.cell / 2 + 4, g.label - 4);
      ctx.rotate(-Math.PI / 2);
      ctx.fillText(text, 0, 0);
      ctx.restore();
    }
  });
  return { rows, columns, key: labelsKey(g, rowLabels) };
}
function labelsKey(g, rowLabels) {
  return JSON.stringify([g.cell, g.label, g.size, window.devicePixelRatio || 1, rowLabels]);
}
let labels = null;

function panelView(index) {
  const view = { div: el("div", { class: "panel" }), title: el("h3"), entropy: el("p", { class: "entropy" }),
                 wrap: el("div", { class: "canvas-wrap" }), canvas: el("canvas", { class: "cells", tabindex: 0, role: "img" }),
                 rows: el("img", { class: "rows", alt: "" }), columns: el("img", { class: "columns", alt: "" }),
                 cursor: el("div", { class: "cursor", hidden: "" }), at: [0, 0], index, labels: null };
  view.wrap.append(view.canvas, view.rows, view.columns, view.cursor);
  view.div.append(view.title, view.entropy, view.wrap);
  const cellAt = (e) => {
    const g = state.geometry, rect = view.canvas.getBoundingClientRect();
    const i = Math.floor((e.clientY - rect.top) / g.cell), j = Math.floor((e.clientX - rect.left) / g.cell);
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
  const side = g.label + g.size + 2, hatched = r.visible && r.visible.some((row) => row.includes("0"));
  const rowLabels = [];
  for (let i = 0; i < n; i += g.every) rowLabels.push([i, fitLabel(tokens[i], g.label - 6)]);
  g.labels = rowLabels.map(([i, text]) => [i, text]);  // what each axis shows, for the browser test
  if (!labels || labels.key !== labelsKey(g, rowLabels)) labels = labelImages(g, rowLabels);
  all.forEach((panel, p) => {
    const view = state.views[p], canvas = view.canvas, top = scaleTop(panel.weights);
    view.div.dataset.head = panel.head;
    view.title.textContent = panel.title;
    if (panel.role && panel.role !== "-") view.title.append(badge(panel.role));
    view.entropy.textContent = `entropy ${panel.entropy.toFixed(2)} nats` +
      ($("stretch").checked ? `; colours 0 to ${formatWeight(top)}` : "");
    canvas.setAttribute("aria-label", `${panel.title} heatmap, ${n} by ${n}; arrow keys read the weights`);
    view.div.style.width = `${side}px`;  // longer titles wrap instead of widening the column
    if (view.labels !== labels.key) {  // the sizes and labels: only when they change
      view.labels = labels.key;
      Object.assign(view.wrap.style, { width: `${side}px`, height: `${side}px` });
      Object.assign(canvas.style, { left: `${g.label}px`, top: `${g.label}px`, width: `${g.size}px`, height: `${g.size}px` });
      Object.assign(view.rows.style, { left: "0px", top: `${g.label - 6}px`, width: `${g.label}px`, height: `${g.size + 12}px` });
      Object.assign(view.columns.style, { left: `${g.label - 6}px`, top: "0px", width: `${g.size + 12}px`, height: `${g.label}px` });
      view.rows.src = labels.rows;
      view.columns.src = labels.columns;
    }
    canvas.style.backgroundImage = hatched ? hatchBackground() : "none";
    drawCells(canvas, panel.weights, top, null);
    if (document.activeElement === canvas) showCursor(view);
  });
}

// For the browser test: the heatmaps' sizes (CSS px; a panel's cells canvas, `.panel canvas.cells`,
// shows cell (i, j) at (j * cell, i * cell) of its box, `label` px right of and below the panel's corner).
window.qkvExplorer = {
  geometry() {
    return { ...state.geometry, dpr: window.devicePixelRatio || 1 };
  },
  colour: (t) => rampRgb(t),
};
