// The splice planner: given a graph (IR) and the control block's site program, decide every
// edit that turns self-dispatching anchors into per-op kernel nodes. Pure C++; the applier
// performs the edits on a real cudaGraph_t. Rules (docs/cuda_graphs.md has the full story):
//
// - Every anchor node stays in the graph and is disabled in the executable graph; the ops
//   of its site run in a chain added next to it: preds(A) -> chain -> succs(A). With
//   nothing deployed at the site the chain is empty and the site launches nothing.
// - Chain order is the anchor's: built-in ops in site order, then custom ops in site order.
//   A gated op is gate -> IF{op}; a custom op is select -> user -> finish (inside the IF when
//   gated). The first custom op of a site also waits for the anchor node itself (an empty
//   node while disabled), so that user kernels run after the anchor when the anchor runs.
// - Edges into the chain are plain full dependencies: our kernels never wait on a
//   programmatic (PDL) edge, so letting them start early would race. Edges out of the chain
//   copy the anchor's edge data (a PDL successor keeps its early launch) when the chain ends
//   in a kernel node, else they are plain.
// - Anchors are processed in topological order against the edges added so far, so an anchor
//   right after another anchor waits for the first one's chain, not just for its disabled
//   anchor.
// - A re-plan keeps an anchor's splice when its shape (gated/custom per op, in order) is
//   unchanged and only re-points parameters; otherwise it removes and rebuilds it. Planning
//   a graph against the program it was planned for yields no edit at all.
// - A graph the planner cannot handle falls back: every spliced node is removed and every
//   anchor is enabled again, which is the captured graph exactly.
#pragma once
#include <string>

#include "ir.h"

namespace xmix::graph {

// Decides the edits. Throws std::invalid_argument for a malformed program (duplicate
// (site, op_index)); a graph it cannot handle gives a Plan with fallback = true.
Plan plan(const Graph& g, const Program& p);

// The plan that puts the graph back as captured: spliced nodes removed, anchors enabled.
Plan fallback_plan(const Graph& g, const std::string& reason);

// The exec states of the anchor configuration, what the first-replay check compares a patched
// graph with: every anchor on, the switch nodes of built-in ops off (the anchor runs them),
// user kernels' nodes as they are (the anchor cannot run those; their chain waits for the
// anchor, see the rules above). The recorded states are not changed.
std::vector<Toggle> anchor_config(const Graph& g);

// Performs a plan on the IR itself (what the applier does to a cudaGraph_t): the result is
// the graph the applier should read back. Fresh nodes get ids from g.next_id() on, in order.
Graph apply(const Graph& g, const Plan& p);

// A canonical text of a graph's structure: foreign and anchor nodes by id, spliced nodes by
// (role, anchor, segment), edges with their data, exec states. Two graphs with the same
// description have the same structure whatever ids the spliced nodes got.
std::string describe(const Graph& g);

// Shorter form used by tests and logs: sorted edges only, "a->b" with labels as above and
// "[p]" marking a programmatic edge.
std::vector<std::string> edge_list(const Graph& g);

}  // namespace xmix::graph
