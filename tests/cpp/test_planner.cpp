// The splice planner on hand-built graph IR: the edits it decides and the graph they give
// (planner apply(), which the CUDA applier mirrors). Labels in edge lists: "n<id>" for nodes
// of the captured graph, "<role>@<anchor id>.<segment>" for spliced nodes.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "graph/planner.h"

using namespace xmix::graph;

namespace {

constexpr uint64_t kCb = 0x7f0000001000ull;
constexpr uint32_t kRows = 8;

struct Builder {
  Graph g;
  int32_t node(NodeType t = NodeType::Kernel, Role r = Role::Foreign) {
    Node n;
    n.id = static_cast<int32_t>(g.nodes.size());
    n.type = t;
    n.role = r;
    g.nodes.push_back(n);
    return n.id;
  }
  int32_t anchor(int32_t site, uint32_t rows = kRows) {
    const int32_t id = node(NodeType::Kernel, Role::Anchor);
    AnchorArgs& a = g.nodes[id].anchor;
    a.ok = true; a.cb = kCb; a.site = site; a.h = 0x1000; a.r = 0x2000; a.d = 64;
    a.stride_h = 64; a.stride_r = 64; a.dtype = 1;
    a.grid_x = rows; a.grid_y = 1; a.grid_z = 1;
    a.block_x = 256; a.block_y = 1; a.block_z = 1;
    a.smem = 2 * 64 * 4;
    return id;
  }
  void edge(int32_t a, int32_t b, EdgeData d = {}) { g.edges.push_back({a, b, d}); }
};

OpSpec op(int32_t site, int32_t k, int32_t app, bool enabled = true, bool gated = false,
          bool custom = false) {
  OpSpec o;
  o.site = site; o.op_index = k; o.app = app; o.enabled = enabled; o.gated = gated; o.custom = custom;
  if (custom) {
    o.custom_args.kernel = 0xabc0 + static_cast<uint64_t>(app);
    o.custom_args.select = 0x5000;
    o.custom_args.out = 0x6000;
  }
  return o;
}

Program program(std::vector<OpSpec> ops, int32_t expected = -1) {
  Program p;
  p.cb = kCb;
  p.n_sites = 64;
  p.ops = std::move(ops);
  p.expected_anchors = expected;
  return p;
}

std::set<std::string> edges(const Graph& g) {
  auto v = edge_list(g);
  return {v.begin(), v.end()};
}

bool enabled(const Graph& g, int32_t id) { return g.find(id)->enabled; }

// Ids of our nodes that would launch a kernel at the top level with the exec states given.
int enabled_spliced_kernels(const Graph& g) {
  int n = 0;
  for (const Node& x : g.nodes)
    if (x.parent == -1 && x.type == NodeType::Kernel && x.role != Role::Foreign && x.enabled) ++n;
  return n;
}

// P -> A(site) -> S
struct Line {
  Builder b;
  int32_t p, a, s;
  explicit Line(int32_t site = 5) {
    p = b.node();
    a = b.anchor(site);
    s = b.node();
    b.edge(p, a);
    b.edge(a, s);
  }
};

}  // namespace

TEST(Planner, OneSiteTopologyBeforeAndAfter) {
  Line l;
  const Graph before = l.b.g;
  EXPECT_EQ(edges(before), (std::set<std::string>{"n0->n1", "n1->n2"}));

  Plan p = plan(before, program({op(5, 0, 0)}));
  ASSERT_FALSE(p.fallback) << p.reason;
  EXPECT_TRUE(p.needs_instantiate);
  ASSERT_EQ(p.add.size(), 1u);
  EXPECT_EQ(p.add[0].role, Role::Op);
  EXPECT_TRUE(p.remove.empty());

  const Graph after = apply(before, p);
  // The anchor keeps its edges; the op runs beside it, between the same neighbours.
  EXPECT_EQ(edges(after),
            (std::set<std::string>{"n0->n1", "n1->n2", "n0->op@1.0", "op@1.0->n2"}));
  EXPECT_FALSE(enabled(after, l.a));
  ASSERT_EQ(after.splices.size(), 1u);
  const Segment& s = after.splices[0].segments[0];
  EXPECT_EQ(s.site, 5);
  EXPECT_EQ(s.op_index, 0);
  EXPECT_TRUE(enabled(after, s.op));
  EXPECT_EQ(enabled_spliced_kernels(after), 1);
}

TEST(Planner, ManySitesEachGetTheirOwnChain) {
  // P -> A0 -> K1 -> A1 -> K2 -> A2 -> S; nothing deployed at site 2.
  Builder b;
  const int32_t p = b.node(), a0 = b.anchor(0), k1 = b.node(), a1 = b.anchor(1), k2 = b.node(),
                a2 = b.anchor(2), s = b.node();
  b.edge(p, a0); b.edge(a0, k1); b.edge(k1, a1); b.edge(a1, k2); b.edge(k2, a2); b.edge(a2, s);
  Plan pl = plan(b.g, program({op(0, 0, 0), op(1, 0, 0), op(1, 1, 1)}, 3));
  ASSERT_FALSE(pl.fallback) << pl.reason;
  EXPECT_EQ(pl.n_anchors, 3);
  const Graph g = apply(b.g, pl);
  const std::set<std::string> want = {
      "n0->n1", "n1->n2", "n2->n3", "n3->n4", "n4->n5", "n5->n6",  // captured, untouched
      "n0->op@1.0", "op@1.0->n2",                                    // site 0
      "n2->op@3.0", "op@3.0->op@3.1", "op@3.1->n4",                  // site 1: two ops in order
  };
  EXPECT_EQ(edges(g), want);
  for (int32_t a : {a0, a1, a2}) EXPECT_FALSE(enabled(g, a)) << "anchor " << a;
  EXPECT_EQ(enabled_spliced_kernels(g), 3);
  (void)s;
}

TEST(Planner, AdjacentAnchorsAreOrderedThroughTheirChains) {
  // residual.post of one layer and residual.pre of the next can be back to back: the second
  // chain must wait for the first chain, not only for the first (disabled) anchor.
  Builder b;
  const int32_t p = b.node(), a0 = b.anchor(5), a1 = b.anchor(6), s = b.node();
  b.edge(p, a0); b.edge(a0, a1); b.edge(a1, s);
  const Graph g = apply(b.g, plan(b.g, program({op(5, 0, 0), op(6, 0, 1)})));
  const auto e = edges(g);
  EXPECT_TRUE(e.count("op@1.0->op@2.0")) << describe(g);
  EXPECT_TRUE(e.count("n0->op@1.0"));
  EXPECT_TRUE(e.count("op@2.0->n3"));
  (void)a0; (void)a1; (void)p; (void)s;
}

TEST(Planner, SeveralAppsAtOneSiteRunInSiteOrderCustomLast) {
  Line l(7);
  // Site 7: index 0 app 2, index 1 app 0, index 2 a custom op of app 1, index 3 app 3.
  Plan p = plan(l.b.g, program({op(7, 2, 1, true, false, true), op(7, 0, 2), op(7, 3, 3), op(7, 1, 0)}));
  ASSERT_FALSE(p.fallback) << p.reason;
  const Graph g = apply(l.b.g, p);
  ASSERT_EQ(g.splices.size(), 1u);
  std::vector<int32_t> order, apps;
  for (const Segment& s : g.splices[0].segments) {
    order.push_back(s.op_index);
    apps.push_back(s.app);
  }
  EXPECT_EQ(order, (std::vector<int32_t>{0, 1, 3, 2}));
  EXPECT_EQ(apps, (std::vector<int32_t>{2, 0, 3, 1}));
  EXPECT_EQ(edges(g), (std::set<std::string>{
                          "n0->n1", "n1->n2", "n0->op@1.0", "op@1.0->op@1.1", "op@1.1->op@1.2",
                          "op@1.2->sel@1.3", "sel@1.3->user@1.3", "user@1.3->fin@1.3", "fin@1.3->n2",
                          "n1->sel@1.3"}));  // user kernels also wait for the anchor
  EXPECT_EQ(enabled_spliced_kernels(g), 6);
}

TEST(Planner, GatedWritesSitInsideIfBodies) {
  Line l;
  Plan p = plan(l.b.g, program({op(5, 0, 0), op(5, 1, 0, true, true), op(5, 2, 1, true, true, true)}));
  ASSERT_FALSE(p.fallback) << p.reason;
  const Graph g = apply(l.b.g, p);
  EXPECT_EQ(edges(g), (std::set<std::string>{
                          "n0->n1", "n1->n2",
                          "n0->op@1.0", "op@1.0->gate@1.1", "gate@1.1->if@1.1",
                          "if@1.1->gate@1.2", "gate@1.2->if@1.2", "if@1.2->n2",
                          "n1->gate@1.2",  // a user kernel's segment waits for the anchor
                          "sel@1.2->user@1.2", "user@1.2->fin@1.2"}));  // body of if@1.2
  const Segment& plain_gated = g.splices[0].segments[1];
  const Segment& custom_gated = g.splices[0].segments[2];
  EXPECT_EQ(g.find(plain_gated.cond)->type, NodeType::Conditional);
  EXPECT_EQ(g.find(plain_gated.op)->parent, plain_gated.cond);
  EXPECT_EQ(g.find(plain_gated.gate)->parent, -1);
  for (int32_t id : {custom_gated.sel, custom_gated.user, custom_gated.fin})
    EXPECT_EQ(g.find(id)->parent, custom_gated.cond);
  // The gate is the switch of a gated op; nodes inside IF bodies are never toggled.
  std::set<Role> switched;
  for (const Toggle& t : p.enable) {
    if (!is_fresh(t.node)) continue;
    const NewNode& nn = p.add[fresh_index(t.node)];
    EXPECT_EQ(nn.body_of, -1);
    switched.insert(nn.role);
  }
  EXPECT_EQ(switched, (std::set<Role>{Role::Op, Role::Gate}));

  Program off = program({op(5, 0, 0), op(5, 1, 0, true, true)});
  off.use_conditionals = false;
  const Graph plain = apply(l.b.g, plan(l.b.g, off));
  EXPECT_EQ(edges(plain), (std::set<std::string>{"n0->n1", "n1->n2", "n0->op@1.0",
                                                 "op@1.0->op@1.1", "op@1.1->n2"}));
}

TEST(Planner, AnchorConfigKeepsUserKernelsAfterTheAnchor) {
  // The first-replay check compares a patched graph with its anchor configuration. The anchor
  // kernel runs a site's built-in ops but not user kernels, so the configuration keeps the
  // user kernels' nodes as recorded; they run after the anchor (its edge), as eagerly.
  Line l;
  const Graph g = apply(l.b.g, plan(l.b.g, program({op(5, 0, 0), op(5, 1, 1, true, true),
                                                    op(5, 2, 2, true, false, true),
                                                    op(5, 3, 3, false, false, true)})));
  const std::vector<Segment>& segs = g.splices[0].segments;
  std::map<int32_t, bool> want = {{l.a, true}, {segs[0].op, false}, {segs[1].gate, false}};
  for (int32_t id : {segs[2].sel, segs[2].user, segs[2].fin}) want[id] = true;
  for (int32_t id : {segs[3].sel, segs[3].user, segs[3].fin}) want[id] = false;  // app off
  std::map<int32_t, bool> got;
  for (const Toggle& t : anchor_config(g)) got[t.node] = t.enabled;
  EXPECT_EQ(got, want);
  EXPECT_TRUE(edges(g).count("n1->sel@1.2")) << describe(g);
  // at a site with built-in ops only, nothing waits for the anchor
  Line l2;
  EXPECT_EQ(edges(apply(l2.b.g, plan(l2.b.g, program({op(5, 0, 0)})))),
            (std::set<std::string>{"n0->n1", "n1->n2", "n0->op@1.0", "op@1.0->n2"}));
}

TEST(Planner, DisableAllLaunchesNothingAtTheSite) {
  Line l;
  Plan p = plan(l.b.g, program({op(5, 0, 0, false), op(5, 1, 1, false, true), op(5, 2, 2, false, false, true)}));
  ASSERT_FALSE(p.fallback) << p.reason;
  const Graph g = apply(l.b.g, p);
  EXPECT_FALSE(enabled(g, l.a));
  EXPECT_EQ(enabled_spliced_kernels(g), 0) << describe(g);
  // Nothing deployed at all: no node is added and the anchor is off too.
  Plan none = plan(l.b.g, program({}));
  EXPECT_TRUE(none.add.empty());
  EXPECT_FALSE(none.needs_instantiate);
  EXPECT_FALSE(enabled(apply(l.b.g, none), l.a));
}

TEST(Planner, ReplanAgainstTheSameProgramChangesNothing) {
  Builder b;
  const int32_t p = b.node(), a0 = b.anchor(0), k = b.node(), a1 = b.anchor(1), s = b.node();
  b.edge(p, a0); b.edge(a0, k); b.edge(k, a1); b.edge(a1, s);
  const Program prog = program({op(0, 0, 0), op(0, 1, 1, true, true), op(1, 0, 2, false, false, true)});
  const Graph g1 = apply(b.g, plan(b.g, prog));
  const Plan again = plan(g1, prog);
  ASSERT_FALSE(again.fallback) << again.reason;
  EXPECT_TRUE(again.add.empty());
  EXPECT_TRUE(again.remove.empty());
  EXPECT_TRUE(again.edges.empty());
  EXPECT_TRUE(again.repoint.empty());
  EXPECT_FALSE(again.needs_instantiate);
  EXPECT_EQ(again.n_kept, 2);
  EXPECT_EQ(describe(apply(g1, again)), describe(g1));
  (void)p; (void)a0; (void)k; (void)a1; (void)s;
}

TEST(Planner, UndeployRestoresTheCapturedGraph) {
  Builder b;
  const int32_t p = b.node(), a0 = b.anchor(0), a1 = b.anchor(1), s = b.node();
  b.edge(p, a0); b.edge(a0, a1); b.edge(a1, s, {1, 0, 1});
  const Graph g0 = b.g;
  const Graph g1 = apply(g0, plan(g0, program({op(0, 0, 0, true, true), op(1, 0, 1), op(1, 1, 1, true, false, true)})));
  ASSERT_NE(edges(g1), edges(g0));

  const Plan undeploy = plan(g1, program({}));
  ASSERT_FALSE(undeploy.fallback);
  EXPECT_TRUE(undeploy.needs_instantiate);
  const Graph g2 = apply(g1, undeploy);
  EXPECT_EQ(edges(g2), edges(g0));
  EXPECT_EQ(g2.nodes.size(), g0.nodes.size());  // IF bodies went with their IF nodes
  EXPECT_TRUE(g2.splices.empty());
  EXPECT_FALSE(enabled(g2, a0));  // nothing to run: the anchors stay off

  // The fallback plan gives back exactly what was captured, anchors running again.
  const Graph g3 = apply(g1, fallback_plan(g1, "test"));
  EXPECT_EQ(describe(g3), describe(g0));
  (void)p; (void)a1; (void)s;
}

TEST(Planner, PdlEdgeDataIsKept) {
  const EdgeData pdl{1, 0, 1};  // programmatic port, programmatic dependency
  Builder b;
  const int32_t p = b.node(), a = b.anchor(3), s = b.node();
  b.edge(p, a, pdl);
  b.edge(a, s, pdl);
  const Graph g = apply(b.g, plan(b.g, program({op(3, 0, 0), op(3, 1, 1)})));
  const auto e = edges(g);
  // The captured edges keep their data; the successor keeps its early launch after the
  // chain; into the chain the dependency is a full one (our kernels never wait on PDL).
  EXPECT_TRUE(e.count("n0->n1[1,0,1]"));
  EXPECT_TRUE(e.count("n1->n2[1,0,1]"));
  EXPECT_TRUE(e.count("op@1.1->n2[1,0,1]")) << describe(g);
  EXPECT_TRUE(e.count("n0->op@1.0"));
  EXPECT_TRUE(e.count("op@1.0->op@1.1"));

  // A chain that ends in an IF node cannot carry a programmatic edge: it becomes a full one.
  const Graph gi = apply(b.g, plan(b.g, program({op(3, 0, 0, true, true)})));
  const auto ei = edges(gi);
  EXPECT_TRUE(ei.count("if@1.0->n2")) << describe(gi);
  EXPECT_FALSE(ei.count("if@1.0->n2[1,0,1]"));
  EXPECT_TRUE(ei.count("n1->n2[1,0,1]"));
}

TEST(Planner, UnknownNodeKindsAreLeftAlone) {
  Builder b;
  const int32_t u = b.node(NodeType::Unknown), host = b.node(NodeType::Host),
                child = b.node(NodeType::Child), cond = b.node(NodeType::Conditional),
                body = b.node(NodeType::Kernel), a = b.anchor(2), ev = b.node(NodeType::EventRecord);
  b.g.nodes[body].parent = cond;  // a foreign conditional with its own body
  b.edge(u, host); b.edge(host, a); b.edge(child, a); b.edge(a, cond); b.edge(a, ev);
  const Graph g0 = b.g;
  const Graph g = apply(g0, plan(g0, program({op(2, 0, 0)})));
  for (const Node& n : g0.nodes) {
    const Node* m = g.find(n.id);
    ASSERT_NE(m, nullptr);
    EXPECT_EQ(m->type, n.type);
    EXPECT_EQ(m->parent, n.parent);
    if (n.role == Role::Foreign) {
      EXPECT_EQ(m->role, Role::Foreign);
      EXPECT_TRUE(m->enabled);
    }
  }
  const auto e = edges(g);
  for (const std::string& s : {"n0->n1", "n1->n5", "n2->n5", "n5->n3", "n5->n6", "n1->op@5.0",
                               "n2->op@5.0", "op@5.0->n3", "op@5.0->n6"})
    EXPECT_TRUE(e.count(s)) << s << "\n" << describe(g);
  EXPECT_EQ(e.size(), 9u);
}

TEST(Planner, GraphsItCannotHandleFallBack) {
  auto expect_fallback = [](const Graph& g, const Program& p, const std::string& why) {
    const Plan pl = plan(g, p);
    EXPECT_TRUE(pl.fallback) << why;
    EXPECT_TRUE(pl.add.empty()) << why;
    for (const Toggle& t : pl.enable) EXPECT_TRUE(t.enabled) << why;
    EXPECT_FALSE(pl.reason.empty()) << why;
  };
  const Program prog = program({op(5, 0, 0)});
  {
    Line l;
    l.b.g.nodes[l.a].anchor.cb = 0x1234;
    expect_fallback(l.b.g, prog, "another control block");
  }
  {
    Line l;
    l.b.g.nodes[l.a].anchor.site = 64;
    expect_fallback(l.b.g, prog, "site out of range");
  }
  {
    Line l;
    l.b.g.nodes[l.a].anchor.ok = false;
    expect_fallback(l.b.g, prog, "unreadable arguments");
  }
  {
    Line l;
    l.b.g.nodes[l.a].anchor.block_x = 128;
    expect_fallback(l.b.g, prog, "launch shape");
  }
  {
    Line l;
    expect_fallback(l.b.g, program({op(5, 0, 0)}, 2), "anchors missing (nested graphs)");
  }
  {
    Line l;
    l.b.node(NodeType::Kernel, Role::Op);  // an op kernel the patcher did not put there
    expect_fallback(l.b.g, prog, "stray xmix node");
  }
  {
    Line l;
    const int32_t c = l.b.node(NodeType::Conditional);
    l.b.g.nodes[l.a].parent = c;
    expect_fallback(l.b.g, prog, "anchor inside a body");
  }
  {
    Line l;
    l.b.edge(l.s, l.p);
    expect_fallback(l.b.g, prog, "cycle");
  }
  {
    Line l;
    l.b.edge(l.s, 99);
    expect_fallback(l.b.g, prog, "malformed");
  }
  {
    Line l;
    const int32_t alloc = l.b.node(NodeType::MemAlloc);
    l.b.edge(alloc, l.p);
    expect_fallback(l.b.g, prog, "memory alloc nodes");
  }
  {
    Line l;
    OpSpec c = op(5, 0, 0, true, false, true);
    c.custom_args.kernel = 0;
    expect_fallback(l.b.g, program({c}), "custom op without a CUDA kernel");
  }
  {
    // Falling back from a patched graph removes what was spliced and re-enables anchors.
    Line l;
    const Graph g1 = apply(l.b.g, plan(l.b.g, prog));
    Program other = prog;
    other.cb = 0x999;
    const Plan pl = plan(g1, other);
    EXPECT_TRUE(pl.fallback);
    EXPECT_EQ(pl.remove.size(), 1u);
    EXPECT_EQ(describe(apply(g1, pl)), describe(l.b.g));
  }
}

TEST(Planner, ReplanKeepsSameShapesAndRepoints) {
  Line l;
  // Deployed: index 0 plain (app 0), index 1 custom (app 1).
  const Graph g1 = apply(l.b.g, plan(l.b.g, program({op(5, 0, 0), op(5, 1, 1, true, false, true)})));
  // After an undeploy/deploy the custom op is at index 0 and the plain op at index 1: same
  // shape (plain, then custom), new indices -> re-pointed in place, no re-instantiation.
  const Plan p = plan(g1, program({op(5, 0, 1, true, false, true), op(5, 1, 0)}));
  ASSERT_FALSE(p.fallback) << p.reason;
  EXPECT_TRUE(p.add.empty());
  EXPECT_TRUE(p.remove.empty());
  EXPECT_EQ(p.repoint.size(), 2u);
  EXPECT_FALSE(p.needs_instantiate);
  const Graph g2 = apply(g1, p);
  EXPECT_EQ(edges(g2), edges(g1));
  EXPECT_EQ(g2.splices[0].segments[0].op_index, 1);
  EXPECT_EQ(g2.splices[0].segments[1].op_index, 0);

  // A custom op's launch arguments changed (artifact swap): that segment alone.
  OpSpec c = op(5, 1, 1, true, false, true);
  c.custom_args.artifact = 0x7777;
  const Plan pa = plan(g1, program({op(5, 0, 0), c}));
  ASSERT_EQ(pa.repoint.size(), 1u);
  EXPECT_EQ(pa.repoint[0].segment, 1);
  EXPECT_FALSE(pa.needs_instantiate);

  // A gated op's kernel lives in an IF body: re-pointing it needs a re-instantiation.
  const Graph gg = apply(l.b.g, plan(l.b.g, program({op(5, 0, 0, true, true)})));
  const Plan pg = plan(gg, program({op(5, 1, 0, true, true)}));
  EXPECT_EQ(pg.repoint.size(), 1u);
  EXPECT_TRUE(pg.add.empty());
  EXPECT_TRUE(pg.needs_instantiate);
}

TEST(Planner, ModeChangesOnlyToggle) {
  Line l;
  const Graph g1 = apply(l.b.g, plan(l.b.g, program({op(5, 0, 0), op(5, 1, 1, true, true)})));
  const Plan p = plan(g1, program({op(5, 0, 0, false), op(5, 1, 1, false, true)}));
  EXPECT_TRUE(p.add.empty());
  EXPECT_TRUE(p.remove.empty());
  EXPECT_FALSE(p.needs_instantiate);
  const Graph g2 = apply(g1, p);
  EXPECT_EQ(enabled_spliced_kernels(g2), 0);
  EXPECT_EQ(g2.splices[0].segments[0].enabled, false);
}

TEST(Planner, DeployNextToAKeptSpliceRebuildsOnlyWhatChanged) {
  Builder b;
  const int32_t p = b.node(), a0 = b.anchor(0), a1 = b.anchor(1), s = b.node();
  b.edge(p, a0); b.edge(a0, a1); b.edge(a1, s);
  const Graph g1 = apply(b.g, plan(b.g, program({op(0, 0, 0), op(1, 0, 0)})));
  // A second app at site 0 only: anchor 1 keeps its op node, anchor 0 gets a new chain.
  const Plan pl = plan(g1, program({op(0, 0, 0), op(0, 1, 1), op(1, 0, 0)}));
  ASSERT_FALSE(pl.fallback) << pl.reason;
  EXPECT_EQ(pl.n_kept, 1);
  EXPECT_EQ(pl.n_rebuilt, 1);
  EXPECT_EQ(pl.remove.size(), 1u);
  const Graph g2 = apply(g1, pl);
  const auto e = edges(g2);
  EXPECT_TRUE(e.count("n0->op@1.0"));
  EXPECT_TRUE(e.count("op@1.0->op@1.1"));
  EXPECT_TRUE(e.count("op@1.1->op@2.0")) << describe(g2);  // kept chain waits for the new one
  EXPECT_TRUE(e.count("op@2.0->n3"));
  // Same result as planning the new program on the captured graph.
  EXPECT_EQ(edges(g2), edges(apply(b.g, plan(b.g, program({op(0, 0, 0), op(0, 1, 1), op(1, 0, 0)})))));
  (void)a0; (void)a1; (void)s;
}

TEST(Planner, SplicesOfVanishedAnchorsAreRemoved) {
  Line l;
  Graph g1 = apply(l.b.g, plan(l.b.g, program({op(5, 0, 0)})));
  for (Node& n : g1.nodes)
    if (n.role == Role::Anchor) n.role = Role::Foreign;  // the anchor is no longer one
  const Plan p = plan(g1, program({op(5, 0, 0)}));
  ASSERT_FALSE(p.fallback) << p.reason;
  EXPECT_EQ(p.remove.size(), 1u);
  EXPECT_TRUE(apply(g1, p).splices.empty());
}

TEST(Planner, MalformedProgramsThrow) {
  Line l;
  EXPECT_THROW(plan(l.b.g, program({op(5, 0, 0), op(5, 0, 1)})), std::invalid_argument);
  EXPECT_THROW(plan(l.b.g, program({op(99, 0, 0)})), std::invalid_argument);
  EXPECT_THROW(plan(l.b.g, program({op(5, -1, 0)})), std::invalid_argument);
}

namespace {

// Top-level reachability: reach[x] = every node x reaches by edges (x excluded).
std::map<int32_t, std::set<int32_t>> reachability(const Graph& g) {
  std::map<int32_t, std::vector<int32_t>> out;
  for (const Node& n : g.nodes)
    if (n.parent == -1) out[n.id];
  for (const Edge& e : g.edges)
    if (out.count(e.from) && out.count(e.to)) out[e.from].push_back(e.to);
  std::map<int32_t, std::set<int32_t>> reach;
  for (auto& [x, _] : out) {
    std::vector<int32_t> stack = out[x];
    std::set<int32_t>& r = reach[x];
    while (!stack.empty()) {
      const int32_t y = stack.back();
      stack.pop_back();
      if (r.insert(y).second) stack.insert(stack.end(), out[y].begin(), out[y].end());
    }
  }
  return reach;
}

std::vector<int32_t> chain_nodes(const Graph& g, const Splice& sp) {
  std::vector<int32_t> v;
  for (const Segment& s : sp.segments)
    for (int32_t id : {s.gate, s.cond, s.op, s.sel, s.user, s.fin})
      if (id != -1 && g.find(id) && g.find(id)->parent == -1) v.push_back(id);
  return v;
}

// What every plan must keep of the captured graph g0, in the patched graph g: the captured
// nodes' order, each chain after everything before its anchor and before everything after
// it, chains ordered as their anchors, programmatic edges only from kernels and never into
// our nodes.
void expect_order_kept(const Graph& g0, const Graph& g, const std::string& at) {
  const auto r0 = reachability(g0), r = reachability(g);
  auto is_anchor = [&](int32_t id) { return g0.find(id)->role == Role::Anchor; };
  for (const Node& x : g0.nodes) {
    if (is_anchor(x.id)) continue;
    for (int32_t y : r0.at(x.id))
      if (!is_anchor(y)) EXPECT_TRUE(r.at(x.id).count(y)) << at << ": n" << x.id << " -> n" << y;
  }
  for (const Splice& sp : g.splices) {
    for (int32_t c : chain_nodes(g, sp)) {
      for (const Node& x : g0.nodes)
        if (!is_anchor(x.id) && r0.at(x.id).count(sp.anchor))
          EXPECT_TRUE(r.at(x.id).count(c)) << at << ": n" << x.id << " before chain of " << sp.anchor;
      for (int32_t y : r0.at(sp.anchor))
        if (!is_anchor(y)) EXPECT_TRUE(r.at(c).count(y)) << at << ": chain of " << sp.anchor << " before n" << y;
      for (const Splice& later : g.splices)
        if (r0.at(sp.anchor).count(later.anchor))
          for (int32_t c2 : chain_nodes(g, later))
            EXPECT_TRUE(r.at(c).count(c2)) << at << ": chain " << sp.anchor << " before " << later.anchor;
    }
  }
  for (const Edge& e : g.edges) {
    if (e.data.type == 0) continue;
    EXPECT_EQ(g.find(e.from)->type, NodeType::Kernel) << at;
    const Role to = g.find(e.to)->role;
    EXPECT_TRUE(to == Role::Foreign || to == Role::Anchor) << at << ": programmatic edge into ours";
  }
  for (const Node& n : g.nodes)
    if (n.role == Role::Anchor) EXPECT_FALSE(n.enabled) << at;
}

}  // namespace

TEST(Planner, RandomGraphsAndProgramsKeepTheCapturedOrder) {
  std::mt19937 rng(20261204);
  auto coin = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };
  auto pick = [&](int n) { return static_cast<int32_t>(rng() % static_cast<uint32_t>(n)); };
  for (int trial = 0; trial < 1000; ++trial) {
    Builder b;
    const int n = 5 + pick(10);
    for (int i = 0; i < n; ++i) {
      if (coin(0.4)) b.anchor(pick(5));
      else b.node(coin(0.8) ? NodeType::Kernel : (coin(0.5) ? NodeType::Memcpy : NodeType::Empty));
    }
    for (int i = 0; i < n; ++i)
      for (int j = i + 1; j < n; ++j)
        if (coin(0.3)) {
          const bool kernel = b.g.nodes[i].type == NodeType::Kernel;
          b.edge(i, j, kernel && coin(0.25) ? EdgeData{1, 0, 1} : EdgeData{});
        }
    const Graph g0 = b.g;
    Graph g = g0;
    for (int step = 0; step < 6; ++step) {
      std::vector<OpSpec> ops;
      for (int site = 0; site < 5; ++site) {
        const int k = coin(0.5) ? 0 : 1 + pick(2);
        for (int i = 0; i < k; ++i)
          ops.push_back(op(site, i, pick(4), coin(0.7), coin(0.3), coin(0.2)));
      }
      const Program prog = program(ops);
      const std::string at = "trial " + std::to_string(trial) + " step " + std::to_string(step);
      const Plan pl = plan(g, prog);
      ASSERT_FALSE(pl.fallback) << at << ": " << pl.reason;
      g = apply(g, pl);
      expect_order_kept(g0, g, at);
      const Plan again = plan(g, prog);
      EXPECT_TRUE(again.add.empty() && again.remove.empty() &&
                  again.edges.empty() && !again.needs_instantiate)
          << at << ": planning the same program again edits the graph\n" << describe(g);
      EXPECT_EQ(describe(apply(g, fallback_plan(g, "test"))), describe(g0)) << at;
      if (::testing::Test::HasFailure()) return;
    }
  }
}
