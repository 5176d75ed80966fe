/* qkv page, model view: a layer × head grid of small attention-weight maps.
 *
 * One row per layer, one map per head (data.modelView, built by render/_model_view.py):
 * each map is the head's attention weights for the query rows the page holds, pooled to at
 * most 24 × 24 cells and drawn on a canvas. Clicking a map, or Enter or Space on it,
 * selects that layer and head: the head view and the step by step follow, for the query
 * selected. The grid is one stop of the Tab key; the arrow keys, Home and End move in it.
 * Every map has its numbers in its label (title and aria-label). Text goes in with
 * textContent and setAttribute only.
 */
(function () {
  "use strict";

  const page = window.qkvPage;
  const view = page.data.modelView;
  if (!view) return;

  const cells = []; // cells[r][h]: { button, cell, row, map }
  let focused = { r: 0, h: 0 };
  let shownQuery = -1;

  function bytes(map) {
    if (!map.bytes) {
      const text = atob(map.data);
      map.bytes = new Uint8Array(text.length);
      for (let i = 0; i < text.length; i += 1) map.bytes[i] = text.charCodeAt(i);
    }
    return map.bytes;
  }

  function draw(canvas, map) {
    const [r, c] = map.shape;
    canvas.width = c;
    canvas.height = r;
    const context = canvas.getContext("2d");
    const image = context.createImageData(c, r);
    const scale = { probability: true, max: 255, masked: false };
    const values = bytes(map);
    for (let i = 0; i < r * c; i += 1) {
      const rgb = page.colour(values[i], scale);
      image.data.set([rgb[0], rgb[1], rgb[2], 255], 4 * i);
    }
    context.putImageData(image, 0, 0);
  }

  // What a map says in words: the query selected and the key it attends to most.
  function describe(row, map, query) {
    const queries = page.labels[row.queries];
    const keys = page.labels[row.keys];
    const q = Math.min(query, map.top.length - 1);
    const [k, w] = map.top[q];
    return (
      row.name + ", " + map.title + ": query " + queries[q] + " attends most to " + keys[k] +
      " (weight " + page.fmt(w) + "); largest share in the map " + page.fmt(map.max) + "."
    );
  }

  function label(query) {
    if (query === shownQuery) return;
    shownQuery = query;
    cells.forEach((line, r) =>
      line.forEach((item) => {
        const text = describe(view.rows[r], item.map, query);
        item.button.setAttribute("aria-label", text);
        item.button.title = text;
      })
    );
  }

  function choose(r, h) {
    const row = view.rows[r];
    const query = page.state.query;
    if (page.state.call !== row.call) page.selectCall(row.call);
    if (page.state.head !== row.heads[h].head) page.selectHead(row.heads[h].head);
    const weights = page.stepFor("weights");
    if (weights && query < weights.shape[0] && page.state.query !== query) page.pinQuery(query);
    mark();
  }

  function mark() {
    cells.forEach((line, r) =>
      line.forEach((item, h) => {
        const on =
          view.rows[r].call === page.state.call && item.map.head === page.state.head;
        item.cell.setAttribute("aria-selected", String(on));
        item.button.classList.toggle("on", on);
        if (on) focused = { r: r, h: h };
      })
    );
    cells.forEach((line) => line.forEach((item) => (item.button.tabIndex = -1)));
    const current = cells[focused.r] && cells[focused.r][focused.h];
    if (current) current.button.tabIndex = 0;
    label(page.state.query);
  }

  function move(r, h, event) {
    const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1] };
    let next = null;
    if (moves[event.key]) next = [r + moves[event.key][0], h + moves[event.key][1]];
    else if (event.key === "Home") next = [event.ctrlKey ? 0 : r, 0];
    else if (event.key === "End") {
      const last = event.ctrlKey ? cells.length - 1 : r;
      next = [last, cells[last].length - 1];
    }
    if (!next) return;
    event.preventDefault();
    const nr = Math.min(cells.length - 1, Math.max(0, next[0]));
    const nh = Math.min(cells[nr].length - 1, Math.max(0, next[1]));
    for (const line of cells) for (const item of line) item.button.tabIndex = -1;
    cells[nr][nh].button.tabIndex = 0;
    cells[nr][nh].button.focus();
  }

  function build(api) {
    const el = api.el;
    const most = Math.max(...view.rows.map((row) => row.heads.length));
    const box = el("section", {
      class: "panel modelview",
      "aria-labelledby": "qkv-mv-title",
    });
    box.append(
      el("h2", { id: "qkv-mv-title", text: "Model view" }),
      el("p", {
        class: "note",
        text:
          "Each map is one head's attention weights (rows: the queries, columns: the keys, " +
          "darker = more). Click a map, or use the arrow keys and Enter, to show that layer " +
          "and head below.",
      })
    );
    const grid = el("div", {
      class: "mv-grid",
      role: "grid",
      "aria-labelledby": "qkv-mv-title",
      "aria-rowcount": view.rows.length + 1,
      "aria-colcount": most + 1,
    });
    grid.style.gridTemplateColumns = "minmax(6em, max-content) repeat(" + most + ", 36px)";
    const header = el("div", { class: "mv-row", role: "row" }, [
      el("span", { class: "mv-corner", role: "columnheader", text: "layer \\ head" }),
    ]);
    for (let h = 0; h < most; h += 1) {
      // the head's own number (from 0, as everywhere on the page) when every layer agrees
      const numbers = new Set(
        view.rows.filter((row) => h < row.heads.length).map((row) => row.heads[h].number)
      );
      const text = numbers.size === 1 ? String([...numbers][0]) : "";
      header.append(el("span", { class: "mv-head", role: "columnheader", text: text }));
    }
    grid.append(header);
    view.rows.forEach((row, r) => {
      const line = el("div", { class: "mv-row", role: "row" }, [
        el("span", { class: "mv-layer", role: "rowheader", title: row.name, text: row.name }),
      ]);
      cells.push(
        row.heads.map((map, h) => {
          // one query row: a strip, not a square
          const canvas = el("canvas", {
            "aria-hidden": "true",
            class: map.shape[0] === 1 ? "strip" : "",
          });
          draw(canvas, map);
          const button = el("button", { type: "button", class: "mv-map", tabindex: -1 }, [canvas]);
          button.dataset.call = String(row.call);
          button.dataset.head = String(map.head);
          button.addEventListener("click", () => choose(r, h));
          button.addEventListener("keydown", (event) => move(r, h, event));
          const cell = el("span", { role: "gridcell", "aria-selected": "false" }, [button]);
          line.append(cell);
          return { button: button, cell: cell, map: map };
        })
      );
      grid.append(line);
    });
    box.append(el("div", { class: "mv-scroll" }, [grid]));
    api.ui.modelView = box;
    api.ui.controls.after(box);
    const start = view.start;
    if (start) queueMicrotask(() => choose(...startCell(start)));
  }

  function startCell(start) {
    const r = Math.max(0, view.rows.findIndex((row) => row.call === start.call));
    const h = Math.max(0, view.rows[r].heads.findIndex((map) => map.head === start.head));
    return [r, h];
  }

  page.extend({
    shell: build,
    call: mark,
    head: mark,
    highlight: () => label(page.state.query),
  });
})();
