(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("qkv-data").textContent);
  var app = document.getElementById("qkv-patch");

  function el(tag, text, cls) {
    var node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = text;
    if (cls) node.className = cls;
    return node;
  }

  function fmt(v) {
    if (v === null || v === undefined) return "−∞";
    return (v < 0 ? "−" : "") + Math.abs(v).toFixed(4);
  }

  function colour(v) {
    if (v === null || v === undefined || isNaN(v)) return "rgb(240,240,240)";
    var t = Math.max(-1, Math.min(1, v));
    if (t >= 0) return "rgb(" + Math.round(255 - 200 * t) + "," + Math.round(255 - 120 * t) + ",255)";
    return "rgb(255," + Math.round(255 + 160 * t) + "," + Math.round(255 + 160 * t) + ")";
  }

  function matrix(caption, rows, rowLabels, colLabels) {
    var table = el("table", null, "matrix");
    table.appendChild(el("caption", caption));
    var head = el("tr");
    head.appendChild(el("th", ""));
    for (var c = 0; c < rows[0].length; c++) head.appendChild(el("th", colLabels ? colLabels[c] : String(c)));
    table.appendChild(head);
    rows.forEach(function (row, r) {
      var tr = el("tr");
      tr.appendChild(el("th", rowLabels ? rowLabels[r] : String(r)));
      row.forEach(function (v) { tr.appendChild(el("td", fmt(v))); });
      table.appendChild(tr);
    });
    return table;
  }

  function difference(a, b) {
    if (a.length !== b.length || a[0].length !== b[0].length) return null;
    return a.map(function (row, i) {
      return row.map(function (v, j) {
        var w = b[i][j];
        return v === null || w === null ? null : Math.round((v - w) * 10000) / 10000;
      });
    });
  }

  var keyed = { scaled: true, weights: true };
  var detail = el("section", null, "detail");
  detail.setAttribute("aria-live", "polite");

  // a cell (row, column): a layer and head (rows of layers, columns of heads), or with
  // data.rows and data.columns a row's layer and head, the column a place (a position)
  function cellOf(row, col) {
    if (!data.rows) return { layer: row, head: col, where: "" };
    var r = data.rows[row];
    return { layer: r.layer, head: r.head, where: ", " + data.columns[col] };
  }

  function show(row, col) {
    var at = cellOf(row, col), layer = at.layer, head = at.head;
    detail.textContent = "";
    detail.appendChild(el("h2", "Layer " + layer + " (" + data.layers[layer] + "), head " + head + at.where));
    var value = data.values[row][col];
    detail.appendChild(el("p", data.metric + " with this head patched: " + fmt(value) +
      " (clean " + fmt(data.clean.value) + ", corrupt " + fmt(data.corrupt.value) + ")", "summary"));
    var clean = data.steps.clean[layer][head], corrupt = data.steps.corrupt[layer][head];
    Object.keys(clean).forEach(function (name) {
      var box = el("div", null, "step");
      box.dataset.step = name;
      box.appendChild(el("h3", name));
      var sides = el("div", null, "sides");
      var cols = keyed[name] ? data.clean.tokens : null;
      sides.appendChild(matrix("clean", clean[name], data.clean.tokens, cols));
      if (corrupt[name]) {
        var ccols = keyed[name] ? data.corrupt.tokens : null;
        sides.appendChild(matrix("corrupt", corrupt[name], data.corrupt.tokens, ccols));
        var diff = difference(clean[name], corrupt[name]);
        if (diff) sides.appendChild(matrix("clean − corrupt", diff, null, null));
      }
      box.appendChild(sides);
      detail.appendChild(box);
    });
    var pressed = app.querySelectorAll("button[aria-pressed=true]");
    for (var i = 0; i < pressed.length; i++) pressed[i].setAttribute("aria-pressed", "false");
    var cell = app.querySelector('button[data-row="' + row + '"][data-col="' + col + '"]');
    if (cell) cell.setAttribute("aria-pressed", "true");
  }

  app.textContent = "";
  app.appendChild(el("h1", data.title));
  app.appendChild(el("p", "clean: " + data.clean.text + "  (" + data.metric + " = " + fmt(data.clean.value) + ")", "summary"));
  app.appendChild(el("p", "corrupt: " + data.corrupt.text + "  (" + data.metric + " = " + fmt(data.corrupt.value) + ")", "summary"));
  app.appendChild(el("p", "Each cell: " + data.metric + " on the corrupt prompt with that head's " +
    data.what + " patched from the clean run. Colour: the share of the clean−corrupt gap it restores. Click a cell for the head's steps.", "summary"));
  var table = el("table", null, "heat");
  var header = el("tr");
  header.appendChild(el("th", data.corner || "layer"));
  data.values[0].forEach(function (_, c) {
    header.appendChild(el("th", data.columns ? data.columns[c] : "head " + c));
  });
  table.appendChild(header);
  data.values.forEach(function (values, row) {
    var tr = el("tr");
    tr.appendChild(el("th", data.rows ? data.rows[row].label : String(row)));
    values.forEach(function (v, col) {
      var at = cellOf(row, col);
      var td = el("td");
      var button = el("button", fmt(v));
      button.type = "button";
      button.dataset.row = String(row);
      button.dataset.col = String(col);
      button.dataset.layer = String(at.layer);
      button.dataset.head = String(at.head);
      button.setAttribute("aria-pressed", "false");
      button.setAttribute("aria-label", "layer " + at.layer + " head " + at.head + at.where + ": " +
        data.metric + " " + fmt(v));
      button.style.background = colour(data.normalized[row][col]);
      button.addEventListener("click", function () { show(row, col); });
      td.appendChild(button);
      tr.appendChild(td);
    });
    table.appendChild(tr);
  });
  app.appendChild(table);
  app.appendChild(detail);
  var best = data.best;
  show(best[0], best[1]);
})();
