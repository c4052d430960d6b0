// qkv attention explorer: a model folder's views beside BertViz's head view (headview.js): role
// badges, the model's prediction, and the neuron view of a hovered cell (q, k, q*k, the score,
// the row's softmax, asked of the API's "neuron"). Loaded before explorer.js, whose state and
// el() it uses when called.
"use strict";

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
