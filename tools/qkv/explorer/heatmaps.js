// qkv attention explorer: the heatmaps, one canvas per head and their average, sized to the
// window, labels thinned as `qkv viz` thins them, masked pairs hatched. Loaded before explorer.js,
// whose state, panels() and colour scale it uses when called.
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
  colour: (t) => rampRgb(t),
};
