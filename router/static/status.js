// pdcluster's status page: fetches GET /admin/status (router/status_model.py's ClusterStatus)
// every REFRESH_MS and redraws. Data goes into the page as text nodes only (textContent, never
// innerHTML): instance ids and error messages come from the network and must stay text.
"use strict";

const REFRESH_MS = 2000;
const STARTS_SHOWN = 12;
const ERRORS_SHOWN = 20;
const PLACEMENTS_SHOWN = 20;
const STAGE_COLORS = ["#3b6fd8", "#1f9d55", "#d98e04", "#8e44ad", "#d6453d", "#16a3b8",
                      "#7a5c3e", "#c2407a", "#5d6d7e", "#9aa31b"];

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function replaceChildren(parent, children) {
  parent.replaceChildren(...children);
}

function percent(fraction) {
  return fraction === null || fraction === undefined ? "-" : `${(100 * fraction).toFixed(1)}%`;
}

function bytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n, unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return `${value.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}

function clock(unixSeconds) {
  return new Date(unixSeconds * 1000).toLocaleTimeString();
}

// A state as a badge; its class is the state only when it is a plain word (it comes from the network).
function badge(state) {
  const safeClass = /^[a-z_]+$/.test(state) ? state : "";
  return el("span", `badge ${safeClass}`, state);
}

function meter(fraction) {
  const outer = el("div", "meter");
  const inner = el("span");
  inner.style.width = `${Math.max(0, Math.min(1, fraction || 0)) * 100}%`;
  outer.append(inner);
  return outer;
}

function cell(text, className) {
  return el("td", className, text);
}

function emptyRow(columns, text) {
  const td = el("td", "empty", text);
  td.colSpan = columns;
  const tr = el("tr");
  tr.append(td);
  return tr;
}

function drawHeader(status) {
  document.getElementById("model").textContent =
    `${status.models.length > 1 ? "models" : "model"} ${status.models.join(", ")}`;
  const health = document.getElementById("health");
  health.replaceWith(Object.assign(badge(status.health), { id: "health" }));
  const r = status.requests;
  document.getElementById("requests").textContent =
    `${r.served} served · ${r.inflight} in flight · ${r.queued} queued`;
  document.getElementById("updated").textContent = `as of ${clock(status.generated_at)}`;
}

function drawPools(pools) {
  const cards = pools.map((pool) => {
    const card = el("div", "pool");
    card.append(el("div", "role", `${pool.model} · ${pool.role}`));
    for (const [state, count] of Object.entries(pool.states)) {
      card.append(badge(state), el("span", "muted", `${count} `));
    }
    return card;
  });
  replaceChildren(document.getElementById("pools"), cards.length ? cards : [el("p", "empty", "no pools")]);
}

function drawInstances(instances) {
  const mostInflight = Math.max(1, ...instances.map((i) => i.inflight));
  const rows = instances.map((i) => {
    const tr = el("tr");
    tr.dataset.instanceId = i.instance_id;
    const state = el("td");
    state.append(badge(i.state));
    const inflight = cell(i.inflight, "num");
    const load = el("span", "load");
    const fill = el("span");
    fill.style.width = `${(100 * i.inflight) / mostInflight}%`;
    load.append(fill);
    inflight.append(load);
    tr.append(cell(i.instance_id, "mono instance-id"), cell(i.role), state, cell(i.tensor_parallel_size, "num"), inflight,
              cell(Math.round(i.pending_prefill_tokens), "num"), cell(i.index_blocks, "num"),
              cell(i.url, "mono"));
    return tr;
  });
  const body = document.querySelector("#instances tbody");
  replaceChildren(body, rows.length ? rows : [emptyRow(7, "no instances")]);
}

function stageColors(starts) {
  const colors = new Map();
  for (const start of starts) {
    for (const stage of Object.keys(start.stages_s)) {
      if (!colors.has(stage)) colors.set(stage, STAGE_COLORS[colors.size % STAGE_COLORS.length]);
    }
  }
  return colors;
}

function drawStarts(allStarts) {
  const starts = allStarts.slice(-STARTS_SHOWN);
  const colors = stageColors(starts);
  const longest = Math.max(1e-9, ...starts.map((s) => s.total_s));
  const rows = starts.map((start) => {
    const row = el("div", "start");
    const who = el("div", "who mono", `${start.instance_id} (${start.path})`);
    who.title = `${start.role}, asked at ${clock(start.started_at)}`;
    const bar = el("div", "bar");
    for (const [stage, seconds] of Object.entries(start.stages_s)) {
      const segment = el("span");
      segment.style.width = `${(100 * seconds) / longest}%`;
      segment.style.backgroundColor = colors.get(stage);
      segment.title = `${stage}: ${seconds.toFixed(3)} s`;
      bar.append(segment);
    }
    row.append(who, bar, el("div", "total", `${start.total_s.toFixed(2)} s`));
    return row;
  });
  replaceChildren(document.getElementById("starts"), rows.length ? rows : [el("p", "empty", "no starts yet")]);
  const legend = [...colors].map(([stage, color]) => {
    const item = el("span");
    const swatch = el("span", "swatch");
    swatch.style.backgroundColor = color;
    item.append(swatch, document.createTextNode(stage));
    return item;
  });
  replaceChildren(document.getElementById("stage-legend"), legend);
}

function drawHitRates(hits) {
  const rate = (label, rateValue, blocks) => {
    const item = el("div", "rate");
    item.append(el("div", null, `${label}: ${percent(rateValue)}`),
                el("div", "muted", `${blocks} of ${hits.prompt_blocks} prompt blocks`), meter(rateValue));
    return item;
  };
  replaceChildren(document.getElementById("hit-rates"), [
    rate("in the chosen instance's prefix cache", hits.instance_hit_rate, hits.instance_hit_blocks),
    rate("in the KV store", hits.store_hit_rate, hits.store_hit_blocks),
  ]);
}

function drawStore(shards) {
  const items = shards.map((shard) => {
    const item = el("div", "shard");
    item.append(el("div", "mono", shard.endpoint));
    if (shard.error) {
      item.append(el("div", "error", shard.error));
    } else {
      const fraction = shard.capacity_bytes ? shard.used_bytes / shard.capacity_bytes : 0;
      item.append(el("div", "muted", `${bytes(shard.used_bytes)} of ${bytes(shard.capacity_bytes)} · ` +
                                     `${shard.chunks ?? "-"} chunks`), meter(fraction));
    }
    return item;
  });
  replaceChildren(document.getElementById("store"), items.length ? items : [el("p", "empty", "no store shards")]);
}

function candidateText(candidate) {
  const score = candidate.score === null ? "-" : Math.round(candidate.score);
  return `${candidate.instance_id}: ${candidate.cached_blocks}` +
         `${candidate.store_blocks ? "+" + candidate.store_blocks + " store" : ""} · ` +
         `${Math.round(candidate.queued_tokens)} · ${candidate.inflight} · ${score}`;
}

function reasonText(placement) {
  const prefilled = placement.prefill ? `, prefilled on ${placement.prefill}` : "";
  return `${placement.migrated ? "migrated, " : ""}${placement.reason}${prefilled}`;
}

function drawPlacements(allPlacements) {
  const rows = allPlacements.slice(-PLACEMENTS_SHOWN).reverse().map((placement) => {
    const tr = el("tr");
    const candidates = el("td", "mono");
    for (const candidate of placement.candidates) {
      const chosen = candidate.instance_id === placement.chosen;
      candidates.append(el("div", chosen ? "chosen" : null, candidateText(candidate)));
    }
    tr.append(cell(clock(placement.at)), cell(placement.model),
              cell(`${placement.prompt_tokens} (${placement.prompt_blocks} blocks)`, "num"),
              cell(reasonText(placement)), candidates);
    return tr;
  });
  replaceChildren(document.querySelector("#placements tbody"), rows.length ? rows : [emptyRow(5, "none yet")]);
}

function drawErrors(allErrors) {
  const rows = allErrors.slice(-ERRORS_SHOWN).reverse().map((error) => {
    const tr = el("tr");
    tr.append(cell(clock(error.at)), cell(error.kind), cell(error.status, "num"), cell(error.message, "message"));
    return tr;
  });
  replaceChildren(document.querySelector("#errors tbody"), rows.length ? rows : [emptyRow(4, "none")]);
}

function draw(status) {
  drawHeader(status);
  drawPools(status.pools);
  drawInstances(status.instances);
  drawStarts(status.starts);
  drawHitRates(status.hit_rates);
  drawStore(status.store);
  drawPlacements(status.recent_placements);
  drawErrors(status.recent_errors);
}

function showFetchError(text) {
  const banner = document.getElementById("fetch-error");
  banner.textContent = text;
  banner.hidden = !text;
}

// One request at a time: the next starts REFRESH_MS after the last one ended.
async function refresh() {
  try {
    const response = await fetch("/admin/status", { cache: "no-store", credentials: "same-origin" });
    if (!response.ok) throw new Error(`GET /admin/status answered ${response.status}`);
    draw(await response.json());
    showFetchError("");
  } catch (error) {
    showFetchError(`${error.message}; showing the last state, retrying every ${REFRESH_MS / 1000} s`);
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
