// kvtier dashboard: renders /dashboard/snapshot, then live /dashboard/events (server-sent events).
// Every number cell carries data-series (the /metrics series it shows) and data-value (the raw number).
// A service with a token answers 401 until the viewer signs in: POST /dashboard/login sets an HttpOnly,
// SameSite=Strict session cookie (this script never keeps the token); operations send X-Kvtier-Dashboard.
"use strict";
(function () {
  const K = (window.__kvtier = { charts: {}, renders: 0, firstPaintMs: null, snap: null, signedIn: false });
  const $ = (id) => document.getElementById(id);

  const fmtInt = (v) => (v == null ? "—" : Math.round(v).toLocaleString("en-US"));
  function fmtBytes(v) {
    if (v == null) return "—";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0, x = v;
    while (x >= 1024 && i < u.length - 1) { x /= 1024; i++; }
    return (i ? x.toFixed(1) : String(Math.round(x))) + " " + u[i];
  }
  const fmtPct = (v) => (v == null ? "—" : (100 * v).toFixed(1) + " %");
  const fmtRate = (v, unit) => (v == null ? "—" : (v < 10 ? Number(v.toPrecision(3)) : Math.round(v)) + " " + unit);
  function fmtBps(gbps) {  // GB/s (decimal) shown in the unit that keeps 3 digits
    if (gbps == null) return "—";
    const units = [[1, "GB/s"], [1e-3, "MB/s"], [1e-6, "kB/s"], [1e-9, "B/s"]];
    for (const [f, u] of units) if (gbps >= f || f === 1e-9) return fmtRate(gbps / f, u);
  }
  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v == null) continue;
      if (k === "text") e.textContent = v; else e.setAttribute(k, v);
    }
    for (const c of kids) if (c != null) e.append(c);
    return e;
  }
  function numCell(snap, series, fmt) {
    const v = series != null && series in snap.metrics ? snap.metrics[series] : null;
    return el("td", { "data-series": series, "data-value": v == null ? null : String(v), text: (fmt || fmtInt)(v) });
  }
  function head(table, names) {
    const tr = el("tr");
    for (const n of names) tr.append(el("th", { scope: "col", text: n }));
    table.tHead.replaceChildren(tr);
  }

  // -- tiles --------------------------------------------------------------------------------
  function renderTiles(snap) {
    const r = snap.rates || {};
    const tiles = [
      ["Hit rate (all time)", fmtPct(snap.hit_rate), null],
      ["Hit rate (last interval)", fmtPct(r.hit_rate), null],
      ["Lookups / s", fmtRate(r.lookups, "/s"), null],
    ];
    if ("load_bytes" in r) tiles.push(["Load throughput", fmtBps(r.load_bytes), null]);
    if ("store_bytes" in r) tiles.push(["Store throughput", fmtBps(r.store_bytes), null]);
    for (const [label, series] of snap.counters || []) {
      const v = series in snap.metrics ? snap.metrics[series] : null;
      tiles.push([label, /bytes/.test(series) ? fmtBytes(v) : fmtInt(v), series, v]);
    }
    $("tiles").replaceChildren(...tiles.map(([label, value, series, raw]) =>
      el("div", { class: "tile" }, el("div", { class: "label", text: label }),
        el("div", { class: "value", "data-series": series, "data-value": raw == null ? null : String(raw), text: value }))));
  }

  // -- tiers --------------------------------------------------------------------------------
  function renderTiers(snap) {
    const ctl = snap.kind === "controller";
    const cols = ["Tier"].concat(ctl ? ["Instance"] : [], ["Used", "Capacity", "Fill", "Chunks"],
      ctl ? [] : ["Stores", "Evictions", "Read errors", "Write errors", "Queue", "Hit tokens"], ctl ? ["Actions"] : []);
    head($("tiers"), cols);
    const rows = snap.tiers.map((t) => {
      const s = t.series, vals = t.values || {};
      const used = s.used_bytes in snap.metrics ? snap.metrics[s.used_bytes] : null;
      const capSeries = s.capacity_bytes;
      const cap = capSeries ? snap.metrics[capSeries] : vals.capacity_bytes;
      const fill = used != null && cap ? Math.min(1, used / cap) : null;
      const tr = el("tr", { "data-tier": t.tier, "data-instance": t.instance });
      tr.append(el("th", { scope: "row", text: t.tier }));
      if (ctl) tr.append(el("td", { class: "text", text: t.instance + (t.shared ? " (shared)" : "") }));
      tr.append(numCell(snap, s.used_bytes, fmtBytes));
      tr.append(capSeries ? numCell(snap, capSeries, fmtBytes)
        : el("td", { "data-value": cap == null ? null : String(cap), text: fmtBytes(cap || null) }));
      const bar = el("span", { class: "bar", role: "meter", "aria-label": t.tier + " fill", "aria-valuemin": "0",
        "aria-valuemax": "100", "aria-valuenow": fill == null ? "0" : (100 * fill).toFixed(0) }, el("span"));
      bar.firstChild.style.width = ((fill || 0) * 100).toFixed(1) + "%";
      tr.append(el("td", {}, bar, " " + (fill == null ? "—" : fmtPct(fill))));
      tr.append(numCell(snap, s.chunks));
      if (!ctl) for (const f of ["stores", "evictions", "read_errors", "write_errors", "queue", "hit_tokens"])
        tr.append(numCell(snap, s[f]));
      if (ctl) {
        const b = opButton("Clear", `Clear tier ${t.tier} of ${t.instance}`, snap,
          () => confirmOp(`Clear the ${t.tier} tier of instance ${t.instance}? Its cached chunks are dropped.`, null,
            () => runOp("clear", { instance: t.instance, tier: t.tier }, `clear ${t.instance}/${t.tier}`)));
        tr.append(el("td", {}, b));
      }
      return tr;
    });
    $("tiers").tBodies[0].replaceChildren(...rows);
  }

  // -- hot prefixes -------------------------------------------------------------------------
  function renderHot(snap) {
    const ctl = snap.kind === "controller";
    head($("hot"), ["Prefix", "Reuses", "Hit tokens", "Size", "Tiers", "Pinned"].concat(ctl ? ["Actions"] : []));
    const rows = snap.hot.map((h) => {
      const tiers = Object.entries(h.tiers).map(([k, v]) => `${k} ${v}`).join(", ") || "—";
      const label = h.text != null ? h.text : h.key + "…";
      const tr = el("tr", { "data-head": h.head },
        el("td", { class: "text" }, h.text != null ? label : el("code", { text: label })),
        el("td", { "data-value": String(h.count), text: fmtInt(h.count) }),
        el("td", { "data-value": String(h.hit_tokens), text: fmtInt(h.hit_tokens) +
          (h.held_tokens != null && h.held_tokens < h.hit_tokens ? ` (${fmtInt(h.held_tokens)} held now)` : "") }),
        el("td", { text: h.bytes ? fmtBytes(h.bytes) : "—" }),
        el("td", { class: "text", text: tiers }),
        el("td", { text: h.pinned_tokens < 0 ? "—" : h.pinned_tokens > 0 ? "yes (" + h.pinned_tokens + " tokens)" : "no" }));
      if (ctl) {
        const name = h.key;
        const run = (op, extra, desc) => () => confirmOp(desc, extra, (vals) =>
          runOp(op, Object.assign({ head: h.head }, vals), `${op} ${name}`));
        const tierSel = { name: "to_tier", label: "Target tier", options: ["cpu", "disk", "remote"] };
        const codecSel = { name: "codec", label: "Codec", options: (snap.ops && snap.ops.codecs) || ["raw"] };
        tr.append(el("td", { class: "actions" },
          opButton("Pin", "Pin prefix " + name, snap, run("pin", null, `Pin prefix ${name} on ${h.instance}?`)), " ",
          opButton("Unpin", "Unpin prefix " + name, snap, run("unpin", null, `Unpin prefix ${name}?`)), " ",
          opButton("Move…", "Move prefix " + name, snap, run("move", tierSel, `Move prefix ${name} from ${h.instance}?`)), " ",
          opButton("Compress…", "Compress prefix " + name, snap, run("compress", codecSel, `Re-encode prefix ${name}?`))));
      }
      return tr;
    });
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: ctl ? "7" : "6", class: "text", text: "no reused prefixes yet" })));
    $("hot").tBodies[0].replaceChildren(...rows);
  }

  // -- instances ----------------------------------------------------------------------------
  function renderInstances(snap) {
    if (!snap.instances) return;
    $("instances-section").hidden = false;
    head($("instances"), ["Instance", "Role", "Host", "Health", "Last heartbeat", "Hit rate", "Models"]);
    const rows = snap.instances.map((i) => {
      const bad = Object.entries(i.health || {}).filter(([, v]) => v && v.ok === false).map(([k]) => k);
      return el("tr", { "data-instance": i.instance },
        el("th", { scope: "row", text: i.instance }),
        el("td", { text: i.role }), el("td", { class: "text", text: `${i.host} (pid ${i.pid})` }),
        el("td", { class: bad.length ? "bad" : "ok", text: bad.length ? "failing: " + bad.join(", ") : "ok" }),
        el("td", { text: i.last_seen_age_s.toFixed(1) + " s ago" }),
        el("td", { text: fmtPct(i.hit_rate) }), el("td", { class: "text", text: i.namespaces.join(", ") }));
    });
    $("instances").tBodies[0].replaceChildren(...rows);
  }

  // -- charts -------------------------------------------------------------------------------
  const COLORS = ["#0b5cad", "#c2410c", "#1a6b35", "#7e22ce", "#374151"];
  function chart(id, hist, names, labels, scale, windowS) {
    const node = $(id);
    const data = [hist.t || []].concat(names.map((n) => (hist[n] || []).map((v) => (v == null ? null : v * (scale || 1)))));
    const key = names.join(",");
    let c = K.charts[id];
    if (!c || c.key !== key) {
      if (c) c.plot.destroy();
      const opts = {
        width: Math.max(320, node.clientWidth || 400), height: 200,
        series: [{}].concat(names.map((n, i) => ({ label: labels[i], stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true }))),
        axes: [{}, { size: 60 }],
        // the window, or less while the history is younger (at least 30 s): short runs fill the width
        scales: Object.assign({ x: { time: true, range: (u) => {
          const first = u.data[0].length ? u.data[0][0] : K.now;
          return [Math.max(K.now - windowS, Math.min(first, K.now - 30)), K.now];
        } } },
          scale === 100 ? { y: { range: [0, 100] } } : {}),
      };
      c = K.charts[id] = { key, plot: new uPlot(opts, data, node) };
    } else {
      c.plot.setData(data);
    }
    c.points = data[0].length;
    c.lastT = data[0].length ? data[0][data[0].length - 1] : null;
  }
  function renderCharts(snap) {
    if (typeof uPlot === "undefined") return;
    const tiers = snap.hit_tiers || [];
    const names = ["hit_rate"].concat(tiers.map((t) => "hit_rate:" + t));
    const labels = ["all tiers %"].concat(tiers.map((t) => t + " %"));
    K.now = snap.time;
    chart("chart-short", snap.history.short, names, labels, 100, 300);
    chart("chart-long", snap.history.long, names, labels, 100, 3600);
    const tn = ["lookups"].concat("load_bytes" in snap.history.short ? ["load_bytes", "store_bytes"] : []);
    chart("chart-tput", snap.history.short, tn, ["lookups/s", "load GB/s", "store GB/s"].slice(0, tn.length), 1, 300);
  }

  // -- operations ---------------------------------------------------------------------------
  const opsEnabled = (snap) => snap.ops != null;  // whoever reads the data may operate (same rule)
  function opButton(text, label, snap, onClick) {
    const b = el("button", { type: "button", "aria-label": label, text });
    if (!opsEnabled(snap)) { b.disabled = true; b.title = "no operations here"; }
    b.addEventListener("click", onClick);
    return b;
  }
  function confirmOp(text, extra, onOk) {
    const d = $("confirm");
    $("confirm-text").textContent = text;
    const box = $("confirm-extra");
    box.replaceChildren();
    let sel = null;
    if (extra) {
      sel = el("select", { id: "confirm-select", name: extra.name });
      for (const o of extra.options) sel.append(el("option", { value: o, text: o }));
      box.append(el("label", { for: "confirm-select", text: extra.label + " " }), sel);
    }
    d.returnValue = "";
    d.onclose = () => { if (d.returnValue === "ok") onOk(sel ? { [extra.name]: sel.value } : {}); };
    d.showModal();
  }
  function log(text, cls) {
    $("ops-section").hidden = false;
    const li = el("li", { class: cls, text });
    $("ops-log").prepend(li);
    return li;
  }
  const opHeaders = { "Content-Type": "application/json", "X-Kvtier-Dashboard": "1" };
  async function runOp(op, body, desc) {
    const li = log(`${desc}: sending…`);
    try {
      const r = await fetch("/dashboard/ops/" + op, { method: "POST", headers: opHeaders, body: JSON.stringify(body) });
      const rec = await r.json().catch(() => ({}));
      if (!r.ok) { li.textContent = `${desc}: refused (${r.status}) ${rec.detail || ""}`; li.className = "bad"; return; }
      li.dataset.eventId = rec.event_id;
      li.textContent = `${desc}: ${rec.state}…`;
      for (;;) {
        const c = await fetch("/dashboard/op/" + encodeURIComponent(rec.event_id), { headers: opHeaders });
        const st = await c.json();
        if (st.state === "done" || st.state === "failed") {
          const res = st.result || {};
          const what = ["chunks", "tokens"].filter((k) => k in res).map((k) => `${k}: ${res[k]}`).join(", ");
          li.textContent = `${desc}: ${st.state}` + (st.reason ? ` (${st.reason})` : "") + (what ? ` (${what})` : "");
          li.className = st.state === "done" ? "ok" : "bad";
          li.dataset.state = st.state;
          return;
        }
        await new Promise((res) => setTimeout(res, 250));
      }
    } catch (e) { li.textContent = `${desc}: error ${e}`; li.className = "bad"; }
  }

  // -- main loop ----------------------------------------------------------------------------
  function render(snap) {
    K.snap = snap;
    $("kind").textContent = snap.kind === "controller" ? "controller (all instances)" : "server";
    document.title = "kvtier " + snap.kind;
    $("token-form").hidden = true;
    $("signout").hidden = !K.signedIn;
    renderTiles(snap); renderTiers(snap); renderHot(snap); renderInstances(snap); renderCharts(snap);
    K.renders++;
    if (K.firstPaintMs == null) K.firstPaintMs = performance.now();
    $("status").textContent = "live, updated " + new Date(snap.time * 1000).toLocaleTimeString();
  }
  function signIn(why) {
    $("token-form").hidden = false;
    $("signout").hidden = true;
    $("status").textContent = why;
    $("token").focus();
  }
  let es = null;
  function connect() {
    if (es) es.close();
    es = new EventSource("/dashboard/events");
    es.addEventListener("snapshot", (e) => render(JSON.parse(e.data)));
    es.onerror = () => {
      $("status").textContent = "disconnected, retrying…";
      if (es.readyState === EventSource.CLOSED) { es = null; setTimeout(load, 2000); }  // refused: ask again
    };
  }
  async function load() {
    try {
      const r = await fetch("/dashboard/snapshot");
      if (r.status === 401) { K.signedIn = false; if (es) { es.close(); es = null; } signIn("sign in with the operator token to see this dashboard"); return; }
      if (!r.ok) { const d = await r.json().catch(() => ({})); $("status").textContent = `refused (${r.status}) ${d.detail || ""}`; return; }
      render(await r.json());
      if (!es) connect();
    } catch (e) { $("status").textContent = "error: " + e; }
  }
  $("token-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const token = $("token").value.trim();
    $("token").value = "";
    const r = await fetch("/dashboard/login", { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ token }) });
    if (!r.ok) { signIn(r.status === 401 ? "wrong token, try again" : "sign-in refused (" + r.status + ")"); return; }
    K.signedIn = true;
    await load();
  });
  $("signout").addEventListener("click", async () => {
    await fetch("/dashboard/logout", { method: "POST" });
    K.signedIn = false;
    if (es) { es.close(); es = null; }
    await load();
  });
  load();
})();
