(function () {
  "use strict";
  // Practice of the tiled algorithm (qkv explain --tiled --practice): the learner types m, l
  // and O tile by tile, then O / l. Every row is judged against numbers qkv check computed
  // before the page opened (the correct row, each slip, each row that follows from an
  // earlier slip), with check's own sentences. Text is set with textContent only.
  var data = JSON.parse(document.getElementById("qkv-data").textContent);
  var P = data.practice;
  if (!P) return;
  var NUMBER = /^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$/;
  var EPSILON = 1e-9;
  var typed = {};   // row key → parsed numbers of the learner's last checked row
  var byKey = {};

  function el(tag, text, cls) {
    var node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = text;
    if (cls) node.className = cls;
    return node;
  }

  function parse(text) {
    var t = String(text).trim().replace(/^[−–]/, "-").replace(",", ".");
    if (!NUMBER.test(t)) return null;
    var dot = t.indexOf(".");
    return { value: Number(t), decimals: dot < 0 ? 0 : t.length - dot - 1, text: t };
  }

  // Half a unit of each typed number's last digit; a whole number is exact to the finest
  // digits of its row (as qkv check reads 0, 1, 4), the page's precision if none has any.
  function halves(numbers) {
    var finest = 0;
    numbers.forEach(function (n) { finest = Math.max(finest, n.decimals); });
    if (!finest) finest = P.precision;
    return numbers.map(function (n) { return 0.5 * Math.pow(10, -(n.decimals || finest)); });
  }

  function within(numbers, target, units) {
    var half = halves(numbers);
    return numbers.every(function (n, i) {
      return Math.abs(n.value - target[i]) <= units * half[i] + EPSILON * (1 + Math.abs(target[i]));
    });
  }

  // The learner's earlier rows are those a candidate assumes: each one typed and matching.
  function consistent(inputs) {
    return inputs.every(function (pair) {
      var numbers = typed[pair[0]];
      return numbers && within(numbers, pair[1], 2);
    });
  }

  function judge(row, numbers) {
    if (within(numbers, row.correct, 1)) return ["✓", "Right", row.says];
    if (within(numbers, row.correct, 2)) {
      return ["✓", "Right, up to rounding", "Off by one in the last digit you typed: " +
        "a note, not a mistake. " + row.says];
    }
    var i, c;
    for (i = 0; i < row.candidates.length; i++) {
      c = row.candidates[i];
      if (c.kind === "consequential" && within(numbers, c.values, 2) && consistent(c.inputs)) {
        return ["↪", "Follows from your earlier numbers", c.says];
      }
    }
    for (i = 0; i < row.candidates.length; i++) {
      c = row.candidates[i];
      if (c.kind === "slip" && within(numbers, c.values, 2)) {
        return ["✗", "Slip: " + c.code, c.says];
      }
    }
    return ["✗", "Arithmetic", "No slip that qkv knows gives these numbers (" +
      P.diagnoses.arithmetic + "). " + row.says.replace(" is right:", " is")];
  }

  function check(row, inputs, out) {
    var numbers = inputs.map(function (input) { return parse(input.value); });
    var bad = numbers.indexOf(null);
    if (bad >= 0) {
      delete typed[row.key];
      out.className = "verdict invalid";
      out.textContent = "? Not a number: write plain decimals such as 0.25 or -1.5.";
      return;
    }
    typed[row.key] = numbers;
    var said = judge(row, numbers);
    out.className = "verdict " + (said[0] === "✓" ? "right" : said[0] === "↪" ? "follows" : "wrong");
    out.textContent = said[0] + " " + said[1] + ". " + said[2];
  }

  function rowLine(row, columns) {
    var tr = el("tr");
    tr.appendChild(el("th", row.label));
    var inputs = [];
    var cell = el("td");
    row.correct.forEach(function (_, i) {
      var input = el("input");
      input.type = "text";
      input.inputMode = "decimal";
      input.size = 7;
      input.setAttribute("aria-label", row.label + (row.correct.length > 1 ? ", " + columns[i] : ""));
      input.dataset.key = row.key;
      inputs.push(input);
      cell.appendChild(input);
    });
    tr.appendChild(cell);
    var button = el("button", "Check");
    button.type = "button";
    button.dataset.key = row.key;
    var td = el("td");
    td.appendChild(button);
    tr.appendChild(td);
    var out = el("td", "", "verdict");
    out.setAttribute("role", "status");
    out.dataset.key = row.key;
    tr.appendChild(out);
    button.addEventListener("click", function () { check(row, inputs, out); });
    inputs.forEach(function (input) {
      input.addEventListener("keydown", function (event) {
        if (event.key === "Enter") check(row, inputs, out);
      });
    });
    byKey[row.key] = row;
    return tr;
  }

  function build() {
    var box = el("section");
    box.id = "qkv-tiled-practice";
    box.appendChild(el("h2", "Practice: m, l and O tile by tile"));
    box.appendChild(el("p", "For each tile, type each query's running maximum m, running " +
      "sum l and accumulator O after the tile's keys, then O / l at the end. Each row is " +
      "judged as qkv check judges it: right, a slip named, or following from an earlier row."));
    box.appendChild(el("p", P.ask.running_max + " · " + P.ask.running_sum + " · " +
      P.ask.accumulator, "formula"));
    var columns = P.final.length ? P.final[0].correct.map(function (_, i) { return "d" + (i + 1); }) : [];
    P.tiles.forEach(function (tile) {
      var table = el("table", null, "practice");
      table.appendChild(el("caption", "Query block " + tile.q_block + " (" +
        tile.queries.join(", ") + ") × key block " + tile.k_block + " (" +
        tile.keys.join(", ") + ")"));
      tile.rows.forEach(function (row) { table.appendChild(rowLine(row, columns)); });
      box.appendChild(table);
    });
    var last = el("table", null, "practice");
    last.appendChild(el("caption", "The output " + P.ask.output));
    P.final.forEach(function (row) { last.appendChild(rowLine(row, columns)); });
    box.appendChild(last);
    document.body.appendChild(box);
  }

  build();
})();
