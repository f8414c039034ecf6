/* Draws a walk from the Mermaid text GET /v1/graphs/{model} returns: nodes in layers by longest path, SVG. */
"use strict";
const Walks = (() => {
  const NODE = /^\s*([A-Za-z0-9_]+)(\(\[|\[|\(|\{)"(.*)"(\]\)|\]|\)|\})\s*$/;
  const GROUP = /^\s*subgraph\s+(\S+)\["(.*)"\]\s*$/;
  const EDGE = /^\s*(\S+)\s+(--|-\.|==)\s+"(.*)"\s+(-->|\.->|==>)\s+(\S+)\s*$/;
  const BARE = /^\s*(\S+)\s+(-->|-\.->|==>)\s+(\S+)\s*$/;

  function parse(text) {
    const nodes = new Map(), edges = [], groups = [];
    for (const line of text.split("\n")) {
      let m;
      if ((m = GROUP.exec(line))) { groups.push(m[2]); continue; }
      if (/^\s*end\s*$/.test(line)) { groups.pop(); continue; }
      if ((m = EDGE.exec(line))) { edges.push({ from: m[1], to: m[5], label: m[3], kind: m[2] }); continue; }
      if ((m = BARE.exec(line))) { edges.push({ from: m[1], to: m[3], label: "", kind: m[2].slice(0, 2) }); continue; }
      if ((m = NODE.exec(line))) {
        const inner = groups.filter((g) => !g.startsWith("walk:"));
        nodes.set(m[1], { id: m[1], label: m[3], input: m[2] === "([", group: inner[inner.length - 1] || "" });
      }
    }
    for (const e of edges) for (const id of [e.from, e.to]) if (!nodes.has(id)) nodes.set(id, { id, label: id, group: "" });
    return { nodes, edges };
  }

  function layers({ nodes, edges }) {
    // forward edges only: a DFS drops the ones closing a cycle (loop feedback), then longest path from the inputs
    const out = new Map([...nodes.keys()].map((k) => [k, []]));
    edges.forEach((e) => e.from !== e.to && out.get(e.from).push(e));
    const seen = new Set(), onStack = new Set(), forward = [];
    const visit = (id) => {
      seen.add(id); onStack.add(id);
      for (const e of out.get(id)) {
        if (onStack.has(e.to)) continue;
        forward.push(e);
        if (!seen.has(e.to)) visit(e.to);
      }
      onStack.delete(id);
    };
    [...nodes.keys()].forEach((id) => seen.has(id) || visit(id));
    const depth = new Map([...nodes.keys()].map((k) => [k, 0]));
    for (let pass = 0; pass < nodes.size; pass++) {
      let changed = false;
      for (const e of forward) if (depth.get(e.to) < depth.get(e.from) + 1) { depth.set(e.to, depth.get(e.from) + 1); changed = true; }
      if (!changed) break;
    }
    return depth;
  }

  function el(name, attrs, text) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", name);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function draw(text) {
    const graph = parse(text), depth = layers(graph);
    const rows = new Map();
    for (const [id, d] of depth) { if (!rows.has(d)) rows.set(d, []); rows.get(d).push(id); }
    const W = 190, H = 46, GX = 40, GY = 70, PER_ROW = 6, pos = new Map();
    let width = 0, line = 0;
    [...rows.keys()].sort((a, b) => a - b).forEach((d) => {
      const ids = rows.get(d);  // a wide layer (a walk's many inputs) wraps onto several lines
      ids.forEach((id, i) => pos.set(id, { x: 20 + (i % PER_ROW) * (W + GX), y: 20 + (line + Math.floor(i / PER_ROW)) * (H + GY) }));
      line += Math.ceil(ids.length / PER_ROW);
      width = Math.max(width, 20 + Math.min(ids.length, PER_ROW) * (W + GX));
    });
    const height = 40 + line * (H + GY);
    const svg = el("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img" });
    const defs = el("defs", {});
    const marker = el("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto" });
    marker.appendChild(el("path", { d: "M0,0 L10,5 L0,10 z", fill: "#556" }));
    defs.appendChild(marker); svg.appendChild(defs);
    for (const e of graph.edges) {
      const a = pos.get(e.from), b = pos.get(e.to);
      const style = { stroke: "#556", fill: "none", "marker-end": "url(#arrow)", "stroke-width": e.kind === "==" ? 3 : 1.4 };
      if (e.kind === "-.") style["stroke-dasharray"] = "5 4";
      let path, lx, ly;
      if (e.from === e.to) {  // a loop's feedback: an arc on the node's right side
        path = `M${a.x + W},${a.y + 12} C${a.x + W + 45},${a.y - 10} ${a.x + W + 45},${a.y + H + 10} ${a.x + W},${a.y + H - 12}`;
        lx = a.x + W + 20; ly = a.y - 6;
      } else {
        const x1 = a.x + W / 2, y1 = a.y + H, x2 = b.x + W / 2, y2 = b.y;
        path = y2 > y1 ? `M${x1},${y1} C${x1},${y1 + 35} ${x2},${y2 - 35} ${x2},${y2}`
                       : `M${a.x + W},${a.y + H / 2} C${a.x + W + 60},${a.y + H / 2} ${b.x + W + 60},${b.y + H / 2} ${b.x + W},${b.y + H / 2}`;
        lx = (x1 + x2) / 2 + 4; ly = (y1 + y2) / 2;
      }
      svg.appendChild(el("path", { d: path, ...style }));
      if (e.label) svg.appendChild(el("text", { x: lx, y: ly, "font-size": 10, fill: "#334" }, e.label.slice(0, 48)));
    }
    for (const [id, n] of graph.nodes) {
      const p = pos.get(id);
      svg.appendChild(el("rect", { x: p.x, y: p.y, width: W, height: H, rx: n.input ? 22 : 6,
                                   fill: n.input ? "#eef3ff" : "#fff", stroke: "#3857d6" }));
      svg.appendChild(el("text", { x: p.x + 8, y: p.y + 19, "font-size": 12, fill: "#1d2330" }, n.label.slice(0, 30)));
      if (n.group) svg.appendChild(el("text", { x: p.x + 8, y: p.y + 36, "font-size": 10, fill: "#667" }, n.group.slice(0, 34)));
    }
    return svg;
  }

  return { parse, draw };
})();
