/* qkv page, parts: "Why √d_k" and "A score as a sum". Written for qkv; no library, no network.
 *
 * Why √d_k: for random q and k (a seeded generator, so the page shows the same numbers each
 * time), one row of softmax weights over 8 keys as d_k grows from 2 to 512, without scaling
 * and divided by √d_k. A score q·k is a sum of d_k products, so its spread grows like √d_k and
 * the unscaled row turns greedy: one key takes almost all the weight.
 *
 * A score as a sum: the score of the selected query and a chosen key, written as
 * Σ_d q_d·k_d with each term drawn as a bar (its number beside it).
 */
(function (api) {
  "use strict";

  const el = api.el;
  const fmt = api.fmt;

  // -- Why √d_k -------------------------------------------------------------------------------

  const DKS = [2, 4, 8, 16, 32, 64, 128, 256, 512];
  const KEYS = 8;
  const BAR_HEIGHT = 28; // px of a weight of 1

  function generator(seed) {
    // mulberry32: a small seeded generator, then Box–Muller for normal numbers.
    let t = seed >>> 0;
    const uniform = () => {
      t = (t + 0x6d2b79f5) >>> 0;
      let x = Math.imul(t ^ (t >>> 15), t | 1);
      x ^= x + Math.imul(x ^ (x >>> 7), x | 61);
      return ((x ^ (x >>> 14)) >>> 0) / 4294967296;
    };
    return () => {
      const u = 1 - uniform();
      return Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * uniform());
    };
  }

  function softmax(row) {
    const max = Math.max(...row);
    const e = row.map((x) => Math.exp(x - max));
    const sum = e.reduce((s, x) => s + x, 0);
    return e.map((x) => x / sum);
  }

  // For each d_k: q and 8 keys with normal entries, the scores and both rows of weights.
  function sqrtRows(seed) {
    const normal = generator(seed);
    return DKS.map((dK) => {
      const q = Array.from({ length: dK }, normal);
      const scores = Array.from({ length: KEYS }, () => {
        let s = 0;
        for (let d = 0; d < dK; d += 1) s += q[d] * normal();
        return s;
      });
      const unscaled = softmax(scores);
      const scaled = softmax(scores.map((s) => s / Math.sqrt(dK)));
      return { dK: dK, scores: scores, unscaled: unscaled, scaled: scaled };
    });
  }

  const sqrt = { seed: 1, detail: 512 };

  function bars(weights, label) {
    const box = el("span", {
      class: "row-bars",
      role: "img",
      "aria-label": label + ": " + weights.map((w) => fmt(w, 3)).join(", "),
    });
    for (const w of weights) {
      const bar = el("span", { title: fmt(w, 3) });
      bar.style.height = Math.max(1, Math.round(BAR_HEIGHT * w)) + "px";
      box.append(bar);
    }
    return box;
  }

  function buildSqrt() {
    sqrt.box = el("section", { class: "panel sqrt-dk", "aria-labelledby": "qkv-sqrt-title" });
    sqrt.again = el("button", { type: "button", id: "qkv-sqrt-again", text: "New random q and k" });
    sqrt.pick = el("select", { id: "qkv-sqrt-dk" });
    DKS.forEach((d) => sqrt.pick.append(el("option", { value: d, text: String(d) })));
    sqrt.pick.value = String(sqrt.detail);
    sqrt.again.addEventListener("click", () => {
      sqrt.seed += 1;
      renderSqrt();
    });
    sqrt.pick.addEventListener("change", () => {
      sqrt.detail = Number(sqrt.pick.value);
      renderSqrt();
    });
    sqrt.body = el("div");
    sqrt.box.append(
      el("h2", { id: "qkv-sqrt-title", text: "Why divide by √d_k?" }),
      el("p", {
        class: "note",
        text:
          "One query against 8 keys, every number drawn at random (mean 0, spread 1). A " +
          "score q·k adds up d_k products, so its spread grows like √d_k. Without scaling " +
          "the softmax turns greedy: one key takes almost all the weight and the others " +
          "learn nothing. Divided by √d_k, the scores keep a spread of about 1.",
      }),
      el("div", { class: "decode-nav" }, [sqrt.again, el("label", {}, ["Numbers for d_k ", sqrt.pick])]),
      sqrt.body
    );
    api.ui.extras.append(sqrt.box);
    renderSqrt();
  }

  function renderSqrt() {
    const rows = sqrtRows(sqrt.seed);
    sqrt.rows = rows;
    sqrt.box.setAttribute("data-seed", sqrt.seed);
    const table = el("table", { class: "bars" });
    table.append(
      el("thead", {}, [
        el("tr", {}, [
          el("th", { scope: "col", text: "d_k" }),
          el("th", { scope: "col", text: "not scaled: weights, largest" }),
          el("th", { scope: "col", text: "÷ √d_k: weights, largest" }),
        ]),
      ])
    );
    const body = el("tbody");
    for (const row of rows) {
      const top = (w) => Math.max(...w);
      body.append(
        el("tr", { "data-dk": row.dK }, [
          el("th", { scope: "row", text: String(row.dK) }),
          el("td", { class: "max unscaled", "data-value": top(row.unscaled) }, [
            bars(row.unscaled, "not scaled, d_k " + row.dK),
            fmt(top(row.unscaled), 3),
          ]),
          el("td", { class: "max scaled", "data-value": top(row.scaled) }, [
            bars(row.scaled, "divided by √d_k, d_k " + row.dK),
            fmt(top(row.scaled), 3),
          ]),
        ])
      );
    }
    table.append(body);
    const chosen = rows.find((r) => r.dK === sqrt.detail);
    const list = (w) => "[" + w.map((x) => fmt(x, 3)).join(", ") + "]";
    sqrt.body.replaceChildren(
      el("div", { class: "scroll" }, [table]),
      el("p", { class: "eq", text: "d_k = " + chosen.dK + ", not scaled: " + list(chosen.unscaled) }),
      el("p", { class: "eq", text: "d_k = " + chosen.dK + ", ÷ √d_k:     " + list(chosen.scaled) })
    );
  }

  // -- A score as a sum -------------------------------------------------------------------------

  const sums = { key: null };

  function headVectors() {
    // Q and K of the visible head: the engine's float64 numbers when the call has inputs.
    const state = api.state;
    const result = api.lab && api.call().lab ? api.lab.results() : null;
    if (result && result.heads[state.head]) {
      const h = result.heads[state.head];
      return { Q: h.Q, K: h.K, factor: result.factor };
    }
    const q = api.stepFor("Q");
    const k = api.stepFor("K");
    if (!q || !k || q.shape.length !== 2 || k.shape.length !== 2 || q.shape[1] !== k.shape[1]) {
      return null;
    }
    const as = (step) => ({ r: step.shape[0], c: step.shape[1], a: api.values(step) });
    return { Q: as(q), K: as(k), factor: null };
  }

  function buildSums() {
    sums.box = el("section", { class: "panel sums", "aria-labelledby": "qkv-sums-title" });
    sums.pick = el("select", { id: "qkv-sum-key" });
    sums.pick.addEventListener("change", () => {
      sums.key = Number(sums.pick.value);
      renderSums();
    });
    sums.body = el("div", { "aria-live": "polite" });
    sums.box.append(
      el("h2", { id: "qkv-sums-title", text: "A score as a sum" }),
      el("label", { class: "pick" }, ["Key ", sums.pick]),
      sums.body
    );
    api.ui.side.append(sums.box);
  }

  function renderSums() {
    const vectors = headVectors();
    const weights = api.stepFor("weights");
    sums.box.hidden = !vectors || !weights;
    if (sums.box.hidden) return;
    const queries = api.labels[weights.rows];
    const keys = api.labels[weights.cols];
    const { Q, K } = vectors;
    if (Q.r !== queries.length || K.r !== keys.length) {
      sums.box.hidden = true;
      return;
    }
    const q = Math.min(api.readingQuery(), Q.r - 1);
    if (sums.pick.options.length !== keys.length) {
      sums.pick.replaceChildren(...keys.map((label, j) => el("option", { value: j, text: label })));
    }
    let k = api.state.key !== null ? api.state.key : sums.key;
    if (k === null || k >= K.r) k = 0;
    sums.pick.value = String(k);
    const d = Q.c;
    const terms = [];
    let score = 0;
    for (let i = 0; i < d; i += 1) {
      const t = Q.a[q * d + i] * K.a[k * d + i];
      terms.push(t);
      score += t;
    }
    const widest = Math.max(...terms.map(Math.abs), 1e-300);
    const name = "q_" + queries[q] + "·k_" + keys[k];
    const shown = terms.length > 16 ? "" : " = " + terms.map((t, i) => fmt(Q.a[q * d + i]) + "×" + fmt(K.a[k * d + i])).join(" + ");
    const table = el("table", { class: "terms" });
    table.append(
      el("thead", {}, [
        el("tr", {}, ["d", "q_d", "k_d", "q_d·k_d"].map((t) => el("th", { scope: "col", text: t }))),
      ])
    );
    const body = el("tbody");
    terms.forEach((t, i) => {
      const bar = el("span", { class: "term " + (t < 0 ? "neg" : "pos") });
      bar.style.width = Math.round((60 * Math.abs(t)) / widest) + "px";
      body.append(
        el("tr", { "data-d": i }, [
          el("th", { scope: "row", text: "d" + (i + 1) }),
          el("td", { text: fmt(Q.a[q * d + i]) }),
          el("td", { text: fmt(K.a[k * d + i]) }),
          el("td", { class: "term-value", "data-value": t }, [bar, (t < 0 ? "" : "+") + fmt(t)]),
        ])
      );
    });
    body.append(
      el("tr", { class: "sum" }, [
        el("th", { scope: "row", text: "Σ" }),
        el("td"),
        el("td"),
        el("td", { class: "score", "data-value": score, text: fmt(score) }),
      ])
    );
    table.append(body);
    let largest = 0;
    terms.forEach((t, i) => (largest = Math.abs(t) > Math.abs(terms[largest]) ? i : largest));
    const lines = [
      el("p", { class: "eq", text: name + " = Σ_d q_d·k_d" + shown + " = " + fmt(score) }),
      el("div", { class: "scroll" }, [table]),
      el("p", {
        class: "note",
        text:
          "Bars: purple adds to the score, orange takes away (the sign is also written). " +
          "Dimension d" + (largest + 1) + " contributes most (" + fmt(terms[largest]) + ").",
      }),
    ];
    if (vectors.factor !== null) {
      lines.push(
        el("p", {
          class: "note",
          text: "Scaled: " + fmt(score) + " × " + fmt(vectors.factor) + " = " + fmt(score * vectors.factor) + ".",
        })
      );
    }
    sums.body.replaceChildren(...lines);
  }

  api.panels = { sqrtRows: sqrtRows };

  api.extend({
    shell: function () {
      buildSums();
      buildSqrt();
    },
    call: function () {
      sums.key = null;
      sums.pick.replaceChildren();
    },
    highlight: renderSums,
  });
})(window.qkvPage);
