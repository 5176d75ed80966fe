/* qkv page, part: decoding with a KV cache, step by step. Written for qkv; no network.
 *
 * For a call the page can recompute (lab.js), generating one token at a time: at step p the
 * cache holds the keys and values of tokens 0 … p−1, the step appends k_p and v_p (one row
 * each), and the new query q_p attends every cached key: bottom-right alignment, the one new
 * query lines up with the last key, so nothing in the cache is hidden from it. Its row of
 * weights and its context vector equal the last row of the full causal pass over tokens
 * 0 … p; the panel computes both and shows the largest difference (as `qkv explain --decode`).
 */
(function (api) {
  "use strict";

  const el = api.el;
  const fmt = api.fmt;
  const view = { step: null };

  function softmaxRow(row) {
    let max = -Infinity;
    for (const x of row) max = Math.max(max, x);
    const e = row.map((x) => Math.exp(x - max));
    let sum = 0;
    for (const x of e) sum += x;
    return e.map((x) => x / sum);
  }

  function rowOf(m, i) {
    return Array.from(m.a.subarray(i * m.c, (i + 1) * m.c));
  }

  // The inputs of the tokens 0 … p only (the full causal pass of the prefix).
  function prefix(kind, inputs, p) {
    const cut = (m) => ({ r: p + 1, c: m.c, a: m.a.slice(0, (p + 1) * m.c) });
    if (kind === "projections") return Object.assign({}, inputs, { embeddings: cut(inputs.embeddings) });
    return { Q: inputs.Q.map(cut), K: inputs.K.map(cut), V: inputs.V.map(cut) };
  }

  // The numbers of decoding step p in head h, from the call's (possibly edited) inputs.
  function decode(p, h) {
    const call = api.call();
    const st = call.labState;
    const options = Object.assign({}, st.options, { causal: true });
    // The full causal pass over tokens 0 … p: its Q, K and V rows are the cache's.
    const full = api.lab.compute(call.lab.kind, prefix(call.lab.kind, st.inputs, p), options);
    const head = full.heads[h];
    const query = rowOf(head.Q, p);
    const keys = [];
    const values = [];
    for (let j = 0; j <= p; j += 1) {
      keys.push(rowOf(head.K, j));
      values.push(rowOf(head.V, j));
    }
    const scores = keys.map((k) => k.reduce((s, x, d) => s + x * query[d], 0));
    const weights = softmaxRow(scores.map((s) => s * full.factor));
    const context = values[0].map((_, d) => values.reduce((s, v, j) => s + weights[j] * v[d], 0));
    const fullWeights = rowOf(full.heads[h].weights, p);
    const fullContext = rowOf(full.heads[h].context, p);
    const difference = (a, b) => Math.max(...a.map((x, i) => Math.abs(x - b[i])));
    return {
      position: p,
      head: h,
      factor: full.factor,
      query: query,
      keys: keys,
      values: values,
      scores: scores,
      weights: weights,
      context: context,
      fullWeights: fullWeights,
      fullContext: fullContext,
      weightsDifference: difference(weights, fullWeights),
      contextDifference: difference(context, fullContext),
    };
  }

  function usable() {
    const call = api.call();
    if (!call.lab || !api.lab) return false;
    const st = call.labState || (api.lab.results() && call.labState);
    if (!st) return false;
    const q = call.lab.kind === "projections" ? st.inputs.embeddings.r : st.inputs.Q[0].r;
    const k = call.lab.kind === "projections" ? q : st.inputs.K[0].r;
    return q === k && q > 0;
  }

  function tokens() {
    const weights = api.stepFor("weights");
    return api.labels[weights.cols];
  }

  function build() {
    view.box = el("section", { class: "panel decode", "aria-labelledby": "qkv-decode-title" });
    view.pick = el("select", { id: "qkv-decode-step" });
    view.prev = el("button", { type: "button", id: "qkv-decode-prev", text: "◀ Previous token" });
    view.next = el("button", { type: "button", id: "qkv-decode-next", text: "Next token ▶" });
    view.body = el("div", { "aria-live": "polite" });
    view.box.append(
      el("h2", { id: "qkv-decode-title", text: "Decoding with a KV cache" }),
      el("p", {
        class: "note",
        text:
          "A model that writes one token at a time keeps the keys and values of the tokens " +
          "it has seen (the cache). Each step adds one row to K and one to V; only the new " +
          "token's query is computed, and it attends every cached key.",
      }),
      el("div", { class: "decode-nav", role: "group", "aria-label": "Decoding step" }, [
        view.prev,
        el("label", {}, ["New token at position ", view.pick]),
        view.next,
      ]),
      view.body
    );
    view.pick.addEventListener("change", () => go(Number(view.pick.value)));
    view.prev.addEventListener("click", () => go(view.step - 1));
    view.next.addEventListener("click", () => go(view.step + 1));
    api.ui.extras.prepend(view.box);
  }

  function go(p) {
    const count = tokens().length;
    view.step = Math.max(0, Math.min(count - 1, p));
    render();
  }

  function vector(row) {
    return "[" + row.map((x) => fmt(x)).join(", ") + "]";
  }

  function refresh() {
    view.box.hidden = !usable() || !api.stepFor("weights");
    if (view.box.hidden) return;
    const names = tokens();
    if (view.step === null || view.step >= names.length) view.step = 0;
    if (view.pick.options.length !== names.length || view.names !== names) {
      view.names = names;
      view.pick.replaceChildren(
        ...names.map((t, p) => el("option", { value: p, text: p + ": " + t }))
      );
    }
    render();
  }

  function render() {
    const names = tokens();
    const p = view.step;
    const h = Math.min(api.state.head, api.call().heads - 1);
    const s = decode(p, h);
    view.current = s;
    view.pick.value = String(p);
    view.prev.disabled = p === 0;
    view.next.disabled = p === names.length - 1;
    const cache = el("table", { class: "cache" });
    cache.append(
      el("caption", { class: "visually-hidden", text: "The cache after position " + p }),
      el("thead", {}, [
        el("tr", {}, ["token", "k (cached key)", "v (cached value)", ""].map((t) => el("th", { scope: "col", text: t }))),
      ])
    );
    const body = el("tbody");
    for (let j = 0; j <= p; j += 1) {
      body.append(
        el("tr", j === p ? { class: "new", "data-row": j } : { "data-row": j }, [
          el("th", { scope: "row", text: names[j] }),
          el("td", { text: vector(s.keys[j]) }),
          el("td", { text: vector(s.values[j]) }),
          el("td", { text: j === p ? "← added now" : "" }),
        ])
      );
    }
    cache.append(body);
    const weights = el("table", { class: "cache weights" });
    weights.append(
      el("thead", {}, [el("tr", {}, ["key", "score × scale", "weight"].map((t) => el("th", { scope: "col", text: t })))])
    );
    const wBody = el("tbody");
    s.weights.forEach((w, j) => {
      const bar = el("span", { class: "bar" });
      bar.style.width = Math.round(48 * w) + "px";
      wBody.append(
        el("tr", { "data-key": j }, [
          el("th", { scope: "row", text: names[j] }),
          el("td", { text: fmt(s.scores[j] * s.factor) }),
          el("td", { class: "weight", "data-value": w }, [bar, fmt(w)]),
        ])
      );
    });
    weights.append(wBody);
    const query = names[p];
    view.body.replaceChildren(
      el("p", {
        text:
          "Position " + p + ": the cache holds " + (p + 1) + " row" + (p ? "s" : "") +
          " of K and of V (" + (p ? "tokens " + names[0] + " … " + names[p] : "token " + names[0]) +
          "); the new row is “" + query + "”.",
      }),
      el("div", { class: "scroll" }, [cache]),
      el("p", { class: "eq", text: "q_" + query + " = " + vector(s.query) }),
      el("p", {
        class: "note",
        text:
          "Bottom-right alignment: the one new query lines up with the last cached key, so " +
          "it sees all " + (p + 1) + " of them, as row " + p + " of the causal mask does.",
      }),
      el("div", { class: "scroll" }, [weights]),
      el("p", { class: "eq", text: "c_" + query + " = " + vector(s.context) }),
      el("p", {
        class: "eq full",
        text: "last row of the full causal pass: " + vector(s.fullContext),
      }),
      el("p", {
        class: "note same",
        text:
          "Equal to the last row of the full causal computation over positions 0 … " + p +
          ": largest difference " + s.weightsDifference.toExponential(1) + " (weights), " +
          s.contextDifference.toExponential(1) + " (context).",
      })
    );
  }

  api.decode = {
    step: decode,
    current: function () {
      return view.current || null;
    },
    go: go,
  };

  api.extend({
    shell: build,
    call: function () {
      view.step = 0;
    },
    head: refresh,
    edit: refresh,
  });
})(window.qkvPage);
