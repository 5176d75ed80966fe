/* qkv page, part: edit and watch. Written for qkv; no library, no network.
 *
 * A call whose page data has "lab" (render/_lab.py) can be recomputed here from its inputs
 * (embeddings and W_q, W_k, W_v, W_o; or Q, K, V) in float64 JavaScript numbers: the learner
 * edits a number, the scaling, causal or the number of heads, and every step, table, colour
 * scale, head view and panel is drawn again from the new numbers.
 */
(function (api) {
  "use strict";

  const el = api.el;

  // -- the engine: a few dozen lines of float64 attention ------------------------------------

  // A matrix is { r, c, a } with a a Float64Array of r × c numbers, row by row.
  function matrix(rows) {
    const r = rows.length;
    const c = r ? rows[0].length : 0;
    const a = new Float64Array(r * c);
    rows.forEach((row, i) => row.forEach((v, j) => (a[i * c + j] = v)));
    return { r: r, c: c, a: a };
  }

  function matmul(x, y, transposeY) {
    // x (r × n) · y (n × c), or x · yᵀ with y (c × n) when transposeY.
    const r = x.r;
    const n = x.c;
    const c = transposeY ? y.r : y.c;
    const xa = x.a;
    const ya = transposeY ? y.a : transpose(y).a; // rows of y as columns: one loop for both
    const out = new Float64Array(r * c);
    for (let i = 0; i < r; i += 1) {
      const xi = i * n;
      for (let j = 0; j < c; j += 1) {
        const yj = j * n;
        let s = 0;
        for (let k = 0; k < n; k += 1) s += xa[xi + k] * ya[yj + k];
        out[i * c + j] = s;
      }
    }
    return { r: r, c: c, a: out };
  }

  function transpose(m) {
    const out = new Float64Array(m.r * m.c);
    for (let i = 0; i < m.r; i += 1) for (let j = 0; j < m.c; j += 1) out[j * m.r + i] = m.a[i * m.c + j];
    return { r: m.c, c: m.r, a: out };
  }

  function columns(x, from, count) {
    const out = new Float64Array(x.r * count);
    for (let i = 0; i < x.r; i += 1) {
      for (let j = 0; j < count; j += 1) out[i * count + j] = x.a[i * x.c + from + j];
    }
    return { r: x.r, c: count, a: out };
  }

  function sideBySide(parts) {
    const r = parts[0].r;
    const c = parts.reduce((s, p) => s + p.c, 0);
    const out = new Float64Array(r * c);
    let at = 0;
    for (const p of parts) {
      for (let i = 0; i < r; i += 1) for (let j = 0; j < p.c; j += 1) out[i * c + at + j] = p.a[i * p.c + j];
      at += p.c;
    }
    return { r: r, c: c, a: out };
  }

  // softmax row by row, each row's maximum subtracted first; a row with no allowed key is 0.
  function softmax(s) {
    const out = new Float64Array(s.a.length);
    for (let i = 0; i < s.r; i += 1) {
      const row = i * s.c;
      let max = -Infinity;
      for (let j = 0; j < s.c; j += 1) if (s.a[row + j] > max) max = s.a[row + j];
      if (max === -Infinity) continue;
      let sum = 0;
      for (let j = 0; j < s.c; j += 1) {
        const e = Math.exp(s.a[row + j] - max);
        out[row + j] = e;
        sum += e;
      }
      for (let j = 0; j < s.c; j += 1) out[row + j] /= sum;
    }
    return { r: s.r, c: s.c, a: out };
  }

  function scaleFactor(name, given, dK) {
    if (name === "sqrt_dk") return 1 / Math.sqrt(dK);
    if (name === "none") return 1;
    if (name === "d_k") return 1 / dK;
    return given;
  }

  // Every step of attention from the inputs: { X, W_q, W_k, W_v, W_o, concat, output,
  // heads: [{ Q, K, V, scores, scaled, masked, weights, context }], factor }. With
  // `previous` (a result of the same options) and `changed` (the heads an edit touched),
  // the other heads are taken from `previous` as they are.
  function compute(kind, inputs, options, previous, changed) {
    const h = options.heads;
    const out = { heads: [] };
    if (kind === "projections") {
      out.X = inputs.embeddings;
      out.W_q = inputs.W_q;
      out.W_k = inputs.W_k;
      out.W_v = inputs.W_v;
      out.W_o = inputs.W_o;
    }
    const dK = kind === "projections" ? inputs.W_q.c / h : inputs.Q[0].c;
    out.factor = scaleFactor(options.scale, options.factor, dK);
    for (let i = 0; i < h; i += 1) {
      if (previous && changed && !changed.has(i)) {
        out.heads.push(previous.heads[i]);
        continue;
      }
      let q;
      let k;
      let v;
      if (kind === "projections") {
        // This head's columns of Q = X·W_q, K = X·W_k and V = X·W_v.
        const x = inputs.embeddings;
        [q, k, v] = [inputs.W_q, inputs.W_k, inputs.W_v].map((w) => matmul(x, columns(w, (i * w.c) / h, w.c / h)));
      } else {
        [q, k, v] = [inputs.Q[i], inputs.K[i], inputs.V[i]];
      }
      const scores = matmul(q, k, true);
      const scaled = { r: scores.r, c: scores.c, a: new Float64Array(scores.a.length) };
      for (let j = 0; j < scores.a.length; j += 1) scaled.a[j] = scores.a[j] * out.factor;
      let masked = null;
      if (options.causal) {
        masked = { r: scaled.r, c: scaled.c, a: Float64Array.from(scaled.a) };
        for (let r = 0; r < masked.r; r += 1) {
          for (let c = r + 1; c < masked.c; c += 1) masked.a[r * masked.c + c] = -Infinity;
        }
      }
      const weights = softmax(masked || scaled);
      const context = matmul(weights, v);
      out.heads.push({ Q: q, K: k, V: v, scores, scaled, masked, weights, context });
    }
    out.concat = sideBySide(out.heads.map((x) => x.context));
    if (kind === "projections" && inputs.W_o) out.output = matmul(out.concat, inputs.W_o);
    return out;
  }

  // The heads that an edit of input `name` at (i, j) of head `head` changes.
  function touched(kind, inputs, heads, name, j, head) {
    if (kind === "qkv") return new Set([head || 0]);
    if (name === "W_o") return new Set();
    if (name === "embeddings") return null; // every head
    return new Set([Math.floor(j / (inputs[name].c / heads))]);
  }

  function stepMatrix(result, name, head) {
    const perHead = result.heads[head || 0];
    if (name === "embeddings") return result.X;
    if (name in perHead) return perHead[name];
    return result[name] || null;
  }

  // -- the state of each editable call ---------------------------------------------------------

  const SCALE_WORDS = { sqrt_dk: "÷ √d_k", none: "none", d_k: "÷ d_k", given: "as given" };

  function labOf(call) {
    if (!call.lab) return null;
    if (!call.labState) {
      const lab = call.lab;
      const inputs = {};
      for (const [name, rows] of Object.entries(lab.inputs)) {
        if (rows === null) inputs[name] = null;
        else if (lab.kind === "qkv") inputs[name] = rows.map(matrix);
        else inputs[name] = matrix(rows);
      }
      call.labState = {
        inputs: inputs,
        options: { heads: lab.heads, scale: lab.scale, factor: lab.factor, causal: lab.causal },
        texts: {}, // what the learner typed in each edited cell
        version: 0, // counts the edits of the inputs
        original: { facts: call.facts, sections: call.sections, heads: call.heads },
        editing: false,
      };
    }
    return call.labState;
  }

  function current() {
    const call = api.call();
    const st = labOf(call);
    return st ? { call: call, st: st } : null;
  }

  // The numbers of the call's current inputs and options, computed once per change.
  function results() {
    const now = current();
    if (!now) return null;
    const st = now.st;
    const options = JSON.stringify(st.options);
    const cache = st.cache;
    if (!cache || cache.options !== options || cache.version !== st.version) {
      // After one edit with the same options, only the heads it touched are computed again.
      const reuse = cache && cache.options === options && cache.version === st.version - 1;
      const changed = reuse ? st.touched : null;
      const result = compute(now.call.lab.kind, st.inputs, st.options, reuse ? cache.result : null, changed);
      st.cache = { options: options, version: st.version, result: result };
    }
    return st.cache.result;
  }

  // The call's page data rebuilt from the numbers the engine computes for the edited state.
  function apply() {
    const now = current();
    const { call, st } = now;
    const o = st.options;
    const result = results();
    const variant = call.lab.variants[o.heads + "|" + o.scale + "|" + (o.causal ? 1 : 0)];
    const sections = variant.sections.map((section) => ({
      title: section.title,
      head: section.head,
      steps: section.steps.map((index) => {
        const step = call.lab.steps[index];
        const m = stepMatrix(result, step.name, section.head);
        const copy = Object.assign({}, step);
        if (m && copy.rows !== undefined) {
          copy.values = m.a;
          copy.shape = [m.r, m.c];
          copy.data = "edited";
        }
        return copy;
      }),
    }));
    const kept = st.original.facts.filter((f) => f[0] === "tokens" || f[0] === "queries");
    call.sections = sections;
    call.facts = kept.concat(variant.facts);
    call.heads = variant.heads;
    call.edited = differs(call, st);
    api.redraw();
    api.notify("edit");
    return result;
  }

  // Whether the numbers or options differ from the example as written.
  function differs(call, st) {
    const lab = call.lab;
    const o = st.options;
    if (o.heads !== lab.heads || o.scale !== lab.scale || o.causal !== lab.causal) return true;
    for (const [name, rows] of Object.entries(lab.inputs)) {
      if (rows === null) continue;
      const given = lab.kind === "qkv" ? rows : [rows];
      const now = lab.kind === "qkv" ? st.inputs[name] : [st.inputs[name]];
      for (let h = 0; h < given.length; h += 1) {
        const flat = given[h].flat();
        for (let i = 0; i < flat.length; i += 1) if (flat[i] !== now[h].a[i]) return true;
      }
    }
    return false;
  }

  function reset() {
    const now = current();
    if (!now) return;
    const { call, st } = now;
    call.facts = st.original.facts;
    call.sections = st.original.sections;
    call.heads = st.original.heads;
    call.edited = false;
    call.labState = null;
    labOf(call).editing = st.editing;
    api.redraw();
    syncControls();
    api.notify("edit");
  }

  function inputMatrix(st, kind, name, head) {
    if (kind === "qkv") return st.inputs[name] ? st.inputs[name][head || 0] : null;
    return st.inputs[name] || null;
  }

  const EDITABLE = { projections: ["embeddings", "W_q", "W_k", "W_v", "W_o"], qkv: ["Q", "K", "V"] };

  // The head a step of the visible sections belongs to (Q, K, V given directly are per head).
  function headOf(step) {
    for (const section of api.visibleSections()) if (section.steps.includes(step)) return section.head;
    return null;
  }

  function set(name, i, j, value, head) {
    const now = current();
    if (!now) throw new Error("this call has no inputs to edit");
    const m = inputMatrix(now.st, now.call.lab.kind, name, head);
    if (!m || i < 0 || j < 0 || i >= m.r || j >= m.c) {
      throw new Error(name + "[" + i + ", " + j + "] is not an input number of this call");
    }
    m.a[i * m.c + j] = value;
    now.st.version += 1;
    now.st.touched = touched(now.call.lab.kind, now.st.inputs, now.st.options.heads, name, j, head);
    return apply();
  }

  // -- editors -------------------------------------------------------------------------------

  function editable(step) {
    const now = current();
    if (!now || !now.st.editing) return null;
    if (!EDITABLE[now.call.lab.kind].includes(step.name)) return null;
    return now;
  }

  function parse(text) {
    const clean = text.trim().replace(/\u2212/g, "-");
    if (!/^[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$/i.test(clean)) return null;
    const value = Number(clean);
    return Number.isFinite(value) ? value : null;
  }

  api.editCell = function (step, i, j, value) {
    const now = editable(step);
    if (!now) return null;
    const head = headOf(step);
    const key = step.name + ":" + (head || 0) + ":" + i + ":" + j;
    const rows = api.labels[step.rows];
    const cols = api.labels[step.cols];
    const input = el("input", {
      type: "text",
      inputmode: "decimal",
      class: "cell-edit",
      "data-edit": key,
      "aria-label": step.name + " " + rows[i] + ", " + cols[j],
      spellcheck: "false",
      autocomplete: "off",
    });
    const exact = inputMatrix(now.st, now.call.lab.kind, step.name, head);
    const number = exact ? exact.a[i * exact.c + j] : value;
    input.value = key in now.st.texts ? now.st.texts[key] : String(number);
    input.addEventListener("input", () => {
      const parsed = parse(input.value);
      input.setAttribute("aria-invalid", String(parsed === null));
      if (parsed === null) return;
      now.st.texts[key] = input.value;
      const caret = input.selectionStart;
      set(step.name, i, j, parsed, head);
      const again = document.querySelector('input[data-edit="' + key + '"]');
      if (again && again !== document.activeElement) {
        again.focus({ preventScroll: true });
        again.setSelectionRange(caret, caret);
      }
    });
    return input;
  };

  api.editPicture = function (step) {
    const now = editable(step);
    if (!now) return null;
    const head = headOf(step);
    const [r, c] = step.shape;
    const row = el("input", { type: "number", min: 1, max: r, value: 1, "aria-label": "row" });
    const col = el("input", { type: "number", min: 1, max: c, value: 1, "aria-label": "column" });
    const value = el("input", { type: "text", inputmode: "decimal", "aria-label": "new value" });
    const button = el("button", { type: "button", text: "Set" });
    const message = el("span", { class: "note", "aria-live": "polite" });
    const show = () => {
      const i = Number(row.value) - 1;
      const j = Number(col.value) - 1;
      const exact = inputMatrix(now.st, now.call.lab.kind, step.name, head);
      if (exact && i >= 0 && i < r && j >= 0 && j < c) value.value = String(exact.a[i * c + j]);
    };
    row.addEventListener("change", show);
    col.addEventListener("change", show);
    button.addEventListener("click", () => {
      const i = Number(row.value) - 1;
      const j = Number(col.value) - 1;
      const parsed = parse(value.value);
      if (!(i >= 0 && i < r && j >= 0 && j < c) || parsed === null) {
        message.textContent = "Give a row 1–" + r + ", a column 1–" + c + " and a number.";
        return;
      }
      set(step.name, i, j, parsed, head);
    });
    show();
    return el("div", { class: "picture-edit", role: "group", "aria-label": "Edit " + step.name }, [
      el("span", { text: "Edit one number:" }),
      el("label", {}, ["row ", row]),
      el("label", {}, ["column ", col]),
      el("label", {}, ["value ", value]),
      button,
      message,
    ]);
  };

  // -- the controls --------------------------------------------------------------------------

  const ui = {};

  function buildPanel() {
    ui.panel = el("section", { class: "panel lab", "aria-labelledby": "qkv-lab-title" });
    ui.panel.append(
      el("h2", { id: "qkv-lab-title", text: "Edit and watch" }),
      el("p", {
        class: "note",
        text:
          "Change an input number, the scaling, the causal mask or the number of heads: " +
          "every step below is computed again in your browser.",
      })
    );
    ui.edit = el("button", { type: "button", id: "qkv-edit", "aria-pressed": "false", text: "Edit numbers" });
    ui.scale = el("select", { id: "qkv-scale" });
    ui.causal = el("input", { type: "checkbox", id: "qkv-causal" });
    ui.heads = el("select", { id: "qkv-heads" });
    ui.reset = el("button", { type: "button", id: "qkv-reset", text: "Back to the example" });
    ui.status = el("p", { class: "note", id: "qkv-lab-status", "aria-live": "polite" });
    const row = el("div", { class: "lab-controls" }, [
      ui.edit,
      el("label", {}, ["Scaling", ui.scale]),
      el("label", { class: "check" }, [ui.causal, "Causal"]),
      el("label", {}, ["Heads", ui.heads]),
      ui.reset,
    ]);
    ui.panel.append(row, ui.status);
    api.ui.side.prepend(ui.panel);
    ui.edit.addEventListener("click", () => {
      const now = current();
      now.st.editing = !now.st.editing;
      ui.edit.setAttribute("aria-pressed", String(now.st.editing));
      if (now.st.editing) results(); // ready before the first edit
      api.renderSteps();
      api.highlight();
      syncControls();
    });
    const option = (update) => () => {
      const now = current();
      update(now.st.options);
      apply();
      syncControls();
    };
    ui.scale.addEventListener("change", option((o) => (o.scale = ui.scale.value)));
    ui.causal.addEventListener("change", option((o) => (o.causal = ui.causal.checked)));
    ui.heads.addEventListener("change", option((o) => (o.heads = Number(ui.heads.value))));
    ui.reset.addEventListener("click", reset);
  }

  function syncControls() {
    const now = current();
    ui.panel.hidden = !now;
    if (!now) return;
    const { call, st } = now;
    ui.scale.replaceChildren(
      ...call.lab.scales.map((s) =>
        el("option", {
          value: s,
          text: s === "given" ? "as given (× " + api.fmt(call.lab.factor) + ")" : SCALE_WORDS[s],
        })
      )
    );
    ui.scale.value = st.options.scale;
    ui.causal.checked = st.options.causal;
    ui.heads.replaceChildren(...call.lab.headOptions.map((h) => el("option", { value: h, text: h })));
    ui.heads.value = String(st.options.heads);
    ui.heads.disabled = call.lab.headOptions.length < 2;
    ui.edit.setAttribute("aria-pressed", String(st.editing));
    ui.status.textContent = call.edited
      ? "Edited: the numbers are recomputed from your inputs; the worked lines of the " +
        "example as written are hidden. “Back to the example” restores it."
      : st.editing
        ? "Type in the cells of the inputs (" + EDITABLE[call.lab.kind].join(", ") + ")."
        : "";
  }

  api.lab = {
    compute: compute,
    matrix: matrix,
    results: results,
    set: set,
    reset: reset,
    options: function () {
      const now = current();
      return now ? Object.assign({}, now.st.options) : null;
    },
    setOptions: function (changes) {
      const now = current();
      if (!now) throw new Error("this call has no inputs to edit");
      Object.assign(now.st.options, changes);
      const result = apply();
      syncControls();
      return result;
    },
  };

  api.extend({
    shell: buildPanel,
    call: syncControls,
    edit: syncControls,
  });
})(window.qkvPage);
