/* qkv page, practice mode: the learner computes each step and hears which slip was made.
 *
 * Every number this part compares with was worked out in Python (render/_practice.py): per
 * row, the correct numbers, the rows each slip gives, the rows a correct step gives on earlier
 * numbers that carry a slip, and how far each number moves with the earlier numbers (the
 * rounding the learner carries). This script runs no attention: it reads the typed numbers,
 * their digits (½ unit of the last typed digit is allowed, plus the carried rounding, as
 * `qkv check` allows), and looks for the candidate they match. Sentences come from
 * `qkv check`. Text is set with textContent only; progress is kept in localStorage under a
 * key made from the practice data's hash.
 */
(function () {
  "use strict";

  const api = window.qkvPage;
  const P = api.data.practice;
  if (!P) return;
  const el = api.el;
  const KEY = "qkv-practice:" + P.id;
  const EPSILON = 1e-9;
  const steps = P.steps;
  const byKey = {};
  for (const step of steps) byKey[step.key] = step;

  const saved = { typed: {}, revealed: {} }; // typed[key][t] = [texts]
  const verdicts = {}; // verdicts[key][t] = the last judgement of that row
  const view = { open: true, rows: {}, box: null, toggle: null, edited: null, status: null };
  let store = null;

  // -- saving -------------------------------------------------------------------------------

  function openStore() {
    try {
      const s = window.localStorage;
      const text = s.getItem(KEY);
      store = s;
      if (text) restore(JSON.parse(text));
    } catch (error) {
      // a sandboxed frame or private mode (no storage: practise without saving), or a value
      // that is not this page's JSON (start afresh; it is overwritten at the first number)
      if (error instanceof SyntaxError === false) store = null;
    }
  }

  // Only what this page could have written: typed texts of its own rows, its own steps shown.
  function restore(old) {
    if (!old || typeof old !== "object") return;
    for (const step of steps) {
      const rows = old.typed && old.typed[step.key];
      if (rows && typeof rows === "object") {
        for (const row of step.rows) {
          const texts = rows[row.t];
          if (Array.isArray(texts) && texts.length === step.cols.length) {
            (saved.typed[step.key] = saved.typed[step.key] || {})[row.t] = texts.map((x) =>
              typeof x === "string" ? x.slice(0, 40) : ""
            );
          }
        }
      }
      if (old.revealed && old.revealed[step.key] === true) saved.revealed[step.key] = true;
    }
  }

  function save() {
    if (!store) return;
    try {
      store.setItem(KEY, JSON.stringify(saved));
    } catch (error) {
      store = null;
      say("Your progress can no longer be saved in this browser (storage is full or off).");
    }
  }

  // -- reading typed numbers ----------------------------------------------------------------

  const NUMBER = /^[-+]?(\d+(\.\d*)?|\.\d+)$/;

  function parse(text) {
    const t = String(text).trim().replace(/^[−–]/, "-").replace(",", ".");
    if (!NUMBER.test(t)) return null;
    const dot = t.indexOf(".");
    return { value: Number(t), decimals: dot < 0 ? 0 : t.length - dot - 1 };
  }

  function typedRow(key, t) {
    const texts = (saved.typed[key] || {})[t];
    if (!texts || texts.some((x) => !x || !String(x).trim())) return null;
    const numbers = texts.map(parse);
    if (numbers.some((n) => n === null)) return null;
    return numbers;
  }

  function halfUnit(decimals) {
    return 0.5 * Math.pow(10, -decimals);
  }

  // How coarsely the learner wrote a step: the largest half unit among its typed rows; a
  // revealed step is read at the page's precision; null when neither.
  function stepHalf(key) {
    let half = null;
    const rows = byKey[key].rows;
    for (const row of rows) {
      const numbers = typedRow(key, row.t);
      if (!numbers) continue;
      for (const n of numbers) half = Math.max(half === null ? 0 : half, halfUnit(n.decimals));
    }
    if (half === null && saved.revealed[key]) half = halfUnit(P.precision);
    return half;
  }

  // The rounding carried into a row from the earlier steps the learner wrote down (as
  // `qkv check` widens its allowance): safety · Σ half unit · sensitivity.
  function carried(step, row) {
    const out = row.correct.map(() => 0);
    const seen = new Set();
    const visit = (key) => {
      for (const input of byKey[key].inputs) {
        if (seen.has(input)) continue;
        seen.add(input);
        const half = stepHalf(input);
        if (half === null) visit(input);
        else if (row.sens[input]) {
          row.sens[input].forEach((s, i) => (out[i] += P.safety * half * s));
        }
      }
    };
    visit(step.key);
    return out;
  }

  function allowance(numbers, step, row) {
    const extra = carried(step, row);
    return numbers.map((n, i) => halfUnit(n.decimals) + extra[i]);
  }

  function within(numbers, target, allowed) {
    return numbers.every(
      (n, i) => Math.abs(n.value - target[i]) <= allowed[i] + EPSILON * (1 + Math.abs(target[i]))
    );
  }

  // Whether the learner's own earlier rows are those a candidate assumes: at least one of
  // them typed, and every typed one matching.
  function consistent(inputs) {
    let typed = false;
    for (const [key, t, values] of inputs) {
      const numbers = typedRow(key, t);
      if (!numbers) continue;
      typed = true;
      const row = byKey[key].rows[t];
      if (!within(numbers, values, allowance(numbers, byKey[key], row))) return false;
    }
    return typed;
  }

  // -- judging a row ------------------------------------------------------------------------

  function judge(step, row) {
    const texts = (saved.typed[step.key] || {})[row.t] || [];
    const empty = row.correct.map((_, i) => !texts[i] || !String(texts[i]).trim());
    if (empty.some(Boolean)) {
      return { kind: "incomplete", cells: empty.map((e, i) => (e ? i : -1)).filter((i) => i >= 0) };
    }
    const numbers = texts.map(parse);
    const bad = numbers.map((n, i) => (n === null ? i : -1)).filter((i) => i >= 0);
    if (bad.length) return { kind: "invalid", cells: bad };
    const allowed = allowance(numbers, step, row);
    if (within(numbers, row.correct, allowed)) return { kind: "right" };
    const marks = numbers.map((n, i) => {
      const off = Math.abs(n.value - row.correct[i]);
      if (off <= allowed[i]) return "ok";
      return off <= allowed[i] + halfUnit(n.decimals) ? "rounding" : "wrong";
    });
    if (!marks.includes("wrong")) return { kind: "rounding", marks: marks };
    for (const c of row.candidates) {
      const fits = within(numbers, c.values, allowed);
      if (c.kind === "consequential" && fits && consistent(c.inputs)) {
        return { kind: "consequential", candidate: c };
      }
    }
    for (const c of row.candidates) {
      if (c.kind === "slip" && within(numbers, c.values, allowed)) {
        return { kind: "slip", candidate: c };
      }
    }
    const before = [];
    for (const [key, t] of row.feeds) {
      const v = (verdicts[key] || {})[t];
      if (v && ["slip", "consequential", "arithmetic"].includes(v.kind)) before.push([key, t]);
    }
    return { kind: "arithmetic", marks: marks, before: before };
  }

  function rowName(key, t) {
    return byKey[key].title + " of “" + P.tokens[t] + "”";
  }

  // What a judgement says: a symbol and a word first (never colour alone), then the reason.
  function words(step, row, v, numbers) {
    const cols = step.cols;
    if (v.kind === "incomplete") {
      const missing = v.cells.map((i) => cols[i]).join(", ");
      return ["…", "Not checked yet", "Type every number of the row (" + missing + " missing)."];
    }
    if (v.kind === "invalid") {
      const where = v.cells.map((i) => cols[i]).join(", ");
      return ["?", "Not a number", "Write plain decimals such as 0.25 or -1.5 in " + where + "."];
    }
    if (v.kind === "right") return ["✓", "Right", "Within the digits you typed."];
    if (v.kind === "rounding") {
      const near = v.marks.map((m, i) => (m === "rounding" ? cols[i] : null)).filter(Boolean);
      const why = "Off by at most one in the last digit you typed (" + near.join(", ") + ")";
      return ["✓", "Right, up to rounding", why + ": a note, not a mistake."];
    }
    if (v.kind === "consequential") {
      const then = " Done right on them: fix the earlier row and this one follows.";
      return ["↪", "Follows from your earlier numbers", v.candidate.says + then];
    }
    if (v.kind === "slip") {
      const code = v.candidate.code;
      return ["✗", "Slip: " + code, v.candidate.says];
    }
    const wrong = v.marks.map((m, i) => (m === "wrong" ? i : -1)).filter((i) => i >= 0);
    const listed = wrong.map((i) => cols[i] + " = " + numbers[i].text).join(", ");
    let text = "No slip that qkv knows gives these numbers (" + P.diagnoses.arithmetic + ").";
    text += " Off: " + listed + ".";
    if (v.before.length) {
      const [key, t] = v.before[0];
      text +=
        " Your " + rowName(key, t) + " was already wrong, and this row is compared with the " +
        "correct numbers: fix that row first.";
    }
    return ["✗", "Arithmetic", text];
  }

  // -- the section --------------------------------------------------------------------------

  function say(text) {
    if (view.status) view.status.textContent = text;
  }

  function buildInputs() {
    const box = el("section", {
      class: "practice-inputs",
      "aria-labelledby": "qkv-practice-inputs",
    });
    box.append(el("h3", { id: "qkv-practice-inputs", text: "What you start from" }));
    const facts = el("ul", { class: "practice-facts" });
    for (const fact of P.facts) facts.append(el("li", { text: fact }));
    box.append(facts);
    const grid = el("div", { class: "practice-grid" });
    for (const m of P.inputs) {
      const table = el("table", { class: "practice-matrix" });
      table.append(el("caption", { text: m.title + " (" + m.symbol + ")" }));
      const head = el("tr", {}, [el("th", { scope: "col", text: "" })]);
      for (const c of m.cols) head.append(el("th", { scope: "col", text: c }));
      table.append(el("thead", {}, [head]));
      const body = el("tbody");
      m.values.forEach((line, i) => {
        const tr = el("tr", {}, [el("th", { scope: "row", text: m.rows[i] })]);
        for (const x of line) tr.append(el("td", { text: String(x) }));
        body.append(tr);
      });
      table.append(body);
      grid.append(el("div", { class: "scroll" }, [table]));
    }
    box.append(grid);
    return box;
  }

  function buildStep(step, number) {
    const card = el("article", { class: "practice-step", "data-practice": step.key });
    const titleId = "qkv-practice-" + number;
    card.append(el("h3", { id: titleId, text: "Step " + number + ". " + step.title }));
    card.append(el("p", { class: "formula", text: step.formula }));
    let ask = "Type " + step.ask + ", one row per token";
    if (step.causal) ask += " (causal: a key after the query gets weight 0)";
    card.append(el("p", { text: ask + ". Use as many decimals as you like; Enter checks a row." }));
    const table = el("table", { class: "practice-rows", "aria-labelledby": titleId });
    const head = el("tr", {}, [el("th", { scope: "col", text: "token" })]);
    for (const c of step.cols) head.append(el("th", { scope: "col", text: c }));
    head.append(el("th", { scope: "col", text: "check" }));
    table.append(el("thead", {}, [head]));
    const body = el("tbody");
    const rows = [];
    for (const row of step.rows) {
      const token = P.tokens[row.t];
      const tr = el("tr", { "data-row": row.t }, [el("th", { scope: "row", text: token })]);
      const inputs = step.cols.map((col, i) => {
        const input = el("input", {
          type: "text",
          inputmode: "decimal",
          autocomplete: "off",
          spellcheck: "false",
          size: 7,
          "aria-label": step.title + ", " + token + ", " + col,
          "data-col": i,
        });
        const texts = (saved.typed[step.key] || {})[row.t];
        if (texts && texts[i]) input.value = texts[i];
        input.addEventListener("input", () => {
          const all = (saved.typed[step.key] = saved.typed[step.key] || {});
          all[row.t] = inputs.map((x) => x.value);
          save();
        });
        input.addEventListener("keydown", (event) => {
          if (event.key !== "Enter") return;
          event.preventDefault();
          const v = check(step, row);
          if (v.kind === "right" || v.kind === "rounding") focusNext(step, row.t);
        });
        tr.append(el("td", {}, [input]));
        return input;
      });
      const button = el("button", { type: "button", class: "practice-check", text: "Check" });
      button.setAttribute("aria-label", "Check " + step.title + ", " + token);
      button.addEventListener("click", () => check(step, row));
      tr.append(el("td", {}, [button]));
      body.append(tr);
      const verdict = el("tr", { class: "practice-verdict-row" });
      const cell = el("td", { colspan: step.cols.length + 2 });
      const out = el("div", { class: "practice-verdict", role: "status", "aria-live": "polite" });
      const show = el("button", {
        type: "button",
        class: "practice-show-row",
        text: "Show the correct row",
      });
      const answer = el("p", { class: "practice-answer" });
      answer.hidden = true;
      show.hidden = true;
      show.addEventListener("click", () => {
        answer.hidden = !answer.hidden;
        show.textContent = answer.hidden ? "Show the correct row" : "Hide the correct row";
      });
      answer.textContent = row.says;
      cell.append(out, show, answer);
      verdict.append(cell);
      verdict.hidden = true;
      body.append(verdict);
      rows.push({ inputs: inputs, out: out, show: show, line: verdict });
    }
    table.append(body);
    card.append(el("div", { class: "scroll" }, [table]));
    const reveal = el("button", {
      type: "button",
      class: "practice-reveal",
      text: "Show me this step",
    });
    const shown = el("div", { class: "practice-shown" });
    reveal.addEventListener("click", () => {
      saved.revealed[step.key] = true;
      save();
      revealStep(step, reveal, shown);
      shown.focus();
    });
    card.append(reveal, shown);
    view.rows[step.key] = rows;
    if (saved.revealed[step.key]) revealStep(step, reveal, shown);
    return card;
  }

  function revealStep(step, button, box) {
    button.disabled = true;
    button.textContent = "Shown below";
    box.replaceChildren(el("p", { text: "The correct rows of this step:" }));
    box.setAttribute("tabindex", "-1");
    const list = el("ul", { class: "practice-says" });
    for (const row of step.rows) list.append(el("li", { text: row.says }));
    box.append(list);
  }

  function focusNext(step, t) {
    const rows = view.rows[step.key];
    if (t + 1 < rows.length) rows[t + 1].inputs[0].focus();
    else {
      const next = steps[steps.indexOf(step) + 1];
      if (next) view.rows[next.key][0].inputs[0].focus();
    }
  }

  function check(step, row) {
    const v = judge(step, row);
    const ui = view.rows[step.key][row.t];
    const texts = (saved.typed[step.key] || {})[row.t] || [];
    const numbers = texts.map((text) => ({ text: String(text).trim() }));
    const [symbol, label, text] = words(step, row, v, numbers);
    (verdicts[step.key] = verdicts[step.key] || {})[row.t] = v;
    ui.line.hidden = false;
    ui.line.setAttribute("data-verdict", v.kind);
    ui.out.replaceChildren(
      el("strong", { class: "practice-label", text: symbol + " " + label }),
      el("span", { text: " — " + text })
    );
    const wrongCells = v.marks ? v.marks.map((m, i) => (m === "wrong" ? i : -1)) : v.cells || [];
    ui.inputs.forEach((input, i) => {
      const wrong = wrongCells.includes(i) && v.kind !== "incomplete";
      if (wrong) input.setAttribute("aria-invalid", "true");
      else input.removeAttribute("aria-invalid");
    });
    ui.show.hidden = !["slip", "consequential", "arithmetic", "rounding"].includes(v.kind);
    progress();
    return v;
  }

  function progress() {
    let total = 0;
    let right = 0;
    for (const step of steps) {
      for (const row of step.rows) {
        total += 1;
        const v = (verdicts[step.key] || {})[row.t];
        if (v && (v.kind === "right" || v.kind === "rounding")) right += 1;
      }
    }
    view.progress.textContent = right + " of " + total + " rows right.";
  }

  // -- handing in ----------------------------------------------------------------------------

  // The typed rows as a worked example that claims only numbers (qkv grade reads it with
  // --inputs, the example this page was made from): every fully typed row of a step a worked
  // example can claim, its token by position, its numbers as typed (digits kept).
  const CLAIMABLE = ["Q", "K", "V", "scores", "scaled", "weights", "context", "output"];

  function handInText() {
    const lines = [
      "# Handed in from a qkv practice page. Grade it with:",
      "#   qkv grade FOLDER -o OUT --kind example --inputs EXAMPLE.yaml",
      "x-practice: " + JSON.stringify(P.id),
      "claimed:",
    ];
    let count = 0;
    for (const step of steps) {
      if (step.head !== null || CLAIMABLE.indexOf(step.step) < 0) continue;
      const rows = [];
      for (const row of step.rows) {
        const numbers = typedRow(step.key, row.t);
        if (!numbers) continue;
        const texts = saved.typed[step.key][row.t].map((x) =>
          String(x).trim().replace(/^[−–]/, "-").replace(",", ".")
        );
        rows.push("    " + row.t + ": [" + texts.join(", ") + "]");
      }
      if (rows.length) {
        lines.push("  " + step.step + ":");
        lines.push(...rows);
        count += rows.length;
      }
    }
    return { text: lines.join("\n") + "\n", count: count };
  }

  function buildHandIn() {
    const name = el("input", { type: "text", id: "qkv-handin-name", autocomplete: "name" });
    name.setAttribute("aria-describedby", "qkv-handin-help");
    const label = el("label", { for: "qkv-handin-name", text: "Your name" });
    const button = el("button", { type: "button", id: "qkv-handin", text: "Hand in" });
    const help = el("span", {
      id: "qkv-handin-help",
      class: "note",
      text: "saves your rows as a file (NAME.yaml) for your teacher",
    });
    button.addEventListener("click", () => {
      const made = handInText();
      if (!made.count) {
        say("Type at least one whole row before handing in: there is nothing to hand in yet.");
        return;
      }
      const who = name.value.trim().replace(/[^\p{L}\p{N}_-]+/gu, "_").slice(0, 60);
      const file = (who || "handin") + ".yaml";
      const link = el("a", { download: file });
      link.href = URL.createObjectURL(new Blob([made.text], { type: "application/x-yaml" }));
      document.body.append(link);
      link.click();
      link.remove();
      setTimeout(() => URL.revokeObjectURL(link.href), 60000);
      say("Saved " + made.count + " rows as " + file + ": hand that file to your teacher.");
    });
    return el("span", { class: "practice-handin" }, [label, name, button, help]);
  }

  function buildPractice() {
    const box = el("section", { class: "practice", "aria-labelledby": "qkv-practice-title" });
    const title = "Practice: compute each step yourself";
    box.append(el("h2", { id: "qkv-practice-title", text: title, tabindex: -1 }));
    box.append(
      el("p", {
        text:
          "Work out each step from the inputs below, by hand or with a calculator, and type " +
          "its rows. Each row is judged as qkv check judges a worked example: right within the " +
          "digits you typed; right given your own earlier numbers; or a named slip, with what " +
          "went wrong in plain words and the correct row on request.",
      })
    );
    view.edited = el("p", { class: "note practice-edited" });
    view.edited.hidden = true;
    view.status = el("p", { class: "note", role: "status" });
    view.progress = el("p", { class: "practice-progress", "aria-live": "polite" });
    const reset = el("button", { type: "button", text: "Start again" });
    reset.addEventListener("click", () => {
      saved.typed = {};
      saved.revealed = {};
      for (const key of Object.keys(verdicts)) delete verdicts[key];
      save();
      view.box.replaceWith(buildPractice());
      progress();
    });
    const bar = el("div", { class: "practice-bar" }, [view.progress, reset, buildHandIn()]);
    box.append(view.edited, view.status, bar);
    box.append(buildInputs());
    steps.forEach((step, i) => box.append(buildStep(step, i + 1)));
    view.box = box;
    showEdited();
    say(
      store
        ? "Your numbers are kept in this browser for this page: close it and come back later."
        : "This browser does not let the page keep your numbers: they go when you close it."
    );
    for (const step of steps) {
      for (const row of step.rows) if (typedRow(step.key, row.t)) check(step, row);
    }
    return box;
  }

  function place() {
    const open = view.open;
    for (const child of api.app.children) {
      if (child === view.box || child === view.bar || child.tagName === "H1") continue;
      if (child.classList.contains("description")) continue;
      child.hidden = open;
    }
    view.box.hidden = !open;
    view.toggle.textContent = open ? "Back to the explanation" : "Practice: compute each step";
    view.toggle.setAttribute("aria-pressed", String(open));
  }

  function showEdited() {
    const edited = typeof api.edited === "function" && api.edited();
    view.edited.hidden = !edited;
    view.edited.textContent = edited
      ? "You changed the example in the explanation. Practice judges the example as written, " +
        "with the inputs shown here."
      : "";
  }

  api.extend({
    shell: function () {
      openStore();
      view.toggle = el("button", { type: "button", id: "qkv-practice-toggle" });
      view.toggle.addEventListener("click", () => {
        view.open = !view.open;
        place();
        (view.open ? view.box.querySelector("h2") : view.toggle).focus();
      });
      view.bar = el("div", { class: "practice-toggle" }, [view.toggle]);
      const description = api.app.querySelector(".description");
      (description || api.app.querySelector("h1")).after(view.bar);
      view.bar.after(buildPractice());
      progress();
      place();
    },
    call: function () {
      if (view.box) place();
    },
    head: function () {
      if (view.box) place();
    },
    edit: function () {
      if (view.box) showEdited();
    },
  });
})();
