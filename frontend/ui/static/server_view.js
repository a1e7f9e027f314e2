// The server view: this server's /metrics read every few seconds, shown as cards (requests,
// KV cache per tier, prefix-cache hits) and a chart of generated tokens per second.

import { apiFetch } from "./api.js";

const INTERVAL_MS = 3000;
const WINDOW_S = 300;

// Prometheus text format -> Map of "name{labels}" (labels as written) -> value.
export function parseMetrics(text) {
  const out = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const space = line.lastIndexOf(" ");
    out.set(line.slice(0, space), Number(line.slice(space + 1)));
  }
  return out;
}

function formatBytes(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  for (; bytes >= 1024 && i < units.length - 1; i++) bytes /= 1024;
  return `${bytes.toFixed(i ? 1 : 0)} ${units[i]}`;
}

const percent = (x) => `${(100 * x).toFixed(1)} %`;

// A counter's rate between two samples (0 without two, or when no time passed).
function rateBetween(a, b, name) {
  if (!a || !b || b.t <= a.t) return 0;
  return ((b.metrics.get(name) ?? 0) - (a.metrics.get(name) ?? 0)) / (b.t - a.t);
}

// The exactness audit (--audit-rate): re-runs compared, and divergences per shortcut.
export function auditSummary(m) {
  const runs = m.get("deepinfer_audit_requests_total") ?? 0;
  const prefix = "deepinfer_audit_divergences_total{shortcut=\"";
  const by = [...m].filter(([k, v]) => k.startsWith(prefix) && v > 0)
    .map(([k, v]) => `${k.slice(prefix.length, -2)} ${v}`);
  return `${runs} re-runs, ${by.length ? `divergences: ${by.join(", ")}` : "no divergence"}`;
}

export class ServerView {
  constructor() {
    this.samples = [];  // {t (s), metrics}
    this.cards = document.getElementById("cards");
    this.chart = document.getElementById("throughput-chart");
    this.status = document.getElementById("server-status");
  }

  start() {
    this.poll();
    setInterval(() => this.poll(), INTERVAL_MS);
  }

  async poll() {
    try {
      const response = await apiFetch("/metrics");  // (with --api-key, /metrics wants it)
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const metrics = parseMetrics(await response.text());
      const t = performance.now() / 1000;
      this.samples.push({ t, metrics });
      while (this.samples.length > 2 && t - this.samples[0].t > WINDOW_S) this.samples.shift();
      this.render();
      this.status.textContent = `Updated ${new Date().toLocaleTimeString()}`;
    } catch (err) {
      this.status.textContent = `Could not read /metrics: ${err.message}`;
    }
  }

  // The rate of a counter over the last two samples (0 before there are two).
  rate(name) {
    const [a, b] = this.samples.slice(-2);
    return rateBetween(a, b, name);
  }

  render() {
    const m = this.samples.at(-1).metrics;
    const get = (name) => m.get(name) ?? 0;
    const total = get("deepinfer_kv_blocks_total");
    const used = get("deepinfer_kv_blocks_used");
    const queried = this.rate("deepinfer_prefix_cache_queries_tokens_total");
    const hit = this.rate("deepinfer_prefix_cache_hits_tokens_total");
    const tier = (t) => get(`deepinfer_kv_tier_hit_tokens_total{tier="${t}"}`);
    const cards = [
      ["running", "Running requests", String(get("deepinfer_num_requests_running"))],
      ["waiting", "Waiting requests", String(get("deepinfer_num_requests_waiting"))],
      ["kv-device", "KV cache, device",
        total ? `${percent(used / total)} (${used} of ${total} blocks)` : "-"],
      ["kv-host", "KV cache, host tier", `${get("deepinfer_host_kv_blocks_used")} blocks`],
      ["kv-disk", "KV cache, disk tier",
        `${get("deepinfer_kv_disk_blocks_used")} blocks, ${formatBytes(get("deepinfer_kv_disk_used_bytes"))}`],
      ["hit-rate", "Prefix-cache hit rate",
        `${percent(get("deepinfer_prefix_cache_hit_rate"))} overall` +
        (queried > 0 ? `, ${percent(hit / queried)} now` : "")],
      ["hits-per-tier", "Prompt tokens from cache",
        `device ${tier("device")}, host ${tier("host")}, disk ${tier("disk")}`],
      ["tok-s", "Generation", `${this.rate("deepinfer_engine_generation_tokens_total").toFixed(1)} tok/s`],
      ["audit", "Exactness audit", auditSummary(m)],
    ];
    this.cards.replaceChildren(...cards.map(([id, label, value]) => {
      const card = document.createElement("div");
      card.className = "card";
      card.dataset.metric = id;
      const title = Object.assign(document.createElement("div"), { className: "label" });
      title.textContent = label;
      const body = Object.assign(document.createElement("div"), { className: "value" });
      body.textContent = value;
      card.append(title, body);
      return card;
    }));
    this.drawChart();
  }

  drawChart() {
    // Draw at the size shown (the canvas stretches to its box).
    if (this.chart.clientWidth && this.chart.width !== this.chart.clientWidth) {
      this.chart.width = this.chart.clientWidth;
    }
    const ctx = this.chart.getContext("2d");
    const { width, height } = this.chart;
    ctx.clearRect(0, 0, width, height);
    const points = [];
    for (let i = 1; i < this.samples.length; i++) {
      const b = this.samples[i];
      const rate = rateBetween(this.samples[i - 1], b, "deepinfer_engine_generation_tokens_total");
      points.push([b.t, Math.max(0, rate)]);
    }
    const now = this.samples.at(-1).t;
    const top = Math.max(1, ...points.map((p) => p[1])) * 1.1;
    const pad = 40;
    const x = (t) => pad + (width - pad - 10) * (1 - (now - t) / WINDOW_S);
    const y = (v) => height - pad / 2 - (height - pad) * (v / top);
    ctx.strokeStyle = "#999";
    ctx.fillStyle = "#666";
    ctx.font = "12px sans-serif";
    ctx.beginPath();
    ctx.moveTo(pad, y(0));
    ctx.lineTo(width - 10, y(0));
    ctx.stroke();
    ctx.fillText(`${top.toFixed(0)} tok/s`, 2, y(top) + 12);
    ctx.fillText("0", 2, y(0));
    ctx.strokeStyle = "#2a6fdb";
    ctx.lineWidth = 2;
    ctx.beginPath();
    points.forEach(([t, v], i) => (i ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
    ctx.stroke();
  }
}
