// qkv attention explorer: the head view (after BertViz), drawn on a canvas. Loaded before
// explorer.js, whose state, panels(), el(), badge() and largest() it uses when called.
//
// The tokens twice, queries on the left and keys on the right, as HTML labels (focusable, kept
// while the tokens stay), and a line from each query to each key it gives enough weight, on one
// canvas under them. Two modes:
//   one head (or the average), chosen in a select: lines of weight >= 1% of the head's largest,
//     width 0.5 + 7w, opacity 0.15 + 0.85 w / largest, in the page's accent colour;
//   a model folder's layer: every head overlaid in its own colour, lines of weight >= 0.02,
//     width 0.5 + 3w, opacity 0.1 + 0.8w, each head toggled by a checkbox.
// Hovering or focusing a query keeps only its lines. Lines are stroked in batches of one head and
// one weight to 0.01 (the precision the SVG version wrote), so 4,096 lines x 16 heads are a few
// hundred strokes, not thousands of elements for the browser to lay out.
"use strict";

const HV_ROW = 22, HV_ACCENT = [11, 92, 173];  // --accent, #0b5cad

// hsl(h, s%, l%) as [r, g, b] (0-255), so a head's colour can be given to canvas and the test alike.
function hslRgb(h, s, l) {
  s /= 100; l /= 100;
  const k = (n) => (n + h / 30) % 12, a = s * Math.min(l, 1 - l);
  const f = (n) => l - a * Math.max(-1, Math.min(k(n) - 3, Math.min(9 - k(n), 1)));
  return [f(0), f(8), f(4)].map((x) => Math.round(255 * x));
}

// A head's colour in the overlaid head view: hues around the wheel.
function headRgb(h, heads) {
  return hslRgb(Math.round((360 * h) / heads), 70, 42);
}
function headColour(h, heads) {
  return `rgb(${headRgb(h, heads).join(",")})`;
}

// The head view's drawing state: what the last render asked for, and the hovered query.
const headView = {
  layers: null,   // [{head, colour: [r, g, b], weights, threshold, width(w), alpha(w)}] drawn
  focus: null,    // the query whose lines alone are shown, or null
  tokens: null,   // the tokens the labels were made for
  canvas: null, wrap: null, queries: [], keys: [],
  geometry: null, // {row, width, left, right, x1, x2, height}
};

// The canvas spans only the lines' band between the two columns of labels (not the labels too):
// the browser copies every canvas's pixels again on each frame it composites, so its area is time.
// x1, x2: where the lines start and end, in the canvas's own pixels.
function headViewGeometry(n, pretrained) {
  const width = pretrained ? 360 : 420, inset = pretrained ? 100 : 110;
  return { row: HV_ROW, width, left: inset, right: width - inset, canvasLeft: inset, canvasWidth: width - 2 * inset,
           x1: 6, x2: width - 2 * inset - 6, height: n * HV_ROW + 10, y: (i) => i * HV_ROW + 16 };
}

// The labels and the canvas, made again only when the tokens or the mode change.
function headViewFrame(tokens, pretrained) {
  const g = headViewGeometry(tokens.length, pretrained);
  const same = headView.tokens && headView.wrap && headView.wrap.isConnected && headView.pretrained === pretrained &&
    headView.tokens.length === tokens.length && headView.tokens.every((t, i) => t === tokens[i]);
  headView.geometry = g;
  if (same) return;
  headView.tokens = tokens.slice();
  headView.pretrained = pretrained;
  headView.focus = null;
  const wrap = el("div", { class: "hv-wrap", style: `width: ${g.width}px; height: ${g.height}px` });
  const canvas = el("canvas", { class: "hv-lines", "aria-hidden": "true" });
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.round(g.canvasWidth * dpr);
  canvas.height = Math.round(g.height * dpr);
  canvas.style.left = `${g.canvasLeft}px`;
  canvas.style.width = `${g.canvasWidth}px`;
  canvas.style.height = `${g.height}px`;
  wrap.append(canvas);
  headView.queries = tokens.map((t, i) => {
    const q = el("span", { class: "query", "data-q": i, tabindex: 0, role: "button",
                           style: `right: ${g.width - g.left}px; top: ${i * g.row + 6}px`,
                           "aria-label": `query ${i} "${t}": show only its lines` }, t);
    q.addEventListener("mouseenter", () => focusHeadViewQuery(i));
    q.addEventListener("focus", () => focusHeadViewQuery(i));
    q.addEventListener("mouseleave", () => focusHeadViewQuery(null));
    q.addEventListener("blur", () => focusHeadViewQuery(null));
    return q;
  });
  headView.keys = tokens.map((t, j) => el("span", { class: "key", "data-k": j,
                                                   style: `left: ${g.right}px; top: ${j * g.row + 6}px` }, t));
  wrap.append(...headView.queries, ...headView.keys);
  headView.canvas = canvas;
  headView.wrap = wrap;
  $("headview").replaceChildren(wrap);
}

function focusHeadViewQuery(i) {
  if (headView.focus === i) return;
  headView.focus = i;
  for (const q of headView.queries) q.classList.toggle("active", Number(q.dataset.q) === i);
  paintHeadView();
}

// Every line shown now: [{head, q, k, w, bucket}] in drawing order, for paintHeadView and the test.
function headViewLines() {
  const out = [], focus = headView.focus;
  for (const layer of headView.layers || []) {
    if (state.hiddenHeads.has(layer.head) && typeof layer.head === "number" && headView.pretrained) continue;
    const w = layer.weights, n = w.length;
    for (let i = 0; i < n; i++) {
      if (focus !== null && i !== focus) continue;
      const row = w[i];
      for (let j = 0; j < n; j++) {
        const x = row[j];
        if (x >= layer.threshold && x > 0) out.push({ head: layer.head, q: i, k: j, w: x, bucket: layer.bucket(x) });
      }
    }
  }
  return out;
}

// Draws the lines: per head, one path per bucket of weight (0.01 steps), stroked once.
function paintHeadView() {
  const canvas = headView.canvas, g = headView.geometry;
  if (!canvas) return;
  const dpr = window.devicePixelRatio || 1, ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, g.canvasWidth, g.height);
  ctx.lineCap = "round";
  const lines = headViewLines();
  let start = 0;
  for (const layer of headView.layers || []) {
    const paths = new Map();
    while (start < lines.length && lines[start].head === layer.head) {
      const line = lines[start++];
      let path = paths.get(line.bucket);
      if (!path) paths.set(line.bucket, path = new Path2D());
      path.moveTo(g.x1, g.y(line.q));
      path.lineTo(g.x2, g.y(line.k));
    }
    ctx.strokeStyle = `rgb(${layer.colour.join(",")})`;
    for (const [bucket, path] of paths) {
      ctx.lineWidth = layer.width(bucket / 100);
      ctx.globalAlpha = layer.alpha(bucket / 100);
      ctx.stroke(path);
    }
  }
  ctx.globalAlpha = 1;
  headView.drawn = lines.length;
}

// One head or the average (the select's choice): lines of at least 1% of its largest weight.
// `deferred`: the lines are left for the caller to paint (paintHeadView) after the heatmaps' frame.
function drawHeadView(deferred = false) {
  const r = state.response, all = panels();
  const chosen = all.find((p) => String(p.head) === $("headview-head").value) || all[all.length - 1];
  headViewFrame(r.tokens, false);
  const top = largest(chosen.weights) || 1;
  headView.layers = [{ head: chosen.head, colour: HV_ACCENT, weights: chosen.weights, threshold: 0.01 * top,
                       bucket: (x) => Math.round((100 * x) / top),
                       width: (b) => 0.5 + 7 * b * top, alpha: (b) => 0.15 + 0.85 * b }];
  headView.wrap.setAttribute("role", "img");
  headView.wrap.setAttribute("aria-label", `head view of ${chosen.title}`);
  if (!deferred) paintHeadView();
}

// BertViz's head view: every head of the layer at once, each in its own colour, toggled by its
// checkbox; hovering (or focusing) a query token on the left keeps only its lines. `deferred` as
// for drawHeadView.
function drawHeadViewAll(deferred = false) {
  const r = state.response, layer = r.layers[state.layer], heads = layer.weights.length;
  const toggles = $("headview-toggles");
  toggles.replaceChildren(...layer.weights.map((_, h) => {
    const box = el("input", { type: "checkbox", "data-head": h });
    box.checked = !state.hiddenHeads.has(h);
    box.addEventListener("change", () => {
      if (box.checked) state.hiddenHeads.delete(h); else state.hiddenHeads.add(h);
      paintHeadView();
    });
    const label = el("label");
    label.append(box, el("span", { class: "swatch", style: `background: ${headColour(h, heads)}` }), `head ${h}`);
    if (layer.roles && layer.roles[h] && layer.roles[h].role !== "-") label.append(badge(layer.roles[h].role));
    return label;
  }));
  headViewFrame(r.tokens, true);
  headView.layers = layer.weights.map((w, h) => ({ head: h, colour: headRgb(h, heads), weights: w, threshold: 0.02,
                                                   bucket: (x) => Math.round(100 * x),
                                                   width: (b) => 0.5 + 3 * b, alpha: (b) => 0.1 + 0.8 * b }));
  headView.wrap.setAttribute("role", "img");
  headView.wrap.setAttribute("aria-label", `head view of layer ${state.layer}, ${heads} heads overlaid`);
  if (!deferred) paintHeadView();
}

// For the browser test: what the head view draws, in CSS pixels of its canvas (x1, x2 from its left edge).
window.qkvHeadView = () => {
  const g = headView.geometry;
  if (!g) return null;
  const colours = {};
  for (const layer of headView.layers || []) colours[layer.head] = layer.colour;
  return {
    x1: g.x1, x2: g.x2, ys: (headView.tokens || []).map((_, i) => g.y(i)), width: g.width, height: g.height,
    focus: headView.focus, colours, hidden: [...state.hiddenHeads],
    lines: headViewLines().map((l) => {
      const layer = headView.layers.find((x) => x.head === l.head);
      return [l.head, l.q, l.k, layer.width(l.bucket / 100), layer.alpha(l.bucket / 100)];
    }),
  };
};
