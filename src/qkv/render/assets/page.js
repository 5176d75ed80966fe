/* qkv page: attention, step by step. Written for qkv; no library, no network.
 *
 * The numbers and every label come from the JSON block #qkv-data. They are put on the page
 * with textContent and setAttribute only (never as HTML), so a token that looks like HTML
 * shows as text and runs nothing.
 */
(function () {
  "use strict";

  const SVG_NS = "http://www.w3.org/2000/svg";
  const ROW = 22; // height of a token row in the head view, in px (page.css: --row)
  const LINES_WIDTH = 120; // width of the lines between the two token columns, in px
  const TABLE_MAX = 64; // matrices up to 64 × 64 are tables; larger ones are pictures
  const NUMBERS_MAX = 16; // tables up to 16 columns write their numbers in the cells
  const THIN = 0.005; // with more than 64 keys, lines of smaller weight are not drawn
  const SUM_TERMS = 12; // a weighted sum with more terms shows its largest ones
  const SUM_DIMS = 8; // value dimensions shown in the weighted-sum table

  const data = JSON.parse(document.getElementById("qkv-data").textContent);
  const app = document.getElementById("qkv-app");
  const labels = data.labels;

  const state = { call: 0, head: 0, query: 0, key: null, hover: null };
  const ui = {}; // elements built once
  let tables = []; // the matrices on the page, for highlighting
  let linesFrame = 0;

  // -- small helpers ----------------------------------------------------------------------

  function el(tag, props, children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(props || {})) {
      if (name === "text") node.textContent = value;
      else if (name === "class") node.className = value;
      else node.setAttribute(name, String(value));
    }
    for (const child of children || []) {
      node.append(typeof child === "string" ? document.createTextNode(child) : child);
    }
    return node;
  }

  function svgEl(tag, attrs) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
    return node;
  }

  function fmt(value, precision) {
    const p = precision === undefined ? data.precision : precision;
    if (Number.isNaN(value)) return "nan";
    if (value === -Infinity) return "−∞";
    if (value === Infinity) return "∞";
    let text = value.toFixed(p);
    if (text.startsWith("-") && Number(text) === 0) text = text.slice(1);
    return text;
  }

  function values(step) {
    if (!step.values) {
      const bytes = atob(step.data);
      const buffer = new Uint8Array(bytes.length);
      for (let i = 0; i < bytes.length; i += 1) buffer[i] = bytes.charCodeAt(i);
      const view = new DataView(buffer.buffer);
      const out = new Float32Array(bytes.length / 4);
      for (let i = 0; i < out.length; i += 1) out[i] = view.getFloat32(4 * i, true);
      step.values = out;
    }
    return step.values;
  }

  // -- colours: white to blue for weights; orange (< 0) to purple (> 0) for the others -------

  const BLUES = [[255, 255, 255], [198, 219, 239], [107, 174, 214], [33, 113, 181], [8, 48, 107]];
  const ORANGES = [[255, 255, 255], [253, 184, 99], [230, 97, 1], [127, 59, 8]];
  const PURPLES = [[255, 255, 255], [178, 171, 210], [94, 60, 153], [45, 0, 75]];
  const MASKED = [224, 224, 224];

  function ramp(stops, t) {
    const x = Math.min(1, Math.max(0, t)) * (stops.length - 1);
    const i = Math.min(Math.floor(x), stops.length - 2);
    const f = x - i;
    return stops[i].map((a, c) => Math.round(a + (stops[i + 1][c] - a) * f));
  }

  function scaleOf(step, m) {
    let max = 0;
    let masked = false;
    for (const v of m) {
      if (!Number.isFinite(v)) masked = true;
      else max = Math.max(max, Math.abs(v));
    }
    return { probability: step.scale === "probability", max: max, masked: masked };
  }

  // The same colours in 256 steps per ramp, for pictures of many cells (no array per cell).
  const LUT_STEPS = 255;
  const LUTS = new Map();

  function lut(stops) {
    if (!LUTS.has(stops)) {
      const table = new Uint8ClampedArray(3 * (LUT_STEPS + 1));
      for (let i = 0; i <= LUT_STEPS; i += 1) table.set(ramp(stops, i / LUT_STEPS), 3 * i);
      LUTS.set(stops, table);
    }
    return LUTS.get(stops);
  }

  function colour(v, scale) {
    if (!Number.isFinite(v)) return MASKED;
    const t = scale.max > 0 ? Math.abs(v) / scale.max : 0;
    if (scale.probability) return ramp(BLUES, t);
    return ramp(v < 0 ? ORANGES : PURPLES, t);
  }

  // White or black text, whichever contrasts more with the cell (WCAG relative luminance):
  // the contrast ratio is then at least 4.58 on any background.
  function ink(rgb) {
    const linear = rgb.map((c) => {
      const s = c / 255;
      return s <= 0.03928 ? s / 12.92 : Math.pow((s + 0.055) / 1.055, 2.4);
    });
    const lum = 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2];
    return 1.05 / (lum + 0.05) >= (lum + 0.05) / 0.05 ? "#ffffff" : "#000000";
  }

  function css(rgb) {
    return "rgb(" + rgb.join(", ") + ")";
  }

  // -- what is shown now --------------------------------------------------------------------

  function call() {
    return data.calls[state.call];
  }

  function visibleSections() {
    return call().sections.filter((s) => s.head === null || s.head === state.head);
  }

  function stepFor(name) {
    for (const section of visibleSections()) {
      for (const step of section.steps) if (step.name === name && step.data) return step;
    }
    return null;
  }

  function highlighted() {
    if (state.hover) return state.hover;
    if (state.key !== null) return { axis: "key", index: state.key };
    return { axis: "query", index: state.query };
  }

  function readingQuery() {
    return state.hover && state.hover.axis === "query" ? state.hover.index : state.query;
  }

  // -- the page's frame -----------------------------------------------------------------------

  window.addEventListener("resize", () => {
    if (ui.hv) ui.hv.view = null;
  });

  function buildShell() {
    app.replaceChildren();
    app.append(el("h1", { text: data.title }));
    if (data.description) app.append(el("p", { class: "description", text: data.description }));
    ui.facts = el("dl", { class: "facts" });
    app.append(ui.facts);

    ui.controls = el("div", { class: "controls", role: "group", "aria-label": "What to show" });
    ui.layer = el("select", { id: "qkv-layer" });
    ui.head = el("select", { id: "qkv-head" });
    ui.query = el("select", { id: "qkv-query" });
    ui.layerBox = el("label", {}, ["Layer", ui.layer]);
    ui.headBox = el("label", {}, ["Head", ui.head]);
    ui.queryBox = el("label", {}, ["Query", ui.query]);
    ui.controls.append(
      ui.layerBox,
      ui.headBox,
      ui.queryBox,
      el("p", {
        class: "hint",
        text:
          "Hover or focus a token to highlight its row; click it or press Enter to select it. " +
          "Arrow keys move between tokens, Escape clears.",
      })
    );
    app.append(ui.controls);

    data.calls.forEach((c, i) => ui.layer.append(el("option", { value: i, text: c.name })));
    ui.layer.addEventListener("change", () => selectCall(Number(ui.layer.value)));
    ui.head.addEventListener("change", () => selectHead(Number(ui.head.value)));
    ui.query.addEventListener("change", () => pinQuery(Number(ui.query.value)));

    const layout = el("div", { class: "layout" });
    const side = el("div", { class: "side" });
    ui.headView = el("section", { class: "panel headview", "aria-labelledby": "qkv-hv-title" });
    ui.reading = el("section", { class: "panel reading", "aria-live": "polite" });
    side.append(ui.headView, ui.reading);
    ui.steps = el("div", { class: "steps" });
    layout.append(side, el("section", { "aria-label": "Step by step" }, [ui.steps]));
    app.append(layout);
    ui.side = side;
    ui.extras = el("div", { class: "extras" }); // panels that parts add below the steps
    app.append(ui.extras);
  }

  function selectCall(index) {
    state.call = index;
    state.head = 0;
    state.query = call().query;
    state.key = null;
    state.hover = null;
    ui.layer.value = String(index);
    ui.layerBox.hidden = data.calls.length < 2;
    ui.facts.replaceChildren();
    for (const [label, text] of call().facts) {
      ui.facts.append(el("dt", { text: label }), el("dd", { text: text }));
    }
    ui.head.replaceChildren();
    for (const section of call().sections) {
      if (section.head !== null) {
        ui.head.append(el("option", { value: section.head, text: section.title }));
      }
    }
    ui.headBox.hidden = call().heads < 2 || ui.head.options.length < 2;
    buildHeadView();
    notify("call");
    selectHead(0);
  }

  // After the call's numbers or its sections changed (an edit): rebuild the head choices, the
  // head view and the steps, keeping the selected head and query where they still exist.
  function redraw() {
    const keep = { head: state.head, query: state.query, key: state.key };
    ui.facts.replaceChildren();
    for (const [label, text] of call().facts) {
      ui.facts.append(el("dt", { text: label }), el("dd", { text: text }));
    }
    ui.head.replaceChildren();
    for (const section of call().sections) {
      if (section.head !== null) {
        ui.head.append(el("option", { value: section.head, text: section.title }));
      }
    }
    ui.headBox.hidden = call().heads < 2 || ui.head.options.length < 2;
    state.head = Math.min(keep.head, Math.max(0, ui.head.options.length - 1));
    const weights = stepFor("weights");
    const shape = weights ? weights.rows + "|" + weights.cols + "|" + weights.shape.join("×") : "";
    if (!ui.hv || ui.hvShape !== shape) buildHeadView(); // the same tokens: keep the buttons
    ui.hvShape = shape;
    const lq = weights ? weights.shape[0] : 0;
    state.query = Math.min(keep.query, Math.max(0, lq - 1));
    state.key = keep.key !== null && weights && keep.key < weights.shape[1] ? keep.key : null;
    if (ui.head.options.length) ui.head.value = String(state.head);
    if (ui.hv) ui.query.value = String(state.query);
    renderSteps();
    refreshHeadView();
    highlight();
  }

  function selectHead(index) {
    state.head = index;
    if (ui.head.options.length) ui.head.value = String(index);
    renderSteps();
    refreshHeadView();
    highlight();
    notify("head");
  }

  function pinQuery(index) {
    state.query = index;
    state.key = null;
    ui.query.value = String(index);
    highlight();
  }

  function setHover(hover) {
    const same =
      (hover === null && state.hover === null) ||
      (hover && state.hover && hover.axis === state.hover.axis && hover.index === state.hover.index);
    if (same) return;
    state.hover = hover;
    highlight();
  }

  // -- head view: queries, lines whose thickness is the weight, keys ------------------------

  function buildHeadView() {
    const box = ui.headView;
    const shown = stepFor("weights");
    ui.hvShape = shown ? shown.rows + "|" + shown.cols + "|" + shown.shape.join("×") : "";
    box.replaceChildren(el("h2", { id: "qkv-hv-title", text: "Head view" }));
    ui.hv = null;
    const weights = stepFor("weights");
    if (!weights || weights.rowAxis !== "query" || weights.colAxis !== "key") {
      box.append(el("p", { class: "note", text: "This trace has no attention weights to draw." }));
      ui.queryBox.hidden = true;
      return;
    }
    const queries = labels[weights.rows];
    const keys = labels[weights.cols];
    box.append(
      el("p", {
        class: "note",
        text:
          "Each line joins a query (left) to a key (right); its thickness is the attention " +
          "weight. Hover or focus a query to see where it attends, a key to see who attends to it.",
      })
    );
    const scroll = el("div", { class: "hv-scroll" });
    const inner = el("div", { class: "hv-inner" });
    const height = Math.max(queries.length, keys.length) * ROW;
    inner.style.height = height + "px";
    const qCol = el("div", { class: "hv-col q", role: "group", "aria-label": "Queries" });
    const kCol = el("div", { class: "hv-col k", role: "group", "aria-label": "Keys" });
    const svg = svgEl("svg", { class: "lines", width: LINES_WIDTH, height: height });
    svg.setAttribute("aria-hidden", "true");
    const qButtons = queries.map((label, i) => tokenButton("query", i, label, qCol));
    const kButtons = keys.map((label, j) => tokenButton("key", j, label, kCol));
    inner.append(qCol, svg, kCol);
    scroll.append(inner);
    box.append(scroll);
    ui.hvNote = el("p", { class: "note" });
    box.append(ui.hvNote);
    scroll.addEventListener("scroll", () => {
      ui.hv.view = null; // measured again on the next drawing
      if (!linesFrame) linesFrame = requestAnimationFrame(drawLines);
    });
    ui.hv = { scroll: scroll, svg: svg, qButtons: qButtons, kButtons: kButtons, view: null };
    ui.queryBox.hidden = false;
    ui.query.replaceChildren();
    queries.forEach((label, i) => ui.query.append(el("option", { value: i, text: label })));
    ui.query.value = String(state.query);
    qButtons[Math.min(state.query, qButtons.length - 1)].tabIndex = 0;
    kButtons[0].tabIndex = 0;
  }

  function tokenButton(axis, index, label, column) {
    const button = el("button", {
      type: "button",
      class: "tok",
      tabindex: -1,
      "data-axis": axis,
      "data-index": index,
      "aria-label": (axis === "query" ? "query " : "key ") + label,
    });
    if (axis === "key") button.append(el("span", { class: "w" }));
    button.append(el("span", { class: "t", text: label }));
    if (axis === "query") button.setAttribute("aria-pressed", "false");
    button.addEventListener("mouseenter", () => setHover({ axis: axis, index: index }));
    button.addEventListener("mouseleave", () => setHover(null));
    button.addEventListener("focus", () => {
      for (const other of column.children) other.tabIndex = -1;
      button.tabIndex = 0;
      setHover({ axis: axis, index: index });
    });
    button.addEventListener("blur", () => setHover(null));
    button.addEventListener("click", () => {
      if (axis === "query") pinQuery(index);
      else {
        state.key = state.key === index ? null : index;
        highlight();
      }
    });
    button.addEventListener("keydown", (event) => {
      const buttons = column.children;
      let next = null;
      if (event.key === "ArrowDown") next = Math.min(index + 1, buttons.length - 1);
      else if (event.key === "ArrowUp") next = Math.max(index - 1, 0);
      else if (event.key === "Home") next = 0;
      else if (event.key === "End") next = buttons.length - 1;
      else if (event.key === "Escape") {
        state.key = null;
        button.blur();
        setHover(null);
        event.preventDefault();
        return;
      }
      if (next !== null) {
        event.preventDefault();
        buttons[next].focus();
        buttons[next].scrollIntoView({ block: "nearest" });
      }
    });
    column.append(button);
    return button;
  }

  function refreshHeadView() {
    if (!ui.hv) return;
    const weights = stepFor("weights");
    const lk = weights.shape[1];
    ui.hvNote.textContent =
      lk > TABLE_MAX
        ? "Lines are drawn for the queries in view, and only those of weight " +
          fmt(THIN, 3) +
          " or more (" +
          lk +
          " keys); scroll to see the others."
        : "";
  }

  function drawLines() {
    linesFrame = 0;
    if (!ui.hv) return;
    const weights = stepFor("weights");
    const m = values(weights);
    const [lq, lk] = weights.shape;
    const scroll = ui.hv.scroll;
    // The rows in view, measured once per scroll or resize: reading them forces a layout,
    // which an edit that redraws every step would otherwise pay twice.
    if (!ui.hv.view) ui.hv.view = { top: scroll.scrollTop, height: scroll.clientHeight };
    const top = ui.hv.view.top;
    const bottom = top + (ui.hv.view.height || Math.max(lq, lk) * ROW);
    const first = Math.max(0, Math.floor(top / ROW) - 2);
    const last = Math.ceil(bottom / ROW) + 2;
    const thin = lk > TABLE_MAX ? THIN : 0;
    const on = highlighted();
    const chosen = new Map();
    const add = (q, k) => {
      const w = m[q * lk + k];
      if (w > thin || (w > 0 && isOn(on, q, k))) chosen.set(q * lk + k, w);
    };
    for (let q = first; q < Math.min(last, lq); q += 1) for (let k = 0; k < lk; k += 1) add(q, k);
    if (on.axis === "query" && on.index < lq) for (let k = 0; k < lk; k += 1) add(on.index, k);
    if (on.axis === "key" && on.index < lk) for (let q = 0; q < lq; q += 1) add(q, on.index);
    const fragment = document.createDocumentFragment();
    for (const [cell, w] of chosen) {
      const q = Math.floor(cell / lk);
      const k = cell % lk;
      const line = svgEl("line", {
        x1: 0,
        y1: q * ROW + ROW / 2,
        x2: LINES_WIDTH,
        y2: k * ROW + ROW / 2,
        "stroke-width": (0.6 + 7.4 * w).toFixed(2),
        "stroke-opacity": (0.2 + 0.8 * w).toFixed(3),
        "data-q": q,
        "data-k": k,
      });
      if (isOn(on, q, k)) line.setAttribute("class", "on");
      fragment.append(line);
    }
    ui.hv.svg.replaceChildren(fragment);
    ui.hv.svg.setAttribute("class", "lines active");
  }

  function isOn(on, q, k) {
    return on.axis === "query" ? q === on.index : k === on.index;
  }

  // -- the steps ------------------------------------------------------------------------------

  function renderSteps() {
    // The card that holds the focus (an input cell being typed in) stays in the page, its
    // colours redrawn, when the same step comes again: moving it would lose the focus.
    const focused = document.activeElement;
    const typing = focused && focused.matches("input.cell-edit") && ui.steps.contains(focused);
    const held = typing ? focused.closest("article.step") : null;
    const nodes = [el("h2", { text: "Step by step" })];
    let kept = null;
    tables = [];
    for (const section of visibleSections()) {
      if (section.title) nodes.push(el("h3", { class: "section-title", text: section.title }));
      for (const step of section.steps) {
        if (!kept && held && sameStep(held, step, section.head)) {
          kept = held;
          recolour(held, step);
          nodes.push(held);
        } else {
          const card = stepCard(step);
          card.qkvHead = section.head;
          nodes.push(card);
        }
      }
    }
    if (!kept) {
      ui.steps.replaceChildren(...nodes);
      return;
    }
    for (const child of Array.from(ui.steps.children)) if (child !== kept) child.remove();
    const at = nodes.indexOf(kept);
    kept.before(...nodes.slice(0, at));
    kept.after(...nodes.slice(at + 1));
  }

  function sameStep(card, step, head) {
    const old = card.qkvStep;
    return (
      old &&
      card.qkvHead === head &&
      old.name === step.name &&
      old.number === step.number &&
      old.rows === step.rows &&
      old.cols === step.cols &&
      old.data &&
      step.data &&
      String(old.shape) === String(step.shape)
    );
  }

  // A kept card shows the new numbers' colours and legend (its cells keep their editors).
  function recolour(card, step) {
    const entry = card.qkvTable;
    card.qkvStep = step;
    if (!entry) return;
    entry.step = step;
    tables.push(entry);
    const m = values(step);
    const scale = scaleOf(step, m);
    const legendNode = card.querySelector(".legend");
    if (legendNode) legendNode.textContent = legend(scale);
    if (entry.kind !== "table") return;
    const c = step.shape[1];
    entry.cells.forEach((line, i) =>
      line.forEach((td, j) => {
        const v = m[i * c + j];
        const rgb = colour(v, scale);
        td.style.background = css(rgb);
        td.style.color = ink(rgb);
        if (!td.firstElementChild) {
          if (td.title) td.title = labels[step.rows][i] + ", " + labels[step.cols][j] + ": " + fmt(v);
          else td.textContent = fmt(v);
        }
      })
    );
  }

  function stepCard(step) {
    const card = el("article", { class: "step", "data-step": step.name });
    card.qkvStep = step;
    card.append(el("h3", { text: "Step " + step.number + ". " + step.title }));
    card.append(el("p", { class: "formula", text: step.formula }));
    if (step.meaning) card.append(el("p", { text: step.meaning }));
    if (step.data) {
      card.append(matrixView(step));
      card.qkvTable = tables[tables.length - 1];
    }
    if (step.equations.length) {
      const box = el("div", { class: "equations", role: "group", "aria-label": "worked lines" });
      for (const line of step.equations) box.append(el("div", { text: line }));
      card.append(box);
    }
    for (const note of step.notes) card.append(el("p", { class: "note", text: note }));
    if (step.name === "context") {
      card.append(
        el("p", {
          class: "note",
          text: step.weightedSum
            ? "Each context vector is the weighted sum of the value vectors: select a query " +
              "to read it term by term (panel “Context vector”)."
            : "Here C is not A·V of the recorded steps, so no weighted sum is written.",
        })
      );
    }
    return card;
  }

  function matrixView(step) {
    const [r, c] = step.shape;
    const m = values(step);
    const scale = scaleOf(step, m);
    const box = el("div", { class: "matrix-box" });
    if (r <= TABLE_MAX && c <= TABLE_MAX) box.append(tableView(step, m, scale));
    else box.append(pictureView(step, m, scale));
    box.append(el("p", { class: "legend", text: legend(scale) }));
    return box;
  }

  function legend(scale) {
    let text = scale.probability
      ? "Colour: white = 0, darkest blue = " + fmt(scale.max) + "."
      : "Colour: orange below 0, purple above 0, darkest at ±" + fmt(scale.max) + ".";
    if (scale.masked) text += " Grey: −∞ (masked: weight 0).";
    return text;
  }

  function tableView(step, m, scale) {
    const [r, c] = step.shape;
    const rows = labels[step.rows];
    const cols = labels[step.cols];
    const compact = c > NUMBERS_MAX;
    const table = el("table", { class: compact ? "matrix compact" : "matrix" });
    table.append(el("caption", { class: "visually-hidden", text: step.title }));
    const headRow = el("tr", {}, [el("th", { scope: "col", text: step.corner || "" })]);
    const colHeads = cols.map((label) => el("th", { scope: "col", text: label }));
    headRow.append(...colHeads);
    const sums = step.name === "weights";
    if (sums) headRow.append(el("th", { scope: "col", text: "sum" }));
    table.append(el("thead", {}, [headRow]));
    const body = el("tbody");
    const cells = [];
    const rowHeads = [];
    for (let i = 0; i < r; i += 1) {
      const head = el("th", { scope: "row", text: rows[i] });
      const tr = el("tr", {}, [head]);
      const line = [];
      let total = 0;
      for (let j = 0; j < c; j += 1) {
        const v = m[i * c + j];
        if (Number.isFinite(v)) total += v;
        const rgb = colour(v, scale);
        const td = el("td", compact ? { title: rows[i] + ", " + cols[j] + ": " + fmt(v) } : {});
        const editor = api.editCell ? api.editCell(step, i, j, v) : null;
        if (editor) td.append(editor);
        else if (!compact) td.textContent = fmt(v);
        td.style.background = css(rgb);
        td.style.color = ink(rgb);
        line.push(td);
        tr.append(td);
      }
      if (sums) tr.append(el("td", { class: "sum", text: fmt(total) }));
      cells.push(line);
      rowHeads.push(head);
      body.append(tr);
    }
    table.append(body);
    tables.push({ step: step, kind: "table", cells: cells, rowHeads: rowHeads, colHeads: colHeads });
    return el("div", { class: "scroll" }, [table]);
  }

  function pictureView(step, m, scale) {
    const [r, c] = step.shape;
    const rows = labels[step.rows];
    const cols = labels[step.cols];
    const canvas = el("canvas", {
      width: c,
      height: r,
      tabindex: 0,
      role: "img",
      "aria-label":
        step.title + ": " + r + " × " + c + " values drawn as a picture; arrow keys read a cell.",
    });
    const sx = Math.max(1, Math.min(12, Math.floor(640 / c)));
    const sy = Math.max(1, Math.min(12, Math.floor(640 / r)));
    canvas.style.width = c * sx + "px";
    canvas.style.height = r * sy + "px";
    const context = canvas.getContext("2d");
    const image = context.createImageData(c, r);
    const pixels = image.data;
    const [blues, oranges, purples] = [lut(BLUES), lut(ORANGES), lut(PURPLES)];
    const unit = scale.max > 0 ? LUT_STEPS / scale.max : 0;
    for (let i = 0; i < r * c; i += 1) {
      const v = m[i];
      const at = 4 * i;
      pixels[at + 3] = 255;
      if (!Number.isFinite(v)) {
        pixels[at] = MASKED[0];
        pixels[at + 1] = MASKED[1];
        pixels[at + 2] = MASKED[2];
        continue;
      }
      const table = scale.probability ? blues : v < 0 ? oranges : purples;
      const k = 3 * Math.min(LUT_STEPS, Math.round(Math.abs(v) * unit));
      pixels[at] = table[k];
      pixels[at + 1] = table[k + 1];
      pixels[at + 2] = table[k + 2];
    }
    context.putImageData(image, 0, 0);
    const rowMark = el("div", { class: "mark" });
    const colMark = el("div", { class: "mark" });
    const cellMark = el("div", { class: "mark" });
    const picture = el("div", { class: "picture" }, [canvas, rowMark, colMark, cellMark]);
    const readout = el("p", { class: "readout", "aria-live": "polite" });
    const cursor = { i: 0, j: 0 };
    const show = (i, j) => {
      cursor.i = i;
      cursor.j = j;
      readout.textContent = rows[i] + ", " + cols[j] + ": " + fmt(m[i * c + j]);
      place(cellMark, j / c, i / r, 1 / c, 1 / r);
    };
    canvas.addEventListener("mousemove", (event) => {
      const box = canvas.getBoundingClientRect();
      const j = Math.min(c - 1, Math.floor(((event.clientX - box.left) / box.width) * c));
      const i = Math.min(r - 1, Math.floor(((event.clientY - box.top) / box.height) * r));
      if (i >= 0 && j >= 0) show(i, j);
    });
    canvas.addEventListener("keydown", (event) => {
      const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] };
      const move = moves[event.key];
      if (!move) return;
      event.preventDefault();
      show(
        Math.min(r - 1, Math.max(0, cursor.i + move[0])),
        Math.min(c - 1, Math.max(0, cursor.j + move[1]))
      );
    });
    tables.push({ step: step, kind: "picture", rowMark: rowMark, colMark: colMark });
    const note = el("p", {
      class: "note",
      text:
        r + " × " + c + ": too many cells for a table, drawn as a picture (one pixel per " +
        "value). Hover it, or focus it and use the arrow keys, to read a value.",
    });
    const editor = api.editPicture ? api.editPicture(step) : null;
    return el("div", {}, editor ? [note, picture, readout, editor] : [note, picture, readout]);
  }

  function place(mark, x, y, w, h) {
    mark.style.left = x * 100 + "%";
    mark.style.top = y * 100 + "%";
    mark.style.width = "max(2px, " + w * 100 + "%)";
    mark.style.height = "max(2px, " + h * 100 + "%)";
    mark.style.display = "block";
  }

  // -- highlighting ---------------------------------------------------------------------------

  let lit = [];

  function highlight() {
    for (const node of lit) node.classList.remove("on");
    lit = [];
    const on = highlighted();
    const light = (node) => {
      node.classList.add("on");
      lit.push(node);
    };
    for (const t of tables) {
      const rowHit = rowMatches(t.step, on);
      const colHit = on.axis === "key" && t.step.colAxis === "key";
      if (t.kind === "table") {
        if (rowHit && on.index < t.cells.length) {
          light(t.rowHeads[on.index]);
          t.cells[on.index].forEach(light);
        }
        if (colHit && on.index < t.colHeads.length) {
          light(t.colHeads[on.index]);
          for (const line of t.cells) light(line[on.index]);
        }
      } else {
        const [r, c] = t.step.shape;
        if (rowHit && on.index < r) place(t.rowMark, 0, on.index / r, 1, 1 / r);
        else t.rowMark.style.display = "none";
        if (colHit && on.index < c) place(t.colMark, on.index / c, 0, 1 / c, 1);
        else t.colMark.style.display = "none";
      }
    }
    if (ui.hv) {
      ui.hv.qButtons.forEach((b, i) => {
        if (on.axis === "query" && i === on.index) light(b);
        b.setAttribute("aria-pressed", String(i === state.query));
      });
      if (on.axis === "key" && on.index < ui.hv.kButtons.length) light(ui.hv.kButtons[on.index]);
      const weights = stepFor("weights");
      const m = values(weights);
      const lk = weights.shape[1];
      const q = readingQuery();
      ui.hv.kButtons.forEach((b, k) => {
        b.firstChild.textContent = fmt(m[q * lk + k]);
      });
      ui.query.value = String(state.query);
      drawLines();
    }
    renderReading();
    notify("highlight");
  }

  function rowMatches(step, on) {
    if (on.axis === "query") return step.rowAxis === "query" || step.rowAxis === "token";
    return step.rowAxis === "key";
  }

  // -- the context vector as a weighted sum ----------------------------------------------------

  function renderReading() {
    const box = ui.reading;
    box.replaceChildren(el("h2", { text: "Context vector" }));
    const context = stepFor("context");
    const weights = stepFor("dropout") || stepFor("weights");
    const value = stepFor("V");
    if (!context || !weights || !value || !context.weightedSum) {
      box.append(
        el("p", {
          class: "note",
          text: "This trace has no context vectors to read as weighted sums of value vectors.",
        })
      );
      return;
    }
    const q = readingQuery();
    const lk = weights.shape[1];
    const dv = value.shape[1];
    const a = values(weights).subarray(q * lk, (q + 1) * lk);
    const v = values(value);
    const cRow = values(context).subarray(q * dv, (q + 1) * dv);
    const query = labels[weights.rows][q];
    const keys = labels[weights.cols];
    let terms = [];
    for (let j = 0; j < lk; j += 1) if (a[j] !== 0) terms.push(j);
    const all = terms.length;
    let rest = 0;
    if (all > SUM_TERMS) {
      const largest = terms.slice().sort((x, y) => a[y] - a[x] || x - y).slice(0, SUM_TERMS);
      const keep = new Set(largest);
      for (const j of terms) if (!keep.has(j)) rest += a[j];
      terms = terms.filter((j) => keep.has(j));
    }
    const vector = (row) => "[" + Array.from(row, (x) => fmt(x)).join(", ") + "]";
    let line = "c_" + query + " = ";
    line += terms.map((j) => fmt(a[j]) + "·v_" + keys[j]).join(" + ") || "0";
    if (rest || all > terms.length) {
      line += " + … (" + (all - terms.length) + " more terms, weight " + fmt(rest) + " together)";
    }
    line += " = " + vector(cRow);
    box.append(
      el("p", { text: "The context vector of the query “" + query + "”:" }),
      el("p", { class: "eq", text: line })
    );
    const shownDims = Math.min(dv, SUM_DIMS);
    const table = el("table", { class: "terms" });
    const head = el("tr", {}, [
      el("th", { scope: "col", text: "key" }),
      el("th", { scope: "col", text: "weight" }),
    ]);
    for (let d = 0; d < shownDims; d += 1) {
      head.append(el("th", { scope: "col", text: "w·v[d" + (d + 1) + "]" }));
    }
    table.append(el("thead", {}, [head]));
    const body = el("tbody");
    const widest = Math.max(...terms.map((j) => a[j]), 1e-12);
    for (const j of terms) {
      const bar = el("span", { class: "bar" });
      bar.style.width = Math.round((48 * a[j]) / widest) + "px";
      const tr = el("tr", {}, [
        el("td", { text: keys[j], title: keys[j] }),
        el("td", {}, [bar, fmt(a[j])]),
      ]);
      for (let d = 0; d < shownDims; d += 1) tr.append(el("td", { text: fmt(a[j] * v[j * dv + d]) }));
      body.append(tr);
    }
    const total = el("tr", { class: "sum" }, [
      el("td", { text: "c_" + query, title: "c_" + query }),
      el("td", { text: fmt(Array.from(a).reduce((s, x) => s + x, 0)) }),
    ]);
    for (let d = 0; d < shownDims; d += 1) total.append(el("td", { text: fmt(cRow[d]) }));
    body.append(total);
    table.append(body);
    box.append(el("div", { class: "scroll" }, [table]));
    const notes = [];
    if (all < lk) notes.push("Keys with weight 0 (masked) add nothing and are left out.");
    if (dv > shownDims) notes.push("The first " + shownDims + " of " + dv + " dimensions.");
    if (terms.length) {
      const j = terms[0];
      notes.push(
        "Read it as: " +
          fmt(a[j]) +
          " times the value vector of “" +
          keys[j] +
          "”, plus the other terms; each column adds up to c_" +
          query +
          "."
      );
    }
    for (const note of notes) box.append(el("p", { class: "note", text: note }));
  }

  // -- parts added by other files, and the start -------------------------------------------
  //
  // The page is one script made of several files (render/_html.py: SCRIPTS). This file goes
  // first and defines window.qkvPage; every later file adds a part of the page with
  // qkvPage.extend({ shell(api), call(api), head(api), highlight(api), edit(api) }), whose
  // functions run after the page's frame is built, after a layer is selected, after a head is
  // selected, after the highlighted query or key changes, and after the learner edits the
  // call's inputs or options (lab.js; api.edited() then says whether the call's numbers
  // differ from the example as written). api.editCell(step, i, j, value) and
  // api.editPicture(step), when a part defines them, give the editor of a table cell or of a
  // large matrix (null: not editable). The page starts (qkvPage.start()) once every file has
  // been read.

  const parts = [];

  function notify(moment) {
    for (const part of parts) if (part[moment]) part[moment](api);
  }

  const api = {
    data: data,
    app: app,
    labels: labels,
    state: state,
    ui: ui,
    el: el,
    svgEl: svgEl,
    fmt: fmt,
    values: values,
    scaleOf: scaleOf,
    colour: colour,
    ink: ink,
    css: css,
    call: call,
    stepFor: stepFor,
    visibleSections: visibleSections,
    selectCall: selectCall,
    selectHead: selectHead,
    pinQuery: pinQuery,
    renderSteps: renderSteps,
    refreshHeadView: refreshHeadView,
    highlight: highlight,
    readingQuery: readingQuery,
    highlighted: highlighted,
    redraw: redraw,
    notify: notify,
    editCell: null,
    editPicture: null,
    edited: function () {
      return Boolean(call().edited);
    },
    extend: function (part) {
      parts.push(part);
    },
    start: function () {
      try {
        buildShell();
        notify("shell");
        selectCall(0);
        app.setAttribute("aria-busy", "false");
      } catch (error) {
        app.replaceChildren(el("p", { text: "qkv: this page could not be shown: " + error.message }));
        throw error;
      }
    },
  };
  window.qkvPage = api;
})();
