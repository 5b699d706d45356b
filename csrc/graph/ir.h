// The graph IR the splice planner works on: a CUDA graph as plain data (nodes, edges with
// their edge data, which kernels are ours and the arguments of every site anchor), plus the
// bookkeeping of what an earlier plan spliced in. The applier (applier.cu) reads a real
// cudaGraph_t into this form; tests build it by hand. Nothing here includes a CUDA header,
// so the planner builds and is tested on machines without a toolkit.
//
// Ids: every node has an int32 id, unique within one Graph; a node inside the body of an IF
// node has `parent` = that IF node's id. In a Plan, a node the plan creates is referred to by
// a "fresh" id: fresh_id(i) = -2 - i, where i indexes Plan::add (-1 always means "none").
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace xmix::graph {

// Mirrors cudaGraphNodeType (same values); anything newer reads as Unknown.
enum class NodeType : int32_t {
  Kernel = 0,
  Memcpy = 1,
  Memset = 2,
  Host = 3,
  Child = 4,
  Empty = 5,
  EventWait = 6,
  EventRecord = 7,
  SemSignal = 8,
  SemWait = 9,
  MemAlloc = 10,
  MemFree = 11,
  Conditional = 13,
  Unknown = 255,
};

// What a node is to xmix. Foreign: anything the planner leaves alone.
enum class Role : int32_t {
  Foreign = 0,
  Anchor = 1,        // xmix_site_anchor: one per hook site, captured by torch.ops.xmix.site
  Op = 2,            // xmix_op_kernel: one built-in op
  Gate = 3,          // xmix_gate_kernel: sets the IF node's condition on the device
  If = 4,            // IF conditional node around a gated write
  CustomSelect = 5,  // xmix_custom_select
  CustomUser = 6,    // the user's kernel (xmix_custom_args ABI)
  CustomFinish = 7,  // xmix_custom_finish
};

const char* role_name(Role r);
const char* type_name(NodeType t);

// cudaGraphEdgeData without the reserved bytes. type 1 = cudaGraphDependencyTypeProgrammatic;
// from_port 1/2 = cudaGraphKernelNodePortProgrammatic / LaunchCompletion.
struct EdgeData {
  uint8_t from_port = 0;
  uint8_t to_port = 0;
  uint8_t type = 0;
  bool is_default() const { return from_port == 0 && to_port == 0 && type == 0; }
  bool operator==(const EdgeData& o) const {
    return from_port == o.from_port && to_port == o.to_port && type == o.type;
  }
};

// The arguments and launch shape of a captured site anchor, as read from its kernel node.
struct AnchorArgs {
  bool ok = false;  // false: the node is an anchor but its arguments could not be read
  uint64_t cb = 0;  // device address of the ControlBlock
  int32_t site = -1;
  uint64_t h = 0;
  uint64_t r = 0;
  int32_t d = 0;
  int64_t stride_h = 0;
  int64_t stride_r = 0;
  int32_t dtype = 0;
  uint32_t grid_x = 0, grid_y = 0, grid_z = 0;
  uint32_t block_x = 0, block_y = 0, block_z = 0;
  uint32_t smem = 0;
};

struct Node {
  int32_t id = -1;
  NodeType type = NodeType::Unknown;
  Role role = Role::Foreign;
  int32_t parent = -1;  // IF node holding this node in its body; -1: top level
  bool enabled = true;  // state in the executable graph, as the applier last set it
  AnchorArgs anchor;    // role == Anchor
};

struct Edge {
  int32_t from = -1;
  int32_t to = -1;
  EdgeData data;
};

// What a custom op's user kernel is launched with (besides what the anchor gives: h, r,
// strides, rows, d, dtype). All pointers are device addresses.
struct CustomArgs {
  uint64_t kernel = 0;  // cudaKernel_t of the user kernel
  uint64_t tok_slot = 0, tok_pos = 0, slot_params = 0;
  uint64_t artifact = 0;
  uint64_t select = 0, out = 0;  // scratch: per-row select mask and per-row output
  int32_t n_params = 0;
  int32_t param_base = 0;
  int32_t artifact_numel = 0;
  bool operator==(const CustomArgs& o) const {
    return kernel == o.kernel && tok_slot == o.tok_slot && tok_pos == o.tok_pos &&
           slot_params == o.slot_params && artifact == o.artifact && select == o.select &&
           out == o.out && n_params == o.n_params && param_base == o.param_base &&
           artifact_numel == o.artifact_numel;
  }
  bool operator!=(const CustomArgs& o) const { return !(*this == o); }
};

// One op spliced at one anchor, and the nodes that run it (-1: not part of this shape).
//   plain op ......... op
//   gated op ......... gate -> cond{op}
//   custom ........... sel -> user -> fin
//   gated custom ..... gate -> cond{sel -> user -> fin}
struct Segment {
  int32_t site = -1;
  int32_t op_index = -1;  // index in the site's op list of the control block
  int32_t app = -1;
  bool gated = false;
  bool custom = false;
  bool enabled = true;
  CustomArgs custom_args;
  int32_t gate = -1, cond = -1, op = -1, sel = -1, user = -1, fin = -1;
};

// Everything spliced for one anchor node, in execution order.
struct Splice {
  int32_t anchor = -1;
  std::vector<Segment> segments;
};

struct Graph {
  std::vector<Node> nodes;
  std::vector<Edge> edges;
  std::vector<Splice> splices;

  const Node* find(int32_t id) const;
  Node* find(int32_t id);
  int32_t next_id() const;  // one past the largest id
};

// ---------------------------------------------------------------- the planner's input
// One op of the control block's site program, as the host knows it.
struct OpSpec {
  int32_t site = -1;
  int32_t op_index = -1;
  int32_t app = -1;
  bool enabled = true;  // app mode is not "off"
  bool gated = false;   // a write whose condition reads activations: worth an IF node
  bool custom = false;  // OP_CUSTOM: select + user kernel + finish
  CustomArgs custom_args;
};

struct Program {
  uint64_t cb = 0;               // the ControlBlock every anchor must point at
  int32_t n_sites = 0;
  std::vector<OpSpec> ops;
  int32_t expected_anchors = -1;  // anchors noted while capturing; -1: unknown
  bool use_conditionals = true;   // false: gated ops become plain op nodes
  uint32_t threads = 256;         // block size of anchors and op kernels
};

// ---------------------------------------------------------------- the planner's output
inline int32_t fresh_id(int32_t index) { return -2 - index; }
inline bool is_fresh(int32_t id) { return id <= -2; }
inline int32_t fresh_index(int32_t id) { return -2 - id; }

struct NewNode {
  Role role = Role::Op;
  int32_t anchor = -1;   // the anchor whose arguments (h, r, d, rows...) the node copies
  int32_t segment = -1;  // index into the new Splice of that anchor
  int32_t body_of = -1;  // fresh index of the IF node whose body holds it; -1: top level
};

struct NewEdge {
  int32_t from = -1;  // existing id or fresh id
  int32_t to = -1;
  EdgeData data;
};

// An existing segment whose nodes need new kernel parameters (its op moved to another index
// of the site list, or a custom op's launch arguments changed).
struct Repoint {
  int32_t anchor = -1;
  int32_t segment = -1;
};

struct Toggle {
  int32_t node = -1;  // existing id or fresh id
  bool enabled = true;
};

struct Plan {
  bool fallback = false;  // the graph keeps its self-dispatching anchors
  std::string reason;     // why it fell back
  std::vector<int32_t> remove;   // our nodes to destroy (an IF takes its body with it)
  std::vector<NewNode> add;      // an IF comes before the nodes of its body
  std::vector<NewEdge> edges;
  std::vector<Repoint> repoint;
  std::vector<Toggle> enable;    // exec state of every anchor and every switchable node
  std::vector<Splice> splices;   // bookkeeping after the plan (existing or fresh ids)
  bool needs_instantiate = false;  // topology or a conditional body changed
  int32_t n_anchors = 0;
  int32_t n_kept = 0;     // anchors whose splice was kept as it was (possibly repointed)
  int32_t n_rebuilt = 0;  // anchors whose splice was (re)built
};

}  // namespace xmix::graph
