// The swarm monitor: polls /v1/swarm every 2 s and redraws the cards, the coverage map, the server table and two
// charts. No libraries (served offline by the gateway itself). An API key can be given as #key=... in the URL.
"use strict";
const REFRESH_MS = 2000;
const key = new URLSearchParams(location.hash.slice(1)).get("key");

const $ = (id) => document.getElementById(id);
function el(tag, attrs = {}, text = "") {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== "") e.textContent = text;
  return e;
}
const fmt = (v, digits = 1, unit = "") => (v === null || v === undefined ? "–" : `${Number(v).toFixed(digits)}${unit}`);
const ms = (s) => (s === null || s === undefined ? "–" : `${(s * 1000).toFixed(1)} ms`);
const mib = (b) => `${(b / 1048576).toFixed(1)} MiB`;
const short = (id) => id.slice(-8);

function cards(data) {
  const g = data.gateway;
  const items = [
    ["servers", data.servers.filter((s) => s.state === "online").length + " / " + data.servers.length],
    ["blocks covered", `${data.num_blocks - data.missing_blocks.length} / ${data.num_blocks}`],
    ["tokens/s (1 min)", fmt(g.tokens_per_s)],
    ["requests/s (1 min)", fmt(g.requests_per_s, 2)],
    ["active requests", g.active_requests],
    ["TTFT p50 / p90", `${ms(g.ttft_s.p50)} / ${ms(g.ttft_s.p90)}`],
    ["TPOT p50 / p90", `${ms(g.tpot_s.p50)} / ${ms(g.tpot_s.p90)}`],
  ];
  const box = $("cards");
  box.replaceChildren(...items.map(([label, value]) => {
    const c = el("div", { class: "card" });
    c.append(el("b", {}, String(value)), el("small", {}, label));
    return c;
  }));
}

function coverage(data) {
  // one row per server, one column per block; a last row counts live servers per block
  const grid = $("coverage");
  grid.style.gridTemplateColumns = `auto repeat(${data.num_blocks}, 24px)`;
  const cells = [el("div", { class: "cell-label" }, "server \\ block")];
  for (let b = 0; b < data.num_blocks; b++) cells.push(el("div", {}, String(b)));
  for (const s of data.servers) {
    cells.push(el("div", { class: "cell-label", title: s.id }, `${short(s.id)} ${s.address}`));
    for (let b = 0; b < data.num_blocks; b++) {
      const on = s.blocks[0] <= b && b < s.blocks[1];
      const cls = on ? (s.state === "online" ? "cell-on" : "cell-down") : "cell-off";
      cells.push(el("div", { class: cls, "data-server": s.id, "data-block": b }, on ? "■" : ""));
    }
  }
  cells.push(el("div", { class: "cell-label" }, "live servers"));
  data.coverage.forEach((n) => cells.push(el("div", { class: n ? "cell-count" : "cell-missing" }, String(n))));
  grid.replaceChildren(...cells);
}

function servers(data) {
  const body = $("servers").querySelector("tbody");
  body.replaceChildren(...data.servers.map((s) => {
    const tr = el("tr", { "data-server": s.id });
    const cols = [
      [short(s.id), { title: s.id }],
      s.relayed ? [`${s.address} (relayed)`, { class: "relayed", title: `behind NAT, through relay ${s.relay || "(none)"}` }]
        : [s.address],
      [`[${s.blocks[0]}, ${s.blocks[1]})`, { class: "blocks" }],
      [s.state, { class: `state-${s.state}` }], [s.active_sessions], [s.queue_length],
      [`${mib(s.cache_bytes_free)} / ${mib(s.cache_bytes_total)}`], [fmt(s.tokens_per_s)], [ms(s.rtt_s)],
      [s.last_seen_s_ago === null ? "never" : `${s.last_seen_s_ago.toFixed(0)} s ago`],
    ];
    tr.append(...cols.map(([text, attrs]) => el("td", attrs || {}, String(text))));
    return tr;
  }));
}

function chart(canvas, series, colors, unit) {
  // series: arrays of [t, value|null] over the same window; a simple line chart with a max label
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 24;
  ctx.clearRect(0, 0, w, h);
  const now = Date.now() / 1000, t0 = now - 300;
  const values = series.flat().map((p) => p[1]).filter((v) => v !== null);
  const max = Math.max(1e-9, ...values) * 1.15;
  ctx.strokeStyle = "#dde1e7"; ctx.beginPath(); ctx.moveTo(pad, h - pad); ctx.lineTo(w - 4, h - pad); ctx.stroke();
  ctx.fillStyle = "#596273"; ctx.font = "11px system-ui";
  ctx.fillText(`${unit === "ms" ? (max * 1000).toFixed(1) : max.toFixed(1)} ${unit}`, 4, 12);
  ctx.fillText("-5 min", pad, h - 8); ctx.fillText("now", w - 28, h - 8);
  series.forEach((points, i) => {
    ctx.strokeStyle = colors[i]; ctx.lineWidth = 2; ctx.beginPath();
    let drawing = false;
    for (const [t, v] of points) {
      if (v === null || t < t0) { drawing = false; continue; }
      const x = pad + ((t - t0) / 300) * (w - pad - 4), y = h - pad - (v / max) * (h - pad - 16);
      drawing ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
      drawing = true;
    }
    ctx.stroke();
    ctx.fillStyle = colors[i];  // dots too: a lone bucket with a value is still visible
    for (const [t, v] of points) {
      if (v === null || t < t0) continue;
      const x = pad + ((t - t0) / 300) * (w - pad - 4), y = h - pad - (v / max) * (h - pad - 16);
      ctx.fillRect(x - 2, y - 2, 4, 4);
    }
  });
}

function charts(data) {
  const hist = data.gateway.history;
  chart($("tps"), [hist.map((b) => [b.t, b.tokens_per_s])], ["#4c8bf5"], "tok/s");
  chart($("lat"), [hist.map((b) => [b.t, b.ttft_p50_s]), hist.map((b) => [b.t, b.tpot_p50_s])],
        ["#e5484d", "#1a7f37"], "ms");  // red: time to first token, green: time per output token
}

async function refresh() {
  const status = $("status");
  try {
    const reply = await fetch("/v1/swarm", { headers: key ? { Authorization: `Bearer ${key}` } : {} });
    const data = await reply.json();
    if (!reply.ok) throw new Error(data.error ? data.error.message : reply.statusText);
    $("model").textContent = data.model;
    cards(data); coverage(data); servers(data); charts(data);
    status.textContent = data.complete ? "model fully covered" : `missing blocks: ${data.missing_blocks.join(", ")}`;
    status.className = "status " + (data.complete ? "ok" : "bad");
    document.body.dataset.updated = String(Date.now());
  } catch (err) {
    status.textContent = `cannot read the swarm: ${err.message}`;
    status.className = "status bad";
  }
}

refresh();
setInterval(refresh, REFRESH_MS);
