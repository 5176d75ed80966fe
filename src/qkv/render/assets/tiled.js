(function () {
  "use strict";
  // The tiles of qkv explain --tiled: a grid lit as the forward pass visits it. Text is set
  // with textContent only; the data is read from the page's JSON block, nothing is fetched.
  var data = JSON.parse(document.getElementById("qkv-data").textContent);
  var app = document.getElementById("qkv-tiled");
  var digits = data.precision;
  var state = { head: 0, step: 0 };

  function el(tag, text, cls) {
    var node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = text;
    if (cls) node.className = cls;
    return node;
  }

  function fmt(v) {
    if (v === "-inf") return "−∞";
    if (v === "inf") return "∞";
    var text = Number(v).toFixed(digits);
    return Number(text) === 0 ? Math.abs(0).toFixed(digits) : text.replace("-", "−");
  }

  function matrix(caption, rows, rowLabels, colLabels) {
    var table = el("table", null, "matrix");
    table.appendChild(el("caption", caption));
    var head = el("tr");
    head.appendChild(el("th", ""));
    colLabels.forEach(function (label) { head.appendChild(el("th", label)); });
    table.appendChild(head);
    rows.forEach(function (row, r) {
      var tr = el("tr");
      tr.appendChild(el("th", rowLabels[r]));
      row.forEach(function (v) { tr.appendChild(el("td", fmt(v))); });
      table.appendChild(tr);
    });
    return table;
  }

  function column(values) { return values.map(function (v) { return [v]; }); }

  function dims(width, prefix) {
    var out = [];
    for (var c = 0; c < width; c++) out.push(prefix + (c + 1));
    return out;
  }

  function labels(list, bounds) { return list.slice(bounds[0], bounds[1]); }

  function head() { return data.heads[state.head]; }

  var header = el("div");
  var gridBox = el("div");
  var controls = el("div", null, "controls");
  var detail = el("section");
  detail.setAttribute("aria-live", "polite");
  var summary = el("section");
  var backward = el("section");
  var buttons = [];

  function buildHeader() {
    header.appendChild(el("h1", data.title));
    header.appendChild(el("p", "Attention computed the way FlashAttention computes it: tiles " +
      "of " + data.block_size + " queries × " + data.block_size + " keys; each query row " +
      "keeps a running maximum m, a running sum l and an accumulator O, updated tile by tile."));
    header.appendChild(el("p", "Scale " + fmt(data.scale) + "; mask: " + (data.mask || "none") +
      "; log-sum-exp in natural log."));
    if (data.heads.length > 1) {
      var label = el("label", "Head ");
      var select = el("select");
      select.id = "qkv-head";
      data.heads.forEach(function (_, h) {
        var option = el("option", String(h));
        option.value = String(h);
        select.appendChild(option);
      });
      select.addEventListener("change", function () {
        state.head = Number(select.value);
        state.step = 0;
        drawAll();
      });
      label.appendChild(select);
      header.appendChild(label);
    }
  }

  function buildGrid() {
    gridBox.textContent = "";
    buttons = [];
    var h = head();
    var tiles = h.forward;
    gridBox.appendChild(el("h2", "The tiles: query blocks × key blocks"));
    var table = el("table", null, "grid");
    table.setAttribute("role", "grid");
    table.setAttribute("aria-label", "tiles, in the order the forward pass visits them");
    var top = el("tr");
    top.appendChild(el("th", ""));
    var nk = h.kinds[0].length;
    for (var j = 0; j < nk; j++) {
      top.appendChild(el("th", "key block " + j + ": " + labels(data.keys, tiles[j].cols).join(", ")));
    }
    table.appendChild(top);
    for (var i = 0; i < h.kinds.length; i++) {
      var tr = el("tr");
      tr.appendChild(el("th", "query block " + i + ": " + labels(data.queries, tiles[i * nk].rows).join(", ")));
      for (var k = 0; k < nk; k++) {
        var index = i * nk + k;
        var td = el("td");
        var button = el("button", tiles[index].kind, tiles[index].kind);
        button.type = "button";
        button.setAttribute("aria-label", "tile query block " + i + ", key block " + k + ": " +
          tiles[index].kind);
        button.dataset.step = String(index);
        button.addEventListener("click", function (event) {
          go(Number(event.currentTarget.dataset.step));
        });
        button.addEventListener("keydown", onKey);
        td.appendChild(button);
        tr.appendChild(td);
        buttons.push(button);
      }
      table.appendChild(tr);
    }
    gridBox.appendChild(table);
  }

  function onKey(event) {
    var step = state.step;
    if (event.key === "ArrowRight" || event.key === "ArrowDown") step += 1;
    else if (event.key === "ArrowLeft" || event.key === "ArrowUp") step -= 1;
    else if (event.key === "Home") step = 0;
    else if (event.key === "End") step = buttons.length - 1;
    else return;
    event.preventDefault();
    go(step);
    buttons[state.step].focus();
  }

  function buildControls() {
    var previous = el("button", "Previous tile");
    previous.type = "button";
    previous.addEventListener("click", function () { go(state.step - 1); });
    var next = el("button", "Next tile");
    next.type = "button";
    next.id = "qkv-next";
    next.addEventListener("click", function () { go(state.step + 1); });
    controls.appendChild(previous);
    controls.appendChild(next);
  }

  function go(step) {
    state.step = Math.max(0, Math.min(buttons.length - 1, step));
    drawGrid();
    drawTile();
  }

  function drawGrid() {
    buttons.forEach(function (button, index) {
      button.classList.toggle("visited", index <= state.step);
      if (index === state.step) button.setAttribute("aria-current", "step");
      else button.removeAttribute("aria-current");
      button.tabIndex = index === state.step ? 0 : -1;
    });
  }

  function drawTile() {
    detail.textContent = "";
    var t = head().forward[state.step];
    var queries = labels(data.queries, t.rows);
    var keys = labels(data.keys, t.cols);
    detail.appendChild(el("p", "Tile " + (state.step + 1) + " of " + buttons.length +
      ": query block " + t.query_block + " (" + queries.join(", ") + ") × key block " +
      t.key_block + " (" + keys.join(", ") + "): " + t.kind, "where"));
    if (t.kind === "skipped") {
      detail.appendChild(el("p", "Every score of this tile is masked: it is skipped, nothing " +
        "is computed, m, l and O stay as they were."));
      return;
    }
    detail.appendChild(el("p", "m_new = max(m_old, m̃); α = exp(m_old − m_new); " +
      "l_new = α·l_old + rowsum(P̃); O_new = α·O_old + P̃·V", "formula"));
    var box = el("div", null, "tables");
    box.appendChild(matrix("S' (scaled scores)", t.scores, queries, keys));
    box.appendChild(matrix("P̃ = exp(S' − m_new)", t.p, queries, keys));
    var rows = t.tile_max.map(function (_, r) {
      return [t.tile_max[r], t.running_max.old[r], t.running_max.new[r], t.rescale[r],
        t.running_sum.old[r], t.running_sum.new[r]];
    });
    box.appendChild(matrix("row by row", rows, queries,
      ["tile max m̃", "m old", "m new", "rescale α", "l old", "l new"]));
    var width = t.accumulator.old[0].length;
    box.appendChild(matrix("O before", t.accumulator.old, queries, dims(width, "d")));
    box.appendChild(matrix("O after", t.accumulator.new, queries, dims(width, "d")));
    detail.appendChild(box);
    if (t.running_max.new.some(function (v) { return v === "-inf"; })) {
      detail.appendChild(el("p", "A row with no allowed key yet keeps m = −∞; α and P̃ use " +
        "0 in place of m, so no −∞ − (−∞) = NaN.", "note"));
    }
  }

  function drawSummary() {
    summary.textContent = "";
    var h = head();
    summary.appendChild(el("h2", "After the last tile: O = O_acc / l and L = m + log l"));
    var box = el("div", null, "tables");
    box.appendChild(matrix("O = O_acc / l", h.output, data.queries, dims(h.output[0].length, "d")));
    var rows = h.lse.map(function (_, r) { return [h.running_max[r], h.running_sum[r], h.lse[r]]; });
    box.appendChild(matrix("log-sum-exp", rows, data.queries, ["m", "l", "L"]));
    summary.appendChild(box);
    var gaps = h.max_difference;
    summary.appendChild(el("p", "The plain softmax gives the same: max |O − C| = " +
      gaps.output_vs_reference.toExponential(1) + " (C: qkv's reference), max |L − plain L| = " +
      gaps.lse_vs_plain.toExponential(1) + ", float64."));
  }

  function drawBackward() {
    backward.textContent = "";
    var b = head().backward;
    var h = head();
    backward.appendChild(el("h2", "Backward of key block " + b.key_block));
    backward.appendChild(el("p", "dO is all ones; D = rowsum(dO ∘ O); P = exp(S' − L); " +
      "dP = dO·Vᵀ; dS = P ∘ (dP − D); dV += Pᵀ·dO; dK += scale·dSᵀ·Q; dQ += scale·dS·K.",
      "formula"));
    backward.appendChild(matrix("D", column(b.D), data.queries, ["D"]));
    b.tiles.forEach(function (t) {
      var queries = labels(data.queries, t.rows);
      var keys = labels(data.keys, t.cols);
      backward.appendChild(el("p", "Tile query block " + t.query_block + " × key block " +
        t.key_block + ": " + t.kind, "where"));
      var box = el("div", null, "tables");
      box.appendChild(matrix("P", t.P, queries, keys));
      box.appendChild(matrix("dP", t.dP, queries, keys));
      box.appendChild(matrix("dS", t.dS, queries, keys));
      backward.appendChild(box);
    });
    var box = el("div", null, "tables");
    box.appendChild(matrix("dQ (every key block)", b.dQ, data.queries, dims(b.dQ[0].length, "d")));
    var cols = h.forward[b.key_block].cols;
    var keys = labels(data.keys, cols);
    box.appendChild(matrix("dK of the block", b.dK.slice(cols[0], cols[1]), keys, dims(b.dK[0].length, "d")));
    box.appendChild(matrix("dV of the block", b.dV.slice(cols[0], cols[1]), keys, dims(b.dV[0].length, "d")));
    backward.appendChild(box);
    backward.appendChild(el("p", "max |tiled − plain| over dQ, dK, dV = " +
      h.max_difference.gradients_vs_plain.toExponential(1) + ", float64."));
  }

  function drawAll() {
    buildGrid();
    drawGrid();
    drawTile();
    drawSummary();
    drawBackward();
  }

  app.textContent = "";
  buildHeader();
  buildControls();
  app.appendChild(header);
  app.appendChild(gridBox);
  app.appendChild(controls);
  app.appendChild(detail);
  app.appendChild(summary);
  app.appendChild(backward);
  drawAll();
})();
