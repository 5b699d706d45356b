// The splice planner (see planner.h for the rules and docs/cuda_graphs.md for the design).
#include "planner.h"

#include <algorithm>
#include <map>
#include <queue>
#include <set>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

namespace xmix::graph {

const char* role_name(Role r) {
  switch (r) {
    case Role::Foreign: return "foreign";
    case Role::Anchor: return "anchor";
    case Role::Op: return "op";
    case Role::Gate: return "gate";
    case Role::If: return "if";
    case Role::CustomSelect: return "sel";
    case Role::CustomUser: return "user";
    case Role::CustomFinish: return "fin";
  }
  return "?";
}

const char* type_name(NodeType t) {
  switch (t) {
    case NodeType::Kernel: return "kernel";
    case NodeType::Memcpy: return "memcpy";
    case NodeType::Memset: return "memset";
    case NodeType::Host: return "host";
    case NodeType::Child: return "child";
    case NodeType::Empty: return "empty";
    case NodeType::EventWait: return "event_wait";
    case NodeType::EventRecord: return "event_record";
    case NodeType::SemSignal: return "sem_signal";
    case NodeType::SemWait: return "sem_wait";
    case NodeType::MemAlloc: return "mem_alloc";
    case NodeType::MemFree: return "mem_free";
    case NodeType::Conditional: return "conditional";
    case NodeType::Unknown: return "unknown";
  }
  return "?";
}

const Node* Graph::find(int32_t id) const {
  for (const Node& n : nodes)
    if (n.id == id) return &n;
  return nullptr;
}

Node* Graph::find(int32_t id) {
  for (Node& n : nodes)
    if (n.id == id) return &n;
  return nullptr;
}

int32_t Graph::next_id() const {
  int32_t m = -1;
  for (const Node& n : nodes) m = std::max(m, n.id);
  return m + 1;
}

namespace {

bool is_ours(Role r) { return r != Role::Foreign && r != Role::Anchor; }

// Every node id a segment uses, top-level and body.
std::vector<int32_t> segment_nodes(const Segment& s) {
  std::vector<int32_t> v;
  for (int32_t id : {s.gate, s.cond, s.op, s.sel, s.user, s.fin})
    if (id != -1) v.push_back(id);
  return v;
}

// The nodes whose exec state switches the segment on and off. A gated op is switched by its
// gate alone: with the gate disabled the IF keeps its default (0) and skips its body, and
// nodes inside conditional bodies are never toggled (not every driver supports it).
std::vector<int32_t> switch_nodes(const Segment& s) {
  if (s.gated) return {s.gate};
  if (s.custom) return {s.sel, s.user, s.fin};
  return {s.op};
}

bool same_shape(const std::vector<Segment>& have, const std::vector<Segment>& want) {
  if (have.size() != want.size()) return false;
  for (size_t i = 0; i < have.size(); ++i)
    if (have[i].gated != want[i].gated || have[i].custom != want[i].custom) return false;
  return true;
}

// The anchor's order: built-in ops in site order, then custom ops in site order.
std::vector<Segment> desired(const std::vector<const OpSpec*>& ops, bool use_conditionals) {
  std::vector<const OpSpec*> v = ops;
  std::stable_sort(v.begin(), v.end(), [](const OpSpec* a, const OpSpec* b) {
    if (a->custom != b->custom) return !a->custom;
    return a->op_index < b->op_index;
  });
  std::vector<Segment> out;
  out.reserve(v.size());
  for (const OpSpec* o : v) {
    Segment s;
    s.site = o->site;
    s.op_index = o->op_index;
    s.app = o->app;
    s.gated = o->gated && use_conditionals;
    s.custom = o->custom;
    s.enabled = o->enabled;
    s.custom_args = o->custom_args;
    out.push_back(s);
  }
  return out;
}

struct Adj {
  std::vector<std::pair<int32_t, EdgeData>> in, out;
};

}  // namespace

Plan fallback_plan(const Graph& g, const std::string& reason) {
  Plan out;
  out.fallback = true;
  out.reason = reason;
  std::unordered_map<int32_t, const Node*> by_id;
  for (const Node& n : g.nodes) by_id.emplace(n.id, &n);
  std::set<int32_t> remove;
  for (const Splice& sp : g.splices)
    for (const Segment& s : sp.segments)
      for (int32_t id : segment_nodes(s)) {
        auto it = by_id.find(id);
        if (it != by_id.end() && it->second->parent == -1) remove.insert(id);
      }
  out.remove.assign(remove.begin(), remove.end());
  for (const Node& n : g.nodes)
    if (n.role == Role::Anchor) {
      out.enable.push_back({n.id, true});
      ++out.n_anchors;
    }
  out.needs_instantiate = !out.remove.empty();
  return out;
}

std::vector<Toggle> anchor_config(const Graph& g) {
  std::unordered_map<int32_t, const Node*> by_id;
  for (const Node& n : g.nodes) by_id.emplace(n.id, &n);
  std::vector<Toggle> out;
  for (const Node& n : g.nodes)
    if (n.role == Role::Anchor && n.parent == -1) out.push_back({n.id, true});
  for (const Splice& sp : g.splices)
    for (const Segment& s : sp.segments)
      for (int32_t id : switch_nodes(s)) {
        auto it = by_id.find(id);
        if (it == by_id.end() || it->second->parent != -1) continue;
        // built-in ops: the anchor runs them; user kernels: only their nodes can
        out.push_back({id, s.custom ? it->second->enabled : false});
      }
  return out;
}

Plan plan(const Graph& g, const Program& p) {
  // ---- the program (a bad program is a caller bug, not a graph the planner can't handle)
  std::map<int32_t, std::vector<const OpSpec*>> by_site;
  {
    std::set<std::pair<int32_t, int32_t>> seen;
    for (const OpSpec& op : p.ops) {
      if (op.site < 0 || op.site >= p.n_sites)
        throw std::invalid_argument("xmix graph program: op at site " + std::to_string(op.site) +
                                    " outside [0, " + std::to_string(p.n_sites) + ")");
      if (op.op_index < 0) throw std::invalid_argument("xmix graph program: negative op index");
      if (!seen.insert({op.site, op.op_index}).second)
        throw std::invalid_argument("xmix graph program: op (" + std::to_string(op.site) + ", " +
                                    std::to_string(op.op_index) + ") listed twice");
      by_site[op.site].push_back(&op);
    }
  }

  // ---- the graph
  std::unordered_map<int32_t, size_t> pos;  // id -> index in g.nodes (topological tie-break)
  for (size_t i = 0; i < g.nodes.size(); ++i)
    if (!pos.emplace(g.nodes[i].id, i).second)
      return fallback_plan(
          g, "malformed graph: node id " + std::to_string(g.nodes[i].id) + " appears twice");
  for (const Edge& e : g.edges)
    if (!pos.count(e.from) || !pos.count(e.to))
      return fallback_plan(g, "malformed graph: an edge names an unknown node");

  // The runtime cannot remove dependencies in a graph with memory alloc/free nodes, so a
  // splice there could never be taken out again.
  for (const Node& n : g.nodes)
    if (n.type == NodeType::MemAlloc || n.type == NodeType::MemFree)
      return fallback_plan(g,
                           "the graph has memory alloc/free nodes (spliced nodes could not be "
                           "removed again)");

  std::vector<int32_t> anchors;
  for (const Node& n : g.nodes) {
    if (n.role != Role::Anchor) continue;
    const AnchorArgs& a = n.anchor;
    const std::string at = "anchor node " + std::to_string(n.id);
    if (n.parent != -1) return fallback_plan(g, at + " sits inside a conditional body");
    if (!a.ok) return fallback_plan(g, at + ": kernel arguments could not be read");
    if (a.cb != p.cb) return fallback_plan(g, at + " belongs to another control block");
    if (a.site < 0 || a.site >= p.n_sites)
      return fallback_plan(g, at + ": site " + std::to_string(a.site) + " out of range");
    if (a.grid_x == 0 || a.grid_y != 1 || a.grid_z != 1 || a.block_x != p.threads ||
        a.block_y != 1 || a.block_z != 1)
      return fallback_plan(g, at + ": unexpected launch shape");
    anchors.push_back(n.id);
  }
  if (p.expected_anchors >= 0 && static_cast<int32_t>(anchors.size()) != p.expected_anchors)
    return fallback_plan(g, "found " + std::to_string(anchors.size()) + " anchors but " +
                                std::to_string(p.expected_anchors) +
                                " were captured (anchors inside nested graphs?)");

  // ---- what was spliced before
  std::unordered_set<int32_t> anchor_set(anchors.begin(), anchors.end());
  std::unordered_map<int32_t, const Splice*> have;
  std::unordered_set<int32_t> booked;
  std::vector<const Splice*> stale;
  for (const Splice& sp : g.splices) {
    for (const Segment& s : sp.segments)
      for (int32_t id : segment_nodes(s)) {
        if (!pos.count(id))
          return fallback_plan(g, "splice bookkeeping names node " + std::to_string(id) +
                                      " which is not in the graph");
        booked.insert(id);
      }
    if (!anchor_set.count(sp.anchor)) {
      stale.push_back(&sp);
    } else if (!have.emplace(sp.anchor, &sp).second) {
      return fallback_plan(g, "two splices for anchor " + std::to_string(sp.anchor));
    }
  }
  for (const Node& n : g.nodes)
    if (is_ours(n.role) && !booked.count(n.id))
      return fallback_plan(g, std::string("an xmix ") + role_name(n.role) + " node (" +
                                  std::to_string(n.id) + ") was captured outside the patcher");

  for (const OpSpec& op : p.ops)
    if (op.custom && op.custom_args.kernel == 0 && by_site.count(op.site))
      for (int32_t a : anchors)
        if (g.nodes[pos[a]].anchor.site == op.site)
          return fallback_plan(g, "custom op (" + std::to_string(op.site) + ", " +
                                      std::to_string(op.op_index) + ") has no CUDA kernel");

  Plan out;
  out.n_anchors = static_cast<int32_t>(anchors.size());
  std::set<int32_t> removed;  // top-level nodes
  auto remove_splice = [&](const Splice& sp) {
    for (const Segment& s : sp.segments)
      for (int32_t id : segment_nodes(s))
        if (g.nodes[pos[id]].parent == -1) removed.insert(id);
  };

  static const std::vector<const OpSpec*> kNone;
  std::map<int32_t, std::vector<Segment>> want;
  std::unordered_set<int32_t> rebuild;
  for (int32_t a : anchors) {
    const int32_t site = g.nodes[pos[a]].anchor.site;
    auto bs = by_site.find(site);
    std::vector<Segment> w = desired(bs == by_site.end() ? kNone : bs->second, p.use_conditionals);
    auto h = have.find(a);
    if (h != have.end() && same_shape(h->second->segments, w)) {
      const std::vector<Segment>& old = h->second->segments;
      for (size_t i = 0; i < w.size(); ++i) {
        const Segment& o = old[i];
        Segment& s = w[i];
        s.gate = o.gate;
        s.cond = o.cond;
        s.op = o.op;
        s.sel = o.sel;
        s.user = o.user;
        s.fin = o.fin;
        const bool moved = o.site != s.site || o.op_index != s.op_index;
        const bool args = s.custom && o.custom_args != s.custom_args;
        if (moved || args) {
          out.repoint.push_back({a, static_cast<int32_t>(i)});
          if (s.gated) out.needs_instantiate = true;  // its op nodes live in an IF body
        }
      }
      ++out.n_kept;
    } else {
      if (h != have.end()) remove_splice(*h->second);
      rebuild.insert(a);
      if (!w.empty()) ++out.n_rebuilt;
    }
    want[a] = std::move(w);
  }
  for (const Splice* sp : stale) remove_splice(*sp);
  out.remove.assign(removed.begin(), removed.end());

  // ---- working graph: top-level nodes that stay, and the edges between them
  std::unordered_map<int32_t, Adj> adj;
  for (const Node& n : g.nodes)
    if (n.parent == -1 && !removed.count(n.id)) adj[n.id];
  for (const Edge& e : g.edges) {
    auto f = adj.find(e.from), t = adj.find(e.to);
    if (f == adj.end() || t == adj.end()) continue;
    f->second.out.push_back({e.to, e.data});
    t->second.in.push_back({e.from, e.data});
  }

  // Kahn's algorithm, ties broken by position in g.nodes so plans are deterministic.
  std::vector<int32_t> order;
  {
    std::unordered_map<int32_t, size_t> indeg;
    std::priority_queue<std::pair<size_t, int32_t>, std::vector<std::pair<size_t, int32_t>>,
                        std::greater<>>
        ready;
    for (auto& [id, a] : adj) {
      indeg[id] = a.in.size();
      if (a.in.empty()) ready.push({pos[id], id});
    }
    while (!ready.empty()) {
      const int32_t id = ready.top().second;
      ready.pop();
      order.push_back(id);
      for (auto& [to, d] : adj[id].out)
        if (--indeg[to] == 0) ready.push({pos[to], to});
    }
    if (order.size() != adj.size()) return fallback_plan(g, "the graph has a cycle");
  }

  auto add_node = [&](Role role, int32_t anchor, int32_t seg, int32_t body_of) {
    out.add.push_back({role, anchor, seg, body_of});
    return fresh_id(static_cast<int32_t>(out.add.size()) - 1);
  };
  std::set<std::tuple<int32_t, int32_t, uint8_t, uint8_t, uint8_t>> edge_seen;
  auto add_edge = [&](int32_t from, int32_t to, EdgeData d, bool top_level) {
    if (!edge_seen.insert({from, to, d.from_port, d.to_port, d.type}).second) return;
    out.edges.push_back({from, to, d});
    if (top_level) {
      adj[from].out.push_back({to, d});
      adj[to].in.push_back({from, d});
    }
  };

  for (int32_t a : order) {
    if (!rebuild.count(a)) continue;
    std::vector<Segment>& segs = want[a];
    if (segs.empty()) continue;
    const std::vector<std::pair<int32_t, EdgeData>> preds = adj[a].in, succs = adj[a].out;
    int32_t prev_last = -1;
    bool last_is_kernel = true;
    bool after_anchor = false;  // the first custom segment waits for the anchor too
    for (size_t i = 0; i < segs.size(); ++i) {
      Segment& s = segs[i];
      const int32_t si = static_cast<int32_t>(i);
      int32_t first, last;
      if (s.gated) {
        s.gate = add_node(Role::Gate, a, si, -1);
        s.cond = add_node(Role::If, a, si, -1);
        const int32_t body = fresh_index(s.cond);
        if (s.custom) {
          s.sel = add_node(Role::CustomSelect, a, si, body);
          s.user = add_node(Role::CustomUser, a, si, body);
          s.fin = add_node(Role::CustomFinish, a, si, body);
          add_edge(s.sel, s.user, {}, false);
          add_edge(s.user, s.fin, {}, false);
        } else {
          s.op = add_node(Role::Op, a, si, body);
        }
        add_edge(s.gate, s.cond, {}, true);
        first = s.gate;
        last = s.cond;
        last_is_kernel = false;
      } else if (s.custom) {
        s.sel = add_node(Role::CustomSelect, a, si, -1);
        s.user = add_node(Role::CustomUser, a, si, -1);
        s.fin = add_node(Role::CustomFinish, a, si, -1);
        add_edge(s.sel, s.user, {}, true);
        add_edge(s.user, s.fin, {}, true);
        first = s.sel;
        last = s.fin;
        last_is_kernel = true;
      } else {
        s.op = add_node(Role::Op, a, si, -1);
        first = last = s.op;
        last_is_kernel = true;
      }
      if (prev_last == -1) {
        std::set<int32_t> seen;
        for (auto& [from, d] : preds)
          if (seen.insert(from).second) add_edge(from, first, {}, true);
      } else {
        add_edge(prev_last, first, {}, true);
      }
      if (s.custom && !after_anchor) {
        // The anchor runs a site's built-in ops only: in the anchor configuration (the
        // first-replay check) user kernels run from their own nodes, after it, as they run
        // after the anchor kernel eagerly. Disabled, the anchor is an empty node whose
        // dependencies the chain already waits for: the edge costs nothing.
        add_edge(a, first, {}, true);
        after_anchor = true;
      }
      prev_last = last;
    }
    for (auto& [to, d] : succs) add_edge(prev_last, to, last_is_kernel ? d : EdgeData{}, true);
  }

  // ---- exec states and bookkeeping
  for (int32_t a : anchors) out.enable.push_back({a, false});
  for (int32_t a : anchors) {
    const std::vector<Segment>& segs = want[a];
    for (const Segment& s : segs)
      for (int32_t id : switch_nodes(s)) out.enable.push_back({id, s.enabled});
    if (!segs.empty()) out.splices.push_back({a, segs});
  }
  if (!out.remove.empty() || !out.add.empty()) out.needs_instantiate = true;
  return out;
}

Graph apply(const Graph& g, const Plan& p) {
  std::unordered_set<int32_t> gone(p.remove.begin(), p.remove.end());
  for (const Node& n : g.nodes)
    if (n.parent != -1 && gone.count(n.parent)) gone.insert(n.id);
  const int32_t base = g.next_id();
  auto map_id = [&](int32_t id) { return is_fresh(id) ? base + fresh_index(id) : id; };

  Graph out;
  for (const Node& n : g.nodes)
    if (!gone.count(n.id)) out.nodes.push_back(n);
  for (size_t i = 0; i < p.add.size(); ++i) {
    const NewNode& nn = p.add[i];
    Node n;
    n.id = base + static_cast<int32_t>(i);
    n.type = nn.role == Role::If ? NodeType::Conditional : NodeType::Kernel;
    n.role = nn.role;
    n.parent = nn.body_of >= 0 ? base + nn.body_of : -1;
    out.nodes.push_back(n);
  }
  for (const Edge& e : g.edges)
    if (!gone.count(e.from) && !gone.count(e.to)) out.edges.push_back(e);
  for (const NewEdge& e : p.edges) out.edges.push_back({map_id(e.from), map_id(e.to), e.data});
  for (const Splice& sp : p.splices) {
    Splice s = sp;
    s.anchor = map_id(s.anchor);
    for (Segment& seg : s.segments)
      for (int32_t* id : {&seg.gate, &seg.cond, &seg.op, &seg.sel, &seg.user, &seg.fin})
        if (*id != -1) *id = map_id(*id);
    out.splices.push_back(std::move(s));
  }
  std::unordered_map<int32_t, size_t> idx;
  for (size_t i = 0; i < out.nodes.size(); ++i) idx[out.nodes[i].id] = i;
  for (const Toggle& t : p.enable) {
    auto it = idx.find(map_id(t.node));
    if (it != idx.end()) out.nodes[it->second].enabled = t.enabled;
  }
  return out;
}

namespace {

std::unordered_map<int32_t, std::string> labels(const Graph& g) {
  std::unordered_map<int32_t, std::string> lab;
  for (const Splice& sp : g.splices)
    for (size_t i = 0; i < sp.segments.size(); ++i) {
      const Segment& s = sp.segments[i];
      const std::pair<int32_t, const char*> parts[] = {{s.gate, "gate"}, {s.cond, "if"},
                                                       {s.op, "op"},     {s.sel, "sel"},
                                                       {s.user, "user"}, {s.fin, "fin"}};
      for (auto& [id, name] : parts)
        if (id != -1)
          lab[id] = std::string(name) + "@" + std::to_string(sp.anchor) + "." + std::to_string(i);
    }
  for (const Node& n : g.nodes)
    if (!lab.count(n.id))
      lab[n.id] = is_ours(n.role)
                      ? std::string("stray-") + role_name(n.role) + "#" + std::to_string(n.id)
                      : "n" + std::to_string(n.id);
  return lab;
}

std::string edge_text(const std::string& a, const std::string& b, const EdgeData& d) {
  std::string s = a + "->" + b;
  if (!d.is_default())
    s += "[" + std::to_string(d.from_port) + "," + std::to_string(d.to_port) + "," +
         std::to_string(d.type) + "]";
  return s;
}

}  // namespace

std::vector<std::string> edge_list(const Graph& g) {
  auto lab = labels(g);
  std::vector<std::string> v;
  for (const Edge& e : g.edges) v.push_back(edge_text(lab[e.from], lab[e.to], e.data));
  std::sort(v.begin(), v.end());
  return v;
}

std::string describe(const Graph& g) {
  auto lab = labels(g);
  std::vector<std::string> nodes;
  for (const Node& n : g.nodes) {
    std::ostringstream o;
    o << lab[n.id] << " " << type_name(n.type) << " " << role_name(n.role);
    if (n.parent != -1) o << " in " << lab[n.parent];
    o << (n.enabled ? " on" : " off");
    if (n.role == Role::Anchor) o << " site " << n.anchor.site;
    nodes.push_back(o.str());
  }
  std::sort(nodes.begin(), nodes.end());
  std::vector<std::string> splices;
  for (const Splice& sp : g.splices) {
    std::ostringstream o;
    o << "splice " << lab[sp.anchor] << ":";
    for (const Segment& s : sp.segments)
      o << " (" << s.site << "," << s.op_index << " app " << s.app << (s.gated ? " gated" : "")
        << (s.custom ? " custom" : "") << (s.enabled ? "" : " off") << ")";
    splices.push_back(o.str());
  }
  std::sort(splices.begin(), splices.end());
  std::ostringstream o;
  o << "nodes:\n";
  for (auto& s : nodes) o << "  " << s << "\n";
  o << "edges:\n";
  for (auto& s : edge_list(g)) o << "  " << s << "\n";
  for (auto& s : splices) o << s << "\n";
  return o.str();
}

}  // namespace xmix::graph
