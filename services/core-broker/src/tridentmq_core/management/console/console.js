// The TridentMQ web console: plain JavaScript, no build step, everything read from this node's /api.
// Text from the broker is only ever put into the page as text (textContent), never as markup.
"use strict";

(() => {
  const AUTH_KEY = "tridentmq.console.auth"; // sessionStorage: gone when the tab closes
  const POLL_MS = 2000;
  const REQUEST_TIMEOUT_MS = 8000;
  const HISTORY_POINTS = 150; // 5 minutes of samples for the charts

  // ------------------------------------------------------------------ small DOM helpers
  const $ = (selector, root = document) => root.querySelector(selector);

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs)) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "class") node.className = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  // The queues of the broker's own state: cluster store-and-forward, and the gateways' sessions, locks, outboxes and
  // retained messages.
  const INTERNAL_PREFIXES = ["$sys.", "$mqtt.", "$amqp.", "$stomp."];
  const fmt = new Intl.NumberFormat("en", { maximumFractionDigits: 1 });
  const num = (n) => (typeof n === "number" ? fmt.format(n) : "–");
  const when = (ms) => (ms ? new Date(ms).toLocaleString() : "–");
  const shortId = (id) => String(id || "").slice(0, 8);
  const badge = (text, kind) => el("span", { class: `badge ${kind}` }, text);

  function toast(text, kind = "ok") {
    const box = el("div", { class: `toast ${kind}`, role: "status" }, text);
    document.body.append(box);
    setTimeout(() => box.remove(), 6000);
  }

  // ------------------------------------------------------------------ the API
  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  function encodeCredentials(user, password) {
    const bytes = new TextEncoder().encode(`${user}:${password}`);
    let binary = "";
    for (const b of bytes) binary += String.fromCharCode(b);
    return btoa(binary);
  }

  // Every call carries the credentials of the session as a header (never in a URL), the console's marker
  // (no browser login prompt on 401) and the request marker that state-changing calls need (CSRF defence).
  async function api(path, { method = "GET", body } = {}, credentials = sessionStorage.getItem(AUTH_KEY)) {
    const headers = { Accept: "application/json", "X-TridentMQ-Console": "1", "X-TridentMQ-Request": "1" };
    if (credentials) headers.Authorization = `Basic ${credentials}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let answer, text;
    try {
      // A node that is frozen (or a network that drops packets) accepts the connection and never answers: without
      // a limit the page would keep showing its last answer as if it were current.
      answer = await fetch(path, {
        method, headers, body: body === undefined ? undefined : JSON.stringify(body),
        credentials: "omit", cache: "no-store", redirect: "follow", signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS),
      });
      text = await answer.text();
    } catch (error) {
      if (error.name === "TimeoutError") throw new ApiError(0, `this node did not answer within ${REQUEST_TIMEOUT_MS / 1000} s`);
      throw new ApiError(0, `this node cannot be reached (${error.message})`);
    }
    let data = null;
    try {
      data = text ? JSON.parse(text) : null;
    } catch {
      data = { error: text.slice(0, 200) };
    }
    if (!answer.ok) {
      const error = new ApiError(answer.status, (data && data.error) || answer.statusText);
      if (answer.status === 401 && credentials === sessionStorage.getItem(AUTH_KEY)) loggedOut(error.message);
      throw error;
    }
    return data;
  }

  const q = encodeURIComponent;
  // A read of one node's API: this node answers for every live member of its cluster (/api/nodes/...).
  const nodeApi = (nodeId, path, options) =>
    api(nodeId === state.selfId ? `/api/${path}` : `/api/nodes/${q(nodeId)}/${path}`, options);

  // ------------------------------------------------------------------ state shared by the pages
  const state = {
    selfId: null,
    nodes: [], // [{member, status, error}]
    history: { t: [], routed: [], acked: [], deadLettered: [], depth: [], inFlight: [], perNode: {}, latency: {}, timedSince: 0, routedSince: 0 },
    lastCounters: null,
    routes: new Set(), // the operations this node offers (from /api/operations when present)
  };

  async function loadNodes() {
    const self = await api("/api/status");
    state.selfId = self.node_id;
    const members = self.cluster ? self.cluster.members
      : [{ node_id: self.node_id, name: self.name, host: location.hostname, port: self.link_port, epoch: self.epoch,
        management: Number(location.port) || (location.protocol === "https:" ? 443 : 80) }]; // (this page's port)
    const sorted = [...members].sort((a, b) => String(a.name).localeCompare(String(b.name)));
    state.nodes = await Promise.all(sorted.map(async (member) => {
      if (member.node_id === self.node_id) return { member, status: self };
      try {
        return { member, status: await nodeApi(member.node_id, "status") };
      } catch (error) {
        return { member, error: error.message };
      }
    }));
    sample();
    return state.nodes;
  }

  const nodeName = (nodeId) => {
    const found = state.nodes.find((n) => n.member.node_id === nodeId);
    return found ? found.member.name || shortId(nodeId) : shortId(nodeId);
  };

  // The upper bound (ms) of the histogram bucket holding the given fraction of the latencies counted in
  // `counts` (the node's cumulative buckets, differenced between two polls); null when nothing was counted.
  function percentile(bounds, counts, fraction) {
    const total = counts.reduce((s, n) => s + n, 0);
    if (total <= 0) return null;
    const rank = Math.max(1, Math.ceil(fraction * total));
    let seen = 0;
    for (let i = 0; i < counts.length; i++) {
      seen += counts[i];
      if (seen >= rank) return i < bounds.length ? bounds[i] : Infinity;
    }
    return null;
  }

  // One chart sample per poll: cluster-wide rates from the counters' differences, depth and in-flight totals.
  function sample() {
    const now = Date.now() / 1000;
    const sum = (key) => state.nodes.reduce((s, n) => s + ((n.status && n.status.counters[key]) || 0), 0);
    const counters = { routed: sum("routed"), acked: sum("acked"), dead_lettered: sum("dead_lettered"), t: now };
    const perNode = {};
    const latency = {};
    for (const n of state.nodes) {
      if (!n.status) continue;
      perNode[n.member.node_id] = n.status.counters.routed;
      if (n.status.latency) latency[n.member.node_id] = n.status.latency;
    }
    const last = state.lastCounters;
    state.lastCounters = { ...counters, perNode, latency };
    if (!last || now - last.t <= 0) return;
    const dt = now - last.t;
    const rate = (key) => Math.max(0, (counters[key] - last[key]) / dt);
    const h = state.history;
    h.t.push(now);
    h.routedSince += Math.max(0, counters.routed - last.routed); // messages routed since the console opened
    h.routed.push(rate("routed"));
    h.acked.push(rate("acked"));
    h.deadLettered.push(rate("dead_lettered"));
    h.depth.push(state.nodes.reduce((s, n) => s + ((n.status && n.status.messages) || 0), 0));
    h.inFlight.push(state.nodes.reduce((s, n) => s + ((n.status && n.status.in_flight) || 0), 0));
    for (const [id, routed] of Object.entries(perNode)) {
      const series = h.perNode[id] || (h.perNode[id] = new Array(h.t.length - 1).fill(null));
      const before = last.perNode[id];
      series.push(before === undefined ? null : Math.max(0, (routed - before) / dt));
    }
    for (const series of Object.values(h.perNode)) while (series.length < h.t.length) series.push(null);
    // Latency percentiles of the messages acknowledged on each node since the last poll (none: a gap).
    for (const [id, now] of Object.entries(latency)) {
      const series = h.latency[id] || (h.latency[id] = { p50: new Array(h.t.length - 1).fill(null), p99: new Array(h.t.length - 1).fill(null) });
      const before = last.latency && last.latency[id];
      const counts = before && before.counts.length === now.counts.length ? now.counts.map((n, i) => n - before.counts[i]) : null;
      const valid = counts && counts.every((n) => n >= 0); // a restarted node starts its counts again
      if (valid) h.timedSince += counts.reduce((s, n) => s + n, 0);
      series.p50.push(valid ? percentile(now.le_ms, counts, 0.5) : null);
      series.p99.push(valid ? percentile(now.le_ms, counts, 0.99) : null);
    }
    for (const series of Object.values(h.latency)) for (const key of ["p50", "p99"]) while (series[key].length < h.t.length) series[key].push(null);
    if (h.t.length > HISTORY_POINTS) {
      for (const key of ["t", "routed", "acked", "deadLettered", "depth", "inFlight"]) h[key].shift();
      for (const series of Object.values(h.perNode)) series.shift();
      for (const series of Object.values(h.latency)) { series.p50.shift(); series.p99.shift(); }
    }
  }

  // ------------------------------------------------------------------ tables: sortable, searchable
  // columns: [{key, label, value(row) -> sortable value, render(row) -> node or text, numeric}]
  function sortableTable(id, columns, { sortKey, descending = false } = {}) {
    const view = { rows: [], sortKey: sortKey || columns[0].key, descending, filter: () => true };
    const head = el("tr", {}, columns.map((c) => el("th", {
      "data-key": c.key, class: c.numeric ? "num sortable" : "sortable", tabindex: 0,
      onclick: () => {
        view.descending = view.sortKey === c.key ? !view.descending : Boolean(c.numeric);
        view.sortKey = c.key;
        draw();
      },
    }, c.label)));
    const body = el("tbody");
    const table = el("table", { id, class: "grid" }, el("thead", {}, head), body);
    function draw() {
      const column = columns.find((c) => c.key === view.sortKey) || columns[0];
      const value = column.value || ((row) => row[column.key]);
      const rows = view.rows.filter(view.filter).sort((a, b) => {
        const x = value(a), y = value(b);
        const order = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
        return view.descending ? -order : order;
      });
      for (const th of head.children) {
        th.removeAttribute("aria-sort");
        if (th.dataset.key === column.key) th.setAttribute("aria-sort", view.descending ? "descending" : "ascending");
      }
      body.replaceChildren(...rows.map((row) => el("tr", {}, columns.map((c) => el("td", { class: c.numeric ? "num" : "" },
        c.render ? c.render(row) : (c.numeric ? num(row[c.key]) : row[c.key] ?? "–"))))));
      if (!rows.length) body.append(el("tr", {}, el("td", { colspan: columns.length, class: "empty" }, "nothing to show")));
    }
    return {
      table,
      set(rows) { view.rows = rows; draw(); },
      filter(predicate) { view.filter = predicate; draw(); },
    };
  }

  // ------------------------------------------------------------------ pages
  const pages = {};

  pages.cluster = async (root) => {
    const summary = el("section", { class: "cards", id: "summary" });
    const topology = el("section", { class: "topology", id: "topology" });
    const links = sortableTable("cluster-connections", [
      { key: "from", label: "From" }, { key: "to", label: "To" },
      { key: "state", label: "State", render: (r) => badge(r.state, r.state === "up" ? "good" : "bad") },
      { key: "pending_forward", label: "Waiting to be forwarded", numeric: true }, { key: "reason", label: "Reason" },
    ]);
    root.append(el("h1", {}, "Cluster"), summary, el("h2", {}, "Nodes and pairs"), topology,
      el("h2", {}, "Cluster connections"), links.table);
    return async () => {
      await loadNodes();
      const self = state.nodes.find((n) => n.member.node_id === state.selfId).status;
      const cluster = self.cluster;
      const total = (key) => state.nodes.reduce((s, n) => s + ((n.status && n.status[key]) || 0), 0);
      summary.replaceChildren(
        card("Cluster", cluster ? cluster.cluster : "not clustered", cluster ? `policy ${cluster.policy}, max-hops ${cluster.max_hops}` : ""),
        card("Live nodes", state.nodes.length, `${state.nodes.filter((n) => n.status && n.status.ready).length} ready`),
        card("Messages", num(total("messages")), `${num(total("in_flight"))} in flight`),
        card("Queues", num(total("queues")), `${num(total("addresses"))} addresses`),
        card("Connections", num(total("connections")), "links to the nodes"),
      );
      topology.replaceChildren(...state.nodes.map(nodeCard));
      const rows = [];
      for (const n of state.nodes) {
        const c = n.status && n.status.cluster;
        if (!c) continue;
        for (const link of c.connections) rows.push({ from: n.member.name, to: link.name || link.address, ...link });
        for (const [id, gone] of Object.entries(c.unreachable || {})) {
          rows.push({ from: n.member.name, to: shortId(id), state: "unreachable", pending_forward: gone.pending_forward,
            reason: `its durable queues stay destinations: ${gone.queues.join(", ")}` });
        }
      }
      links.set(rows);
    };
  };

  function card(title, value, note) {
    return el("div", { class: "card" }, el("div", { class: "card-title" }, title),
      el("div", { class: "card-value" }, value), el("div", { class: "card-note" }, note));
  }

  function nodeCard(n) {
    const { member, status, error } = n;
    const ha = status && status.ha;
    const role = ha ? (ha.active ? (ha.configured_role === "backup" ? "backup, active" : "primary, active") : ha.configured_role) : "node";
    const cluster = status && status.cluster;
    const box = el("article", { class: "node", "data-node": member.node_id, "data-name": member.name },
      el("header", {}, el("strong", { class: "node-name" }, member.name || shortId(member.node_id)),
        badge(role, ha && ha.configured_role === "backup" && ha.active ? "warn" : "info"),
        error ? badge("unreachable", "bad") : badge(status.ready ? "ready" : "not ready", status.ready ? "good" : "bad")),
      el("dl", {},
        el("dt", {}, "node id"), el("dd", { class: "mono" }, member.node_id),
        el("dt", {}, "link"), el("dd", { class: "mono" }, `${member.host}:${member.port}`),
        el("dt", {}, "management"), el("dd", { class: "mono" }, member.management ? `port ${member.management}` : "–"),
        el("dt", {}, "epoch"), el("dd", { class: "epoch" }, status ? status.epoch : member.epoch),
        status && [el("dt", {}, "uptime"), el("dd", {}, `${num(status.uptime_s)} s`),
          el("dt", {}, "queues"), el("dd", {}, `${num(status.queues)} (${num(status.messages)} messages, ${num(status.in_flight)} in flight)`),
          el("dt", {}, "connections"), el("dd", {}, num(status.connections))],
        error && [el("dt", {}, "error"), el("dd", { class: "error" }, error)]),
    );
    if (ha) {
      const backupAt = member.backup ? `${member.backup[0]}:${member.backup[1]}` : null;
      const pair = el("div", { class: "pair" }, el("div", { class: "pair-title" }, `pair ${ha.group}`));
      if (ha.active && ha.backup) {
        pair.append(el("div", {}, "backup ", el("span", { class: "mono" }, ha.backup), backupAt ? ` at ${backupAt}` : "", " ",
          badge(ha.backup_in_sync ? "in sync" : "not in sync", ha.backup_in_sync ? "good" : "bad"),
          ha.backup_pending_records ? ` ${num(ha.backup_pending_records)} records behind` : ""));
      } else if (ha.active) {
        pair.append(el("div", {}, "no backup ", badge("alone", "warn")));
      }
      if (ha.waiting_for_quorum) pair.append(el("div", {}, badge("waiting for quorum", "bad")));
      if (ha.state) pair.append(el("div", {}, ha.state));
      box.append(pair);
    }
    if (status) {
      const nodeAct = (label, op, question) => el("button", { class: "small", type: "button", onclick: async () => {
        if (!confirm(question)) return;
        try {
          toast(`${label}: ${outcome(await runOperation(op, { node: member.node_id }))}`);
        } catch (error) {
          toast(`${label}: ${error.message}`, "bad");
        }
      } }, label);
      box.append(el("div", { class: "toolbar" },
        ha && ha.active && ha.configured_role === "backup" ? nodeAct("Fail back", "failback", `Hand pair ${ha.group} back to its primary?`) : null,
        cluster ? nodeAct("Scale down", "scale-down", `Move every message of ${member.name} to the other nodes and stop it?`) : null));
    }
    if (cluster) {
      const stranded = Object.entries(cluster.stranded || {});
      const moving = Object.entries(cluster.redistributing || {});
      if (stranded.length) box.append(el("div", { class: "warning" }, `stranded: ${stranded.map(([k, v]) => `${k} (${v})`).join(", ")}`));
      if (moving.length) box.append(el("div", {}, `redistributing: ${moving.map(([k, v]) => `${k} → ${v.map(nodeName).join(", ")}`).join("; ")}`));
    }
    return box;
  }

  // A link's client name says who opened it: a gateway names its clients' links "<protocol> ...".
  function classify(connection) {
    const name = connection.client_name || "";
    const word = name.split(" ")[0];
    if (name.startsWith("cluster:") || name.startsWith("backup:") || connection.user.startsWith("cluster:")) return "cluster";
    if (name.endsWith(" readiness") || name.endsWith(" topology") || name.endsWith(" sessions") || name.startsWith("mqtt gateway ") || name.startsWith("mqtt fan-out ")) return "gateway";
    if (["stomp", "mqtt", "amqp"].includes(word)) return word;
    return "link";
  }

  pages.gateways = async (root) => {
    const columns = (withClose) => [
      { key: "client_name", label: "Client" }, { key: "node", label: "Node" }, { key: "peer", label: "From" },
      { key: "user", label: "User" }, { key: "consumers", label: "Consumers", numeric: true },
      { key: "opened_ms", label: "Opened", render: (r) => when(r.opened_ms) },
      ...(withClose && operation("close-connection") ? [{ key: "close", label: "", render: (r) => el("button", {
        class: "small danger", onclick: () => closeConnection(r),
      }, "Close") }] : []),
    ];
    const groups = [["stomp", "STOMP clients"], ["mqtt", "MQTT clients"], ["amqp", "AMQP clients"],
      ["link", "Link clients"], ["gateway", "Gateway processes (their own links)"], ["cluster", "Cluster links"]];
    const tables = {};
    const counts = el("section", { class: "cards" });
    root.append(el("h1", {}, "Gateways and clients"), counts);
    for (const [kind, title] of groups) {
      tables[kind] = sortableTable(`clients-${kind}`, columns(kind !== "cluster" && kind !== "gateway"));
      root.append(el("h2", {}, title), tables[kind].table);
    }
    return async () => {
      await loadNodes();
      const all = (await Promise.all(state.nodes.filter((n) => n.status).map(async (n) => {
        try {
          return (await nodeApi(n.member.node_id, "connections")).map((c) => ({ ...c, node: n.member.name, node_id: n.member.node_id }));
        } catch {
          return [];
        }
      }))).flat();
      const byKind = Object.fromEntries(groups.map(([k]) => [k, []]));
      const named = (text) => text.replace(/^cluster:([0-9a-f-]{36})$/, (_, id) => `cluster:${nodeName(id)}`);
      for (const c of all) if (classify(c) === "cluster") Object.assign(c, { client_name: named(c.client_name), user: named(c.user) });
      for (const c of all) byKind[classify(c)].push(c);
      for (const [kind] of groups) tables[kind].set(byKind[kind]);
      counts.replaceChildren(...groups.slice(0, 4).map(([kind, title]) => card(title.replace(" clients", ""), byKind[kind].length, "client links")));
    };
  };

  async function closeConnection(row) {
    if (!confirm(`Close the connection of ${row.client_name}?`)) return;
    try {
      const done = await runOperation("close-connection", { node: row.node_id, client: row.conn_id });
      toast(`close: ${outcome(done)}`);
      await refreshNow();
    } catch (error) {
      toast(error.message, "bad");
    }
  }

  pages.queues = async (root) => {
    const search = el("input", { id: "queue-search", type: "search", placeholder: "search queues and addresses", "aria-label": "search" });
    const internal = el("input", { id: "show-internal", type: "checkbox" });
    const table = sortableTable("queues", [
      { key: "name", label: "Queue", render: (r) => el("a", { href: `#/queue/${q(r.node_id)}/${q(r.name)}` }, r.name) },
      { key: "node", label: "Node" }, { key: "address", label: "Address" }, { key: "routing_type", label: "Type" },
      { key: "depth", label: "Depth", numeric: true }, { key: "consumers", label: "Consumers", numeric: true },
      { key: "in_flight", label: "In flight", numeric: true }, { key: "enqueue_rate", label: "In/s", numeric: true },
      { key: "ack_rate", label: "Ack/s", numeric: true }, { key: "added", label: "Added", numeric: true },
      { key: "acked", label: "Acked", numeric: true }, { key: "dead_lettered", label: "Dead-lettered", numeric: true },
    ], { sortKey: "name" });
    const apply = () => {
      const text = search.value.trim().toLowerCase();
      table.filter((r) => (internal.checked || !INTERNAL_PREFIXES.some((prefix) => r.name.startsWith(prefix)))
        && (!text || r.name.toLowerCase().includes(text) || r.address.toLowerCase().includes(text)));
    };
    search.addEventListener("input", apply);
    internal.addEventListener("change", apply);
    const create = operation("create-queue") ? createQueueForm() : null;
    root.append(el("h1", {}, "Queues"),
      el("div", { class: "toolbar" }, search, el("label", {}, internal, " show internal queues ($sys.…, $mqtt.…, $amqp.…, $stomp.…)")),
      table.table, create || "");
    apply();
    return async () => {
      await loadNodes();
      const rows = (await Promise.all(state.nodes.filter((n) => n.status).map(async (n) => {
        try {
          return (await nodeApi(n.member.node_id, "queues")).map((r) => ({ ...r, node: n.member.name, node_id: n.member.node_id }));
        } catch {
          return [];
        }
      }))).flat();
      table.set(rows);
    };
  };

  function createQueueForm() {
    const name = el("input", { id: "new-queue-name", placeholder: "queue name", required: true });
    const address = el("input", { id: "new-queue-address", placeholder: "address (default: the name)" });
    const routing = el("select", { id: "new-queue-routing" }, el("option", { value: "anycast" }, "anycast"), el("option", { value: "multicast" }, "multicast"));
    const durable = el("input", { id: "new-queue-durable", type: "checkbox", checked: true });
    return el("form", { class: "panel", onsubmit: async (event) => {
      event.preventDefault();
      try {
        await runOperation("create-queue", { name: name.value, address: address.value || name.value, routing_type: routing.value, durable: durable.checked });
        toast(`queue ${name.value} created`);
        name.value = "";
        address.value = "";
      } catch (error) {
        toast(error.message, "bad");
      }
    } }, el("h2", {}, "Create a queue"), name, address, routing, el("label", {}, durable, " durable"), el("button", { type: "submit" }, "Create"));
  }

  pages.queue = async (root, [nodeId, name]) => {
    if (!state.nodes.length) await loadNodes(); // the node's name, for the operations' scope
    const details = el("dl", { class: "details", id: "queue-details" });
    const operations = el("section", { class: "panel", id: "queue-operations" });
    const browser = el("section", { id: "queue-messages" });
    root.append(el("p", {}, el("a", { href: "#/queues" }, "← queues")), el("h1", {}, "Queue ", el("span", { class: "mono", id: "queue-name" }, name)),
      details, operations, browser);
    fillOperations(operations, nodeId, name);
    let lastBrowse = 0;
    return async (force) => {
      if (!state.nodes.length) await loadNodes();
      let queue;
      try {
        queue = await nodeApi(nodeId, `queues/${q(name)}`);
      } catch (error) {
        details.replaceChildren(el("p", { class: "error" }, error.message));
        return;
      }
      const pairs = [["node", nodeName(nodeId)], ["address", queue.address], ["routing", queue.routing_type],
        ["durable", String(queue.durable)], ["filter", queue.filter || "–"], ["depth", num(queue.depth)],
        ["in flight", num(queue.in_flight)], ["consumers", num(queue.consumers)], ["forwarders", num(queue.forwarders)],
        ["added", num(queue.added)], ["acked", num(queue.acked)], ["delivered", num(queue.delivered)],
        ["expired", num(queue.expired)], ["dead-lettered", num(queue.dead_lettered)],
        ["in/s", num(queue.enqueue_rate)], ["ack/s", num(queue.ack_rate)]];
      if (queue.paused !== undefined) pairs.push(["paused", String(queue.paused)]);
      details.replaceChildren(...pairs.flatMap(([k, v]) => [el("dt", {}, k), el("dd", { "data-field": k }, v)]));
      if (force || Date.now() - lastBrowse > 5000) {
        lastBrowse = Date.now();
        await browse(browser, nodeId, name);
      }
    };
  };

  async function browse(box, nodeId, name) {
    let page;
    try {
      page = await runOperation("browse", { node: nodeId, queue: name, limit: 50 });
    } catch (error) {
      box.replaceChildren(el("h2", {}, "Messages"), el("p", { class: "error" }, error.message));
      return;
    }
    const rows = page.messages.map((m) => el("tr", {},
      el("td", { class: "mono" }, el("a", { href: `#/audit/${q(m.audit_id)}`, title: "audit trail" }, m.audit_id)),
      el("td", {}, m.state), el("td", { class: "num" }, m.delivery_count), el("td", {}, m.address),
      el("td", {}, when(m.timestamp_ms)), el("td", { class: "num" }, num(m.size)),
      el("td", { class: "props" }, Object.entries(m.properties || {}).map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(", ")),
      el("td", { class: "body" }, m.body_encoding === "utf-8" ? m.body : `(base64) ${m.body}`, m.body_truncated ? " …" : "")));
    box.replaceChildren(el("h2", {}, `Messages (${num(page.total)}, the first ${page.messages.length} shown)`),
      el("table", { class: "grid", id: "messages" }, el("thead", {}, el("tr", {}, ["Audit id", "State", "Deliveries", "Address", "Sent", "Bytes", "Properties", "Body"].map((h) => el("th", {}, h)))),
        el("tbody", {}, rows.length ? rows : el("tr", {}, el("td", { colspan: 8, class: "empty" }, "no messages")))));
  }

  function fillOperations(box, nodeId, name) {
    const scope = el("select", { id: "op-scope", "aria-label": "where" },
      el("option", { value: "node" }, `on ${nodeName(nodeId)} only`), el("option", { value: "cluster" }, "on every node"));
    const selector = el("input", { id: "op-selector", placeholder: "selector (optional), e.g. priority > 4" });
    const target = el("input", { id: "op-target", placeholder: "target queue (empty: back to where each came from)" });
    const common = () => ({
      ...(scope.value === "node" ? { node: nodeId } : {}),
      ...(selector.value.trim() ? { selector: selector.value.trim() } : {}),
    });
    const act = (id, label, op, params, confirmText, kind = "") => el("button", { id, class: kind, type: "button", onclick: async () => {
      const extra = params();
      if (extra === null) return;
      if (confirmText && !confirm(confirmText)) return;
      try {
        const done = await runOperation(op, { queue: name, ...common(), ...extra });
        toast(`${label}: ${outcome(done)}`);
        await refreshNow(true);
      } catch (error) {
        toast(`${label}: ${error.message}`, "bad");
      }
    } }, label);
    const withTarget = (required) => () => {
      const to = target.value.trim();
      if (required && !to) {
        toast("give the target queue", "bad");
        return null;
      }
      return to ? { target: to } : {};
    };
    box.append(el("h2", {}, "Operations"),
      el("div", { class: "toolbar" }, scope, selector, target),
      el("div", { class: "toolbar" },
        act("op-purge", "Purge", "purge", () => ({}), `Drop the queued, scheduled and delayed messages of ${name} (those the selector picks)?`, "danger"),
        act("op-move", "Move", "move", withTarget(false)),
        act("op-copy", "Copy", "copy", withTarget(true)),
        act("op-pause", "Pause", "pause", () => ({})),
        act("op-resume", "Resume", "resume", () => ({})),
        act("op-delete", "Delete queue", "delete-queue", () => ({}), `Delete the queue ${name} and its messages?`, "danger")),
      el("p", { class: "hint" }, "Move without a target sends each message back to the queue it was dead-lettered or expired from (a DLQ back to its origin)."));
  }

  pages.mqtt = async (root) => {
    const sessions = sortableTable("mqtt-sessions", [
      { key: "client_id", label: "Client id", value: (r) => r.client_id ?? r.label, render: (r) => (r.client_id != null ? r.client_id : el("span", { title: "The id holds characters a queue name cannot show: this is its label" }, `${r.label} (label)`)) },
      { key: "node", label: "Node" },
      { key: "connected", label: "Connected", render: (r) => badge(r.connected ? "connected" : "offline", r.connected ? "good" : "info") },
      { key: "persistent", label: "Persistent", render: (r) => (r.persistent ? "yes" : "no") }, { key: "user", label: "User" },
      { key: "subscriptions", label: "Subscriptions", value: (r) => (r.subscriptions || []).join(" "), render: (r) => (r.subscriptions || []).join(", ") || "–" },
      { key: "queued", label: "Queued", numeric: true },
      // A session whose id no queue name shows (client_id null) is deleted with its exact id (the CLI): the
      // button sent "null", and deleted the session of a client named so.
      { key: "delete", label: "", render: (r) => (r.client_id == null
        ? el("button", { class: "small danger", disabled: true, title: "Its exact client id is not shown here: tridentmq mqtt session-delete CLIENT_ID" }, "Delete")
        : el("button", { class: "small danger", onclick: () => act(`Delete the session of ${r.client_id}?`, "delete-mqtt-session", { client_id: r.client_id }) }, "Delete")) },
    ]);
    const retained = sortableTable("mqtt-retained", [
      { key: "topic", label: "Topic" }, { key: "size", label: "Bytes", numeric: true },
      { key: "timestamp_ms", label: "Set", render: (r) => when(r.timestamp_ms) },
      { key: "body", label: "Payload", render: (r) => el("span", { class: "mono" }, r.body_encoding === "utf-8" ? r.body : `(base64) ${r.body}`, r.body_truncated ? " …" : "") },
      { key: "delete", label: "", render: (r) => el("button", { class: "small danger", onclick: () => act(`Clear the retained message of ${r.topic}?`, "delete-retained", { topic: r.topic }) }, "Clear") },
    ]);
    async function act(question, op, params) {
      if (!confirm(question)) return;
      try {
        toast(outcome(await runOperation(op, params)));
        await refreshNow();
      } catch (error) {
        toast(error.message, "bad");
      }
    }
    root.append(el("h1", {}, "MQTT"), el("h2", {}, "Sessions"), sessions.table, el("h2", {}, "Retained messages"), retained.table);
    return async () => {
      if (!state.nodes.length) await loadNodes();
      const [s, r] = await Promise.all([runOperation("mqtt-sessions", {}), runOperation("retained", {})]);
      sessions.set((s.sessions || []).map((x) => ({ ...x, node: nodeName(x.node_id) })));
      retained.set(r.retained || []);
    };
  };

  pages.settings = async (root) => {
    const entries = el("section", { id: "settings-entries" });
    const address = el("input", { id: "settings-address", placeholder: "an address, to see what applies to it" });
    const resolved = el("pre", { id: "settings-resolved", class: "panel mono" });
    const match = el("input", { id: "settings-match", placeholder: "match, e.g. orders.# (an entry is replaced whole)" });
    const values = el("textarea", { id: "settings-values", rows: 5, placeholder: '{"max_delivery_attempts": 3, "dead_letter_address": "DLQ"}' });
    const show = async () => {
      const answer = await runOperation("address-settings", { address: address.value.trim() });
      entries.replaceChildren(el("table", { class: "grid" }, el("thead", {}, el("tr", {}, el("th", {}, "Match"), el("th", {}, "Settings"))),
        el("tbody", {}, (answer.entries || []).map((e) => el("tr", {}, el("td", { class: "mono" }, e.match),
          el("td", { class: "props" }, Object.entries(e).filter(([k, v]) => k !== "match" && v !== null).map(([k, v]) => `${k}=${v}`).join(", ")))))));
      resolved.textContent = answer.resolved ? `${answer.address}:\n${JSON.stringify(answer.resolved, null, 2)}` : "";
      resolved.hidden = !answer.resolved;
    };
    root.append(el("h1", {}, "Address settings"), el("h2", {}, "Entries"), entries,
      el("form", { class: "toolbar", onsubmit: (event) => { event.preventDefault(); show().catch((e) => toast(e.message, "bad")); } },
        address, el("button", { type: "submit" }, "Resolve")), resolved,
      el("form", { class: "panel", onsubmit: async (event) => {
        event.preventDefault();
        let settings;
        try {
          settings = JSON.parse(values.value || "{}");
        } catch {
          toast("the settings are not JSON", "bad");
          return;
        }
        try {
          toast(`changed: ${outcome(await runOperation("set-address-settings", { match: match.value.trim(), settings }))}`);
          await show();
        } catch (error) {
          toast(error.message, "bad");
        }
      } }, el("h2", {}, "Change an entry (every node, at once)"), match, values, el("button", { type: "submit" }, "Apply")));
    resolved.hidden = true;
    await show();
    return null;
  };

  pages.charts = async (root) => {
    const rates = el("div", { class: "chart", id: "chart-rates" });
    const depth = el("div", { class: "chart", id: "chart-depth" });
    const perNode = el("div", { class: "chart", id: "chart-nodes" });
    const latency = el("div", { class: "chart", id: "chart-latency" });
    root.append(el("h1", {}, "Charts"), el("p", { class: "hint" }, `Sampled every ${POLL_MS / 1000} s while the console is open (the last ${HISTORY_POINTS * POLL_MS / 60000} minutes).`),
      el("h2", {}, "Messages per second, whole cluster"), rates, el("h2", {}, "Messages queued and in flight"), depth,
      el("h2", {}, "Messages routed per second, per node"), perNode,
      el("h2", {}, "End-to-end latency per node, ms (publish to acknowledgement, p50 solid, p99 dashed)"), latency);
    const charts = [];
    const width = () => Math.max(400, root.clientWidth - 40);
    const make = (target, series, data, scales = {}) => {
      const clock = (u, ticks) => ticks.map((t) => new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" }));
      const chart = new uPlot({ width: width(), height: 220, series: [{}, ...series], axes: [{ space: 90, values: clock }, { size: 60 }],
        scales, legend: { live: false } }, data, target);
      charts.push(chart);
      return chart;
    };
    const colours = ["#2563eb", "#16a34a", "#dc2626", "#9333ea", "#ea580c", "#0891b2"];
    let nodeChart = null;
    let nodeIds = "";
    let latencyChart = null;
    let latencyIds = "";
    const latencyData = (ids) => [h.t, ...ids.flatMap((id) => [h.latency[id].p50, h.latency[id].p99])];
    await loadNodes();
    const h = state.history;
    const rateChart = make(rates, [{ label: "routed/s", stroke: colours[0], width: 2 }, { label: "acked/s", stroke: colours[1], width: 2 },
      { label: "dead-lettered/s", stroke: colours[2], width: 2 }], [h.t, h.routed, h.acked, h.deadLettered]);
    const depthChart = make(depth, [{ label: "queued", stroke: colours[3], width: 2 }, { label: "in flight", stroke: colours[4], width: 2 }],
      [h.t, h.depth, h.inFlight]);
    return async () => {
      await loadNodes();
      rateChart.setData([h.t, h.routed, h.acked, h.deadLettered]);
      rates.dataset.routed = String(h.routedSince);
      rates.dataset.samples = String(h.t.length);
      depthChart.setData([h.t, h.depth, h.inFlight]);
      const ids = Object.keys(h.perNode);
      if (ids.join() !== nodeIds) {
        nodeIds = ids.join();
        if (nodeChart) nodeChart.destroy();
        perNode.replaceChildren();
        nodeChart = make(perNode, ids.map((id, i) => ({ label: nodeName(id), stroke: colours[i % colours.length], width: 2 })),
          [h.t, ...ids.map((id) => h.perNode[id])]);
      } else if (nodeChart) {
        nodeChart.setData([h.t, ...ids.map((id) => h.perNode[id])]);
      }
      const timed = Object.keys(h.latency);
      latency.dataset.timed = String(h.timedSince);
      if (timed.join() !== latencyIds) {
        latencyIds = timed.join();
        if (latencyChart) latencyChart.destroy();
        latency.replaceChildren();
        latencyChart = make(latency, timed.flatMap((id, i) => [
          { label: `${nodeName(id)} p50`, stroke: colours[i % colours.length], width: 2 },
          { label: `${nodeName(id)} p99`, stroke: colours[i % colours.length], width: 2, dash: [6, 4] },
        ]), latencyData(timed), { y: { range: (u, min, max) => [0, Math.max(1, max) * 1.1] } });
      } else if (latencyChart) {
        latencyChart.setData(latencyData(timed));
      }
    };
  };

  pages.audit = async (root, [messageId]) => {
    const input = el("input", { id: "audit-id", placeholder: "message id, e.g. 1d509e2d-1882530528365641734", value: messageId || "" });
    const result = el("section", { id: "audit-result" });
    root.append(el("h1", {}, "Audit trail of a message"),
      el("p", { class: "hint" }, "Every event of the message that the nodes' audit streams hold, across nodes (forwards, redistributions, dead-letter copies)."),
      el("form", { class: "toolbar", onsubmit: (event) => {
        event.preventDefault();
        location.hash = `#/audit/${q(input.value.trim())}`;
      } }, input, el("button", { type: "submit" }, "Show")), result);
    if (!messageId) return null;
    await loadNodes();
    const answers = await Promise.all(state.nodes.filter((n) => n.status).map(async (n) => {
      try {
        return await nodeApi(n.member.node_id, `audit/messages/${q(messageId)}`);
      } catch (error) {
        return { events: [], complete: true, error: `${n.member.name}: ${error.message}` };
      }
    }));
    const seen = new Set();
    const events = answers.flatMap((a) => a.events).filter((e) => {
      const key = `${e.node_id}/${e.seq}`;
      return seen.has(key) ? false : (seen.add(key), true);
    }).sort((a, b) => a.ts_us - b.ts_us || a.seq - b.seq);
    const header = ["v", "node_id", "seq", "ts_us", "event", "epoch", "message_id", "queue", "address"];
    const rows = events.map((e) => el("tr", { "data-event": e.event },
      el("td", { class: "mono" }, new Date(e.ts_us / 1000).toISOString().replace("T", " ").replace("Z", "")),
      el("td", {}, nodeName(e.node_id)), el("td", { class: "num" }, e.seq), el("td", {}, e.epoch),
      el("td", {}, el("strong", {}, e.event)), el("td", {}, e.queue || "–"), el("td", {}, e.address || "–"),
      el("td", { class: "props" }, Object.entries(e).filter(([k]) => !header.includes(k)).map(([k, v]) => `${k}=${v}`).join(", "))));
    const problems = answers.filter((a) => a.error).map((a) => el("p", { class: "error" }, a.error));
    const partial = answers.some((a) => !a.complete) ? el("p", { class: "hint" }, "Some audit files were too old or too large to search; older events may be missing.") : null;
    result.replaceChildren(...problems, ...(partial ? [partial] : []),
      el("table", { class: "grid", id: "audit-events" }, el("thead", {}, el("tr", {}, ["Time (UTC)", "Node", "Seq", "Epoch", "Event", "Queue", "Address", "Details"].map((t) => el("th", {}, t)))),
        el("tbody", {}, rows.length ? rows : el("tr", {}, el("td", { colspan: 8, class: "empty" }, "no event of this message was found")))));
    return null;
  };

  // ------------------------------------------------------------------ operations (routes of the management API)
  // Each operation the console offers and its call (docs/management.md, "Operations"). ``node`` limits one to
  // that node; without it, the node asked runs it on every live member of the cluster.
  const where = (p) => (p.node ? `?node=${q(p.node)}` : "");
  const OPERATIONS = {
    "create-queue": { method: "POST", path: () => "/api/queues", body: (p) => ({ name: p.name, address: p.address, routing_type: p.routing_type, durable: p.durable }) },
    "delete-queue": { method: "DELETE", path: (p) => `/api/queues/${q(p.queue)}${where(p)}` },
    browse: { method: "GET", path: (p) => `/api/messages?queue=${q(p.queue)}&limit=${p.limit || 50}${p.node ? `&node=${q(p.node)}` : ""}` },
    purge: { method: "POST", path: where, body: (p) => ({ queue: p.queue, selector: p.selector }), url: "/api/purge" },
    move: { method: "POST", path: where, body: (p) => ({ queue: p.queue, to: p.target, selector: p.selector }), url: "/api/move" },
    copy: { method: "POST", path: where, body: (p) => ({ queue: p.queue, to: p.target, selector: p.selector }), url: "/api/copy" },
    pause: { method: "POST", path: where, body: (p) => ({ queue: p.queue }), url: "/api/pause" },
    resume: { method: "POST", path: where, body: (p) => ({ queue: p.queue }), url: "/api/resume" },
    "close-connection": { method: "DELETE", path: (p) => `/api/connections/${q(p.client)}${where(p)}` },
    "mqtt-sessions": { method: "GET", path: () => "/api/mqtt/sessions" },
    "delete-mqtt-session": { method: "DELETE", path: (p) => `/api/mqtt/sessions/${q(p.client_id)}` },
    retained: { method: "GET", path: () => "/api/mqtt/retained?limit=500" },
    "delete-retained": { method: "DELETE", path: (p) => `/api/mqtt/retained/${q(p.topic)}` },
    failback: { method: "POST", path: where, body: () => ({}), url: "/api/failback" },
    "scale-down": { method: "POST", path: where, body: () => ({}), url: "/api/scale-down" },
    "address-settings": { method: "GET", path: (p) => `/api/address-settings${p.address ? `?address=${q(p.address)}` : ""}` },
    "set-address-settings": { method: "PUT", path: () => "/api/address-settings", body: (p) => ({ match: p.match, settings: p.settings }) },
  };

  const operation = (name) => Object.prototype.hasOwnProperty.call(OPERATIONS, name);

  async function runOperation(name, params) {
    const spec = OPERATIONS[name];
    const path = (spec.url || "") + spec.path(params);
    const body = spec.body ? JSON.parse(JSON.stringify(spec.body(params))) : undefined; // drops undefined fields
    return api(path, { method: spec.method, body });
  }

  // A summary of an operation's answer: its counts, and the nodes that refused it.
  function outcome(answer) {
    const counts = Object.entries(answer || {}).filter(([k, v]) => k !== "nodes" && typeof v === "number").map(([k, v]) => `${k} ${v}`);
    const refused = ((answer && answer.nodes) || []).filter((n) => n.status !== 200).map((n) => `${n.name || shortId(n.node_id)}: ${n.error}`);
    return [counts.join(", ") || "done", ...refused].join("; ");
  }

  // ------------------------------------------------------------------ routing, polling, login
  let current = { refresh: null, token: 0 };
  let timer = null;

  let refreshing = false;
  let updatedAt = null;

  // A page whose last refresh failed says so, with the time of its last good one: what it shows may be stale.
  function showStale(message) {
    const banner = $("#stale");
    banner.hidden = message === null;
    banner.textContent = message === null ? "" : `Not updated since ${updatedAt ? updatedAt.toLocaleTimeString() : "the page opened"}: ${message}`;
    banner.title = banner.textContent;
    $("#page").classList.toggle("stale", message !== null);
  }

  async function refreshNow(force = false) {
    const { refresh, token } = current;
    if (!refresh || (refreshing && force !== true)) return; // one poll at a time: an unanswered one does not pile up
    refreshing = true;
    try {
      await refresh(force === true);
      if (token === current.token) {
        updatedAt = new Date();
        showStale(null);
      }
    } catch (error) {
      if (token === current.token && !(error instanceof ApiError && error.status === 401)) showStale(error.message);
    } finally {
      refreshing = false;
    }
  }

  async function route() {
    if (!sessionStorage.getItem(AUTH_KEY) && !state.open) return showLogin();
    const parts = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
    const name = pages[parts[0]] ? parts[0] : "cluster";
    for (const link of document.querySelectorAll("#nav a")) link.classList.toggle("active", link.dataset.page === (name === "queue" ? "queues" : name));
    const root = $("#page");
    root.replaceChildren();
    root.dataset.page = name;
    const token = current.token + 1;
    current = { refresh: null, token };
    try {
      const refresh = await pages[name](root, parts.slice(1));
      if (token !== current.token) return;
      current.refresh = refresh || null;
      await refreshNow();
      root.dataset.ready = "1";
    } catch (error) {
      if (!(error instanceof ApiError && error.status === 401)) root.append(el("p", { class: "error" }, error.message));
    }
  }

  function startPolling() {
    clearInterval(timer);
    timer = setInterval(refreshNow, POLL_MS);
  }

  function showLogin(message) {
    clearInterval(timer);
    $("#top").hidden = true;
    $("#page").hidden = true;
    $("#login").hidden = false;
    $("#login-error").textContent = message || "";
    $("#login-user").focus();
  }

  function loggedOut(message) {
    sessionStorage.removeItem(AUTH_KEY);
    showLogin(message);
  }

  async function showConsole(who) {
    $("#login").hidden = true;
    $("#top").hidden = false;
    $("#page").hidden = false;
    $("#whoami").textContent = who;
    startPolling();
    await route();
  }

  async function start() {
    $("#login-form").addEventListener("submit", async (event) => {
      event.preventDefault();
      const user = $("#login-user").value;
      const credentials = encodeCredentials(user, $("#login-password").value);
      $("#login-error").textContent = "";
      try {
        await api("/api/status", {}, credentials);
      } catch (error) {
        $("#login-error").textContent = error.status === 401 ? "Unknown user or wrong password." : error.message;
        return;
      }
      sessionStorage.setItem(AUTH_KEY, credentials);
      sessionStorage.setItem(`${AUTH_KEY}.user`, user);
      $("#login-password").value = "";
      await showConsole(user);
    });
    $("#logout").addEventListener("click", () => {
      sessionStorage.removeItem(AUTH_KEY);
      sessionStorage.removeItem(`${AUTH_KEY}.user`);
      state.open = false;
      showLogin("Logged out.");
    });
    window.addEventListener("hashchange", route);
    if (sessionStorage.getItem(AUTH_KEY)) return showConsole(sessionStorage.getItem(`${AUTH_KEY}.user`) || "");
    try { // a node without users answers loopback clients without credentials
      await api("/api/status", {}, null);
      state.open = true;
      return showConsole("(no users configured)");
    } catch {
      return showLogin();
    }
  }

  document.addEventListener("DOMContentLoaded", start);
})();
