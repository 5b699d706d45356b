// The applier: performs planner edits on a real cudaGraph_t and keeps the node handles per
// (graph, anchor, op). The planner decides; nothing here chooses what to splice.
//
// Conditional handles: a handle belongs to its graph for the graph's life and the runtime
// documents that a handle with no conditional node may make instantiation fail. So an IF node
// the plan removes is never destroyed: its body is emptied, its edges are cut and it is
// parked; the next IF the plan adds takes a parked node (and its handle) before creating a
// new one. A parked IF is an isolated node whose condition defaults to 0 and whose body is
// empty. read() hides parked nodes, so the IR matches what the planner expects.
//
// Error handling follows PyTorch's CUDAGraph.cpp: every CUDA call is checked, a failing call
// clears the runtime's last error and throws with the call's text.
#include <cuda.h>  // driver types only: driver calls go through cudaGetDriverEntryPointByVersion
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "applier.h"
#include "kernel_match.h"
#include "planner.h"
#include "xmix/control.h"
#include "xmix/custom.h"
#include "xmix/site.h"

namespace xmix {
// ops.cu
const void* custom_select_kernel_symbol();
const void* custom_finish_kernel_symbol();
}  // namespace xmix

namespace xmix::graph {
namespace {

[[noreturn]] void fail(cudaError_t e, const char* what) {
  cudaGetLastError();
  throw std::runtime_error(std::string("xmix graph patch: ") + what +
                           " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

#define XG_CHECK(call)                                \
  do {                                                \
    cudaError_t xg_err_ = (call);                     \
    if (xg_err_ != cudaSuccess) fail(xg_err_, #call); \
  } while (0)

nvtxDomainHandle_t nvtx_domain() {
  static nvtxDomainHandle_t d = nvtxDomainCreateA("xmix");
  return d;
}

struct NvtxRange {
  explicit NvtxRange(const std::string& s) { nvtx_push(s); }
  ~NvtxRange() { nvtx_pop(); }
};

constexpr uint32_t kThreads = 256;

// Our kernels in every form the runtime may report for a kernel node (kernel_match.h): the
// host stub, its cudaFunction_t and cudaKernel_t, and the mangled name for a handle that
// matches none of these.
struct Symbols {
  KnownKernels known;
  Symbols() {
    const std::pair<const void*, Role> ours[] = {
        {anchor_kernel_symbol(), Role::Anchor},
        {op_kernel_symbol(), Role::Op},
        {gate_kernel_symbol(), Role::Gate},
        {custom_select_kernel_symbol(), Role::CustomSelect},
        {custom_finish_kernel_symbol(), Role::CustomFinish},
    };
    for (auto& [stub, role] : ours) {
      known.add_handle(stub, role, MatchForm::Stub);
      cudaFunction_t f = nullptr;
      if (cudaGetFuncBySymbol(&f, stub) == cudaSuccess && f)
        known.add_handle(reinterpret_cast<const void*>(f), role, MatchForm::Function);
      else
        cudaGetLastError();
      cudaKernel_t k = nullptr;
      if (cudaGetKernel(&k, stub) == cudaSuccess && k)
        known.add_handle(reinterpret_cast<const void*>(k), role, MatchForm::Kernel);
      else
        cudaGetLastError();
      const char* name = nullptr;
      if (cudaFuncGetName(&name, stub) == cudaSuccess && name)
        known.add_name(name, role);
      else
        cudaGetLastError();
    }
  }
};

const Symbols& symbols() {
  static const Symbols s;
  return s;
}

// Driver entry points, looked up through the runtime: xmix._C does not link libcuda, so it
// imports on machines without a driver.
struct Driver {
  using NodeParamsFn = CUresult (*)(CUgraphNode, CUDA_KERNEL_NODE_PARAMS_v2*);
  using FuncNameFn = CUresult (*)(const char**, CUfunction);
  using KernelNameFn = CUresult (*)(const char**, CUkernel);
  NodeParamsFn node_params = nullptr;
  FuncNameFn func_name = nullptr;
  KernelNameFn kernel_name = nullptr;
  Driver() {
    get("cuGraphKernelNodeGetParams", 12000, reinterpret_cast<void**>(&node_params));
    get("cuFuncGetName", 12030, reinterpret_cast<void**>(&func_name));
    get("cuKernelGetName", 12030, reinterpret_cast<void**>(&kernel_name));
  }
  static void get(const char* sym, unsigned version, void** fn) {
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion(sym, fn, version, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      *fn = nullptr;
    }
  }
};

const Driver& driver() {
  static const Driver d;
  return d;
}

// The kernel name of a node whose function handle is none of ours: the driver's for the
// node's CUfunction or CUkernel (handles the driver itself reported), else the runtime's
// for the handle it reported (used only where the driver entry points are missing).
const char* node_kernel_name(const void* rt_func, const CUDA_KERNEL_NODE_PARAMS_v2* drv) {
  const char* name = nullptr;
  const Driver& d = driver();
  if (drv && drv->func && d.func_name && d.func_name(&name, drv->func) == CUDA_SUCCESS && name)
    return name;
  if (drv && drv->kern && d.kernel_name && d.kernel_name(&name, drv->kern) == CUDA_SUCCESS && name)
    return name;
  if (rt_func && !drv) {
    if (cudaFuncGetName(&name, rt_func) == cudaSuccess && name) return name;
    cudaGetLastError();
  }
  return nullptr;
}

NodeType to_ir(cudaGraphNodeType t) {
  switch (t) {
    case cudaGraphNodeTypeKernel: return NodeType::Kernel;
    case cudaGraphNodeTypeMemcpy: return NodeType::Memcpy;
    case cudaGraphNodeTypeMemset: return NodeType::Memset;
    case cudaGraphNodeTypeHost: return NodeType::Host;
    case cudaGraphNodeTypeGraph: return NodeType::Child;
    case cudaGraphNodeTypeEmpty: return NodeType::Empty;
    case cudaGraphNodeTypeWaitEvent: return NodeType::EventWait;
    case cudaGraphNodeTypeEventRecord: return NodeType::EventRecord;
    case cudaGraphNodeTypeExtSemaphoreSignal: return NodeType::SemSignal;
    case cudaGraphNodeTypeExtSemaphoreWait: return NodeType::SemWait;
    case cudaGraphNodeTypeMemAlloc: return NodeType::MemAlloc;
    case cudaGraphNodeTypeMemFree: return NodeType::MemFree;
    case cudaGraphNodeTypeConditional: return NodeType::Conditional;
    default: return NodeType::Unknown;
  }
}

std::vector<cudaGraphNode_t> graph_nodes(cudaGraph_t g) {
  size_t n = 0;
  XG_CHECK(cudaGraphGetNodes(g, nullptr, &n));
  std::vector<cudaGraphNode_t> v(n);
  if (n) XG_CHECK(cudaGraphGetNodes(g, v.data(), &n));
  v.resize(n);
  return v;
}

struct RawEdge {
  cudaGraphNode_t from, to;
  cudaGraphEdgeData data;
};

std::vector<RawEdge> graph_edges(cudaGraph_t g) {
  size_t n = 0;
  XG_CHECK(cudaGraphGetEdges(g, nullptr, nullptr, nullptr, &n));
  std::vector<cudaGraphNode_t> from(n), to(n);
  std::vector<cudaGraphEdgeData> data(n);
  // Edge data is always requested: a query without it fails on PDL edges (LossyQuery).
  if (n) XG_CHECK(cudaGraphGetEdges(g, from.data(), to.data(), data.data(), &n));
  std::vector<RawEdge> v;
  v.reserve(n);
  for (size_t i = 0; i < n; ++i) v.push_back({from[i], to[i], data[i]});
  return v;
}

cudaGraphEdgeData to_cuda(const EdgeData& d) {
  cudaGraphEdgeData e{};
  e.from_port = d.from_port;
  e.to_port = d.to_port;
  e.type = d.type;
  return e;
}

EdgeData from_cuda(const cudaGraphEdgeData& e) {
  EdgeData d;
  d.from_port = e.from_port;
  d.to_port = e.to_port;
  d.type = e.type;
  return d;
}

// Reads the arguments of an anchor kernel node; kp points at node-owned copies of each
// argument, in signature order.
AnchorArgs read_anchor(dim3 grid, dim3 block, unsigned smem, void** kp) {
  AnchorArgs a;
  a.grid_x = grid.x;
  a.grid_y = grid.y;
  a.grid_z = grid.z;
  a.block_x = block.x;
  a.block_y = block.y;
  a.block_z = block.z;
  a.smem = smem;
  if (!kp) return a;  // launched with the "extra" packing: not our launcher
  void** k = kp;
  a.cb = addr(*static_cast<const ControlBlock* const*>(k[0]));
  a.site = *static_cast<const int32_t*>(k[1]);
  a.h = addr(*static_cast<void* const*>(k[2]));
  a.r = addr(*static_cast<const void* const*>(k[3]));
  a.d = *static_cast<const int32_t*>(k[4]);
  a.stride_h = *static_cast<const int64_t*>(k[5]);
  a.stride_r = *static_cast<const int64_t*>(k[6]);
  a.dtype = *static_cast<const int32_t*>(k[7]);
  a.ok = true;
  return a;
}

// Builds the launch of one spliced node and hands it to `use` while the argument storage
// is alive (the runtime copies the arguments during the call).
template <typename F>
void with_launch(Role role, const AnchorArgs& a, const Segment& s,
                 cudaGraphConditionalHandle handle, F&& use) {
  const ControlBlock* cb = ptr<const ControlBlock>(a.cb);
  int32_t site = s.site, op_index = s.op_index;
  int32_t n_rows = static_cast<int32_t>(a.grid_x);
  cudaKernelNodeParams p{};
  p.blockDim = dim3(kThreads);
  switch (role) {
    case Role::Op: {
      void* h = ptr<void>(a.h);
      const void* r = ptr<const void>(a.r);
      int32_t d = a.d, dtype = a.dtype;
      int64_t sh = a.stride_h, sr = a.stride_r;
      void* args[] = {&cb, &site, &op_index, &h, &r, &d, &sh, &sr, &dtype};
      p.func = const_cast<void*>(op_kernel_symbol());
      p.gridDim = dim3(a.grid_x);
      p.sharedMemBytes = a.smem;
      p.kernelParams = args;
      use(p);
      return;
    }
    case Role::Gate: {
      void* args[] = {&cb, &site, &op_index, &n_rows, &handle};
      p.func = const_cast<void*>(gate_kernel_symbol());
      p.gridDim = dim3(1);
      p.kernelParams = args;
      use(p);
      return;
    }
    case Role::CustomSelect:
    case Role::CustomFinish: {
      uint8_t* select = ptr<uint8_t>(s.custom_args.select);
      float* out = ptr<float>(s.custom_args.out);
      void* args[] = {&cb, &site, &op_index, &n_rows, &select, &out};
      p.func = const_cast<void*>(role == Role::CustomSelect ? custom_select_kernel_symbol()
                                                            : custom_finish_kernel_symbol());
      p.gridDim = dim3((a.grid_x + kThreads - 1) / kThreads);
      p.kernelParams = args;
      use(p);
      return;
    }
    case Role::CustomUser: {
      const CustomArgs& c = s.custom_args;
      xmix_custom_args x{};
      x.h = ptr<void>(a.h);
      x.r = ptr<const void>(a.r);
      x.stride_h = a.stride_h;
      x.stride_r = a.stride_r;
      x.n_rows = n_rows;
      x.d = a.d;
      x.dtype = a.dtype;
      x.n_params = c.n_params;
      x.select = ptr<const uint8_t>(c.select);
      x.tok_slot = ptr<const int32_t>(c.tok_slot);
      x.tok_pos = ptr<const int32_t>(c.tok_pos);
      x.slot_params = ptr<const float>(c.slot_params);
      x.param_base = c.param_base;
      x.artifact_numel = c.artifact_numel;
      x.artifact = ptr<const float>(c.artifact);
      x.out = ptr<float>(c.out);
      void* args[] = {&x};
      // A cudaKernel_t may stand where an entry function is expected (runtime API docs).
      p.func = ptr<void>(c.kernel);
      p.gridDim = dim3(a.grid_x);
      p.kernelParams = args;
      use(p);
      return;
    }
    default: throw std::logic_error("xmix graph patch: no kernel launch for this node role");
  }
}

struct IfRec {
  cudaGraphNode_t node = nullptr;
  cudaGraphConditionalHandle handle = 0;
  cudaGraph_t body = nullptr;
};

struct Info {
  NodeType type = NodeType::Unknown;
  Role role = Role::Foreign;
  MatchForm form = MatchForm::None;  // how a kernel node of ours was recognised
  int32_t parent = -1;
  AnchorArgs anchor;
};

}  // namespace

void nvtx_push(const std::string& message) {
  nvtxEventAttributes_t a{};
  a.version = NVTX_VERSION;
  a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.messageType = NVTX_MESSAGE_TYPE_ASCII;
  a.message.ascii = message.c_str();
  nvtxDomainRangePushEx(nvtx_domain(), &a);
}

void nvtx_pop() { nvtxDomainRangePop(nvtx_domain()); }

void nvtx_mark(const std::string& message) {
  nvtxEventAttributes_t a{};
  a.version = NVTX_VERSION;
  a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.messageType = NVTX_MESSAGE_TYPE_ASCII;
  a.message.ascii = message.c_str();
  nvtxDomainMarkEx(nvtx_domain(), &a);
}

bool conditionals_supported() {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return v >= 12030;
}

struct GraphPatch::Impl {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t own = nullptr;  // instantiate_own()
  bool own_is_torchs = false;     // the same address as torch's stale handle
  int32_t next_id = 0;
  std::unordered_map<cudaGraphNode_t, int32_t> ids;
  std::unordered_map<int32_t, cudaGraphNode_t> handles;
  std::unordered_map<int32_t, Info> info;      // cached classification per node id
  std::unordered_map<int32_t, IfRec> ifs;      // live IF nodes of ours, by id
  std::vector<IfRec> parked;
  std::unordered_set<cudaGraphNode_t> parked_nodes;
  std::vector<Splice> splices;
  std::unordered_map<int32_t, bool> enabled;   // exec state we want, per switchable node id
  std::vector<int32_t> pending;                // top-level nodes added by the apply under way

  int32_t id_of(cudaGraphNode_t n) {
    auto it = ids.find(n);
    if (it != ids.end()) return it->second;
    const int32_t id = next_id++;
    ids.emplace(n, id);
    handles.emplace(id, n);
    return id;
  }

  cudaGraphNode_t handle(int32_t id) const {
    auto it = handles.find(id);
    if (it == handles.end())
      throw std::logic_error("xmix graph patch: node " + std::to_string(id) +
                             " is not in the graph");
    return it->second;
  }

  void forget(int32_t id) {
    auto it = handles.find(id);
    if (it != handles.end()) {
      ids.erase(it->second);
      handles.erase(it);
    }
    info.erase(id);
    enabled.erase(id);
  }

  const Info& classify(int32_t id, cudaGraphNode_t n, int32_t parent) {
    auto it = info.find(id);
    if (it != info.end()) return it->second;
    Info inf;
    inf.parent = parent;
    cudaGraphNodeType t;
    XG_CHECK(cudaGraphNodeGetType(n, &t));
    inf.type = to_ir(t);
    if (t == cudaGraphNodeTypeKernel) classify_kernel(n, inf);
    return info.emplace(id, inf).first->second;
  }

  void classify_kernel(cudaGraphNode_t n, Info& inf) {
    cudaKernelNodeParams p{};
    // Kernels of other libraries may be unknown to this (static) runtime.
    const bool rt = cudaGraphKernelNodeGetParams(n, &p) == cudaSuccess;
    if (!rt) cudaGetLastError();
    CUDA_KERNEL_NODE_PARAMS_v2 drv{};
    bool have_drv = false;
    auto drv_params = [&]() -> const CUDA_KERNEL_NODE_PARAMS_v2* {
      if (!have_drv && driver().node_params)
        have_drv = driver().node_params(reinterpret_cast<CUgraphNode>(n), &drv) == CUDA_SUCCESS;
      return have_drv ? &drv : nullptr;
    };
    const KernelMatch m = symbols().known.match(rt ? p.func : nullptr, [&]() {
      return node_kernel_name(rt ? p.func : nullptr, drv_params());
    });
    inf.role = m.role;
    inf.form = m.form;
    if (m.role != Role::Anchor) return;
    if (rt) {
      inf.anchor = read_anchor(p.gridDim, p.blockDim, p.sharedMemBytes, p.kernelParams);
    } else if (const CUDA_KERNEL_NODE_PARAMS_v2* d = drv_params()) {
      inf.anchor = read_anchor(dim3(d->gridDimX, d->gridDimY, d->gridDimZ),
                               dim3(d->blockDimX, d->blockDimY, d->blockDimZ), d->sharedMemBytes,
                               d->kernelParams);
    }
  }

  void read_into(Graph& g, cudaGraph_t graph, int32_t parent) {
    for (cudaGraphNode_t n : graph_nodes(graph)) {
      if (parked_nodes.count(n)) continue;
      const int32_t id = id_of(n);
      const Info& inf = classify(id, n, parent);
      Node node;
      node.id = id;
      node.type = inf.type;
      node.role = inf.role;
      node.parent = parent;
      node.anchor = inf.anchor;
      auto e = enabled.find(id);
      node.enabled = e == enabled.end() ? true : e->second;
      g.nodes.push_back(node);
    }
    for (const RawEdge& e : graph_edges(graph)) {
      if (parked_nodes.count(e.from) || parked_nodes.count(e.to)) continue;
      g.edges.push_back({id_of(e.from), id_of(e.to), from_cuda(e.data)});
    }
  }

  Graph read() {
    Graph g;
    read_into(g, graph, -1);
    for (auto& [id, rec] : ifs) read_into(g, rec.body, id);
    g.splices = splices;
    return g;
  }

  // Removes an IF node of ours without destroying it (see the file comment).
  void park(int32_t id) {
    auto it = ifs.find(id);
    if (it == ifs.end()) throw std::logic_error("xmix graph patch: unknown IF node");
    IfRec rec = it->second;
    for (cudaGraphNode_t b : graph_nodes(rec.body)) {
      auto bid = ids.find(b);
      XG_CHECK(cudaGraphDestroyNode(b));
      if (bid != ids.end()) forget(bid->second);
    }
    for (int dir = 0; dir < 2; ++dir) {
      size_t n = 0;
      if (dir == 0)
        XG_CHECK(cudaGraphNodeGetDependencies(rec.node, nullptr, nullptr, &n));
      else
        XG_CHECK(cudaGraphNodeGetDependentNodes(rec.node, nullptr, nullptr, &n));
      if (!n) continue;
      std::vector<cudaGraphNode_t> other(n);
      std::vector<cudaGraphEdgeData> data(n);
      if (dir == 0)
        XG_CHECK(cudaGraphNodeGetDependencies(rec.node, other.data(), data.data(), &n));
      else
        XG_CHECK(cudaGraphNodeGetDependentNodes(rec.node, other.data(), data.data(), &n));
      std::vector<cudaGraphNode_t> self(n, rec.node);
      if (dir == 0)
        XG_CHECK(cudaGraphRemoveDependencies(graph, other.data(), self.data(), data.data(), n));
      else
        XG_CHECK(cudaGraphRemoveDependencies(graph, self.data(), other.data(), data.data(), n));
    }
    // An empty node keeps the parked body non-empty, the one shape every driver accepts.
    cudaGraphNode_t filler = nullptr;
    XG_CHECK(cudaGraphAddEmptyNode(&filler, rec.body, nullptr, 0));
    ifs.erase(it);
    forget(id);
    parked.push_back(rec);
    parked_nodes.insert(rec.node);
  }

  IfRec take_if() {
    if (!parked.empty()) {
      IfRec rec = parked.back();
      for (cudaGraphNode_t b : graph_nodes(rec.body)) XG_CHECK(cudaGraphDestroyNode(b));
      parked.pop_back();
      parked_nodes.erase(rec.node);
      return rec;
    }
    IfRec rec;
    // Default 0, re-applied at every launch: a disabled gate leaves the body skipped.
    XG_CHECK(cudaGraphConditionalHandleCreate(&rec.handle, graph, 0, cudaGraphCondAssignDefault));
    cudaGraphNodeParams cp{};
    cp.type = cudaGraphNodeTypeConditional;
    cp.conditional.handle = rec.handle;
    cp.conditional.type = cudaGraphCondTypeIf;
    cp.conditional.size = 1;
    XG_CHECK(cudaGraphAddNode(&rec.node, graph, nullptr, nullptr, 0, &cp));
    rec.body = cp.conditional.phGraph_out[0];
    return rec;
  }

  void remove_node(int32_t id) {
    auto it = info.find(id);
    if (it != info.end() && it->second.role == Role::If) {
      park(id);
      return;
    }
    XG_CHECK(cudaGraphDestroyNode(handle(id)));
    forget(id);
  }

  // Everything spliced goes; anchors run again. Used when an apply fails half-way.
  void restore_captured() {
    for (int32_t id : pending)
      if (handles.count(id)) remove_node(id);
    pending.clear();
    for (const Splice& sp : splices)
      for (const Segment& s : sp.segments)
        for (int32_t id : {s.gate, s.cond, s.op, s.sel, s.user, s.fin}) {
          if (id == -1 || !handles.count(id)) continue;
          auto it = info.find(id);
          if (it != info.end() && it->second.parent != -1) continue;  // goes with its IF
          remove_node(id);
        }
    splices.clear();
    for (auto& [id, on] : enabled) on = true;
  }

  const AnchorArgs& anchor_args(int32_t anchor) const {
    auto it = info.find(anchor);
    if (it == info.end() || it->second.role != Role::Anchor || !it->second.anchor.ok)
      throw std::logic_error("xmix graph patch: segment of an unknown anchor");
    return it->second.anchor;
  }

  cudaGraphConditionalHandle if_handle(int32_t cond) const {
    auto it = ifs.find(cond);
    return it == ifs.end() ? 0 : it->second.handle;
  }

  // An op node launches the op kernel with the anchor's dynamic shared memory (two rows of d
  // floats): opted in by static + dynamic size (xmix/smem.h), as a launch does.
  static void prepare_smem(Role role, const AnchorArgs& a) {
    if (role == Role::Op) XG_CHECK(static_cast<cudaError_t>(prepare_op_kernel_smem(a.d)));
  }

  bool apply(const Plan& plan, uint64_t exec_u) {
    cudaGraphExec_t exec = from_addr<cudaGraphExec_t>(exec_u);
    pending.clear();
    for (int32_t id : plan.remove) remove_node(id);

    // Fresh nodes: IF nodes first (their handles go into the gate kernels' arguments).
    std::vector<int32_t> fresh(plan.add.size(), -1);
    std::unordered_map<int32_t, const Splice*> new_splice;
    for (const Splice& sp : plan.splices) new_splice[sp.anchor] = &sp;
    auto resolve = [&](int32_t id) {
      if (!is_fresh(id)) return id;
      const int32_t r = fresh[fresh_index(id)];
      if (r < 0) throw std::logic_error("xmix graph patch: plan refers to a node it adds later");
      return r;
    };
    auto segment_of = [&](const NewNode& nn) -> const Segment& {
      auto it = new_splice.find(nn.anchor);
      if (it == new_splice.end() || nn.segment < 0 ||
          nn.segment >= static_cast<int32_t>(it->second->segments.size()))
        throw std::logic_error("xmix graph patch: added node without a segment");
      return it->second->segments[nn.segment];
    };
    for (size_t i = 0; i < plan.add.size(); ++i) {
      const NewNode& nn = plan.add[i];
      if (nn.role != Role::If) continue;
      IfRec rec = take_if();
      const int32_t id = id_of(rec.node);
      Info inf;
      inf.type = NodeType::Conditional;
      inf.role = Role::If;
      info[id] = inf;
      ifs[id] = rec;
      fresh[i] = id;
      pending.push_back(id);
    }
    for (size_t i = 0; i < plan.add.size(); ++i) {
      const NewNode& nn = plan.add[i];
      if (nn.role == Role::If) continue;
      const Segment& s = segment_of(nn);
      const AnchorArgs& a = anchor_args(nn.anchor);
      cudaGraph_t target = graph;
      int32_t parent = -1;
      if (nn.body_of >= 0) {
        parent = fresh[nn.body_of];
        target = ifs.at(parent).body;
      }
      const cudaGraphConditionalHandle h = s.cond != -1 ? if_handle(resolve(s.cond)) : 0;
      prepare_smem(nn.role, a);
      cudaGraphNode_t node = nullptr;
      with_launch(nn.role, a, s, h, [&](const cudaKernelNodeParams& p) {
        XG_CHECK(cudaGraphAddKernelNode(&node, target, nullptr, 0, &p));
      });
      const int32_t id = id_of(node);
      Info inf;
      inf.type = NodeType::Kernel;
      inf.role = nn.role;
      inf.parent = parent;
      info[id] = inf;
      fresh[i] = id;
      if (parent == -1) pending.push_back(id);
    }

    // Edges, per graph they live in (the top level or one IF body), one call each.
    std::unordered_map<cudaGraph_t, std::vector<RawEdge>> batches;
    for (const NewEdge& e : plan.edges) {
      const int32_t from = resolve(e.from), to = resolve(e.to);
      const int32_t pf = info.count(from) ? info[from].parent : -1;
      cudaGraph_t target = pf == -1 ? graph : ifs.at(pf).body;
      batches[target].push_back({handle(from), handle(to), to_cuda(e.data)});
    }
    for (auto& [target, v] : batches) {
      std::vector<cudaGraphNode_t> from, to;
      std::vector<cudaGraphEdgeData> data;
      for (auto& e : v) {
        from.push_back(e.from);
        to.push_back(e.to);
        data.push_back(e.data);
      }
      XG_CHECK(cudaGraphAddDependencies(target, from.data(), to.data(), data.data(), v.size()));
    }

    // Bookkeeping with real ids.
    std::vector<Splice> next;
    for (const Splice& sp : plan.splices) {
      Splice s = sp;
      s.anchor = resolve(s.anchor);
      for (Segment& seg : s.segments)
        for (int32_t* id : {&seg.gate, &seg.cond, &seg.op, &seg.sel, &seg.user, &seg.fin})
          if (*id != -1) *id = resolve(*id);
      next.push_back(std::move(s));
    }
    splices = std::move(next);
    pending.clear();

    const bool in_place = exec && !plan.needs_instantiate;
    for (const Repoint& rp : plan.repoint) {
      const Splice* sp = nullptr;
      for (const Splice& s : splices)
        if (s.anchor == resolve(rp.anchor)) sp = &s;
      if (!sp || rp.segment < 0 || rp.segment >= static_cast<int32_t>(sp->segments.size()))
        throw std::logic_error("xmix graph patch: repoint of an unknown segment");
      const Segment& s = sp->segments[rp.segment];
      const AnchorArgs& a = anchor_args(sp->anchor);
      const std::pair<int32_t, Role> parts[] = {{s.gate, Role::Gate},
                                                {s.op, Role::Op},
                                                {s.sel, Role::CustomSelect},
                                                {s.user, Role::CustomUser},
                                                {s.fin, Role::CustomFinish}};
      for (const auto& part : parts) {
        const int32_t id = part.first;
        const Role role = part.second;
        if (id == -1) continue;
        const bool top = info[id].parent == -1;
        with_launch(role, a, s, s.cond != -1 ? if_handle(s.cond) : 0,
                    [&](const cudaKernelNodeParams& p) {
                      XG_CHECK(cudaGraphKernelNodeSetParams(handle(id), &p));
                      if (in_place && top)
                        XG_CHECK(cudaGraphExecKernelNodeSetParams(exec, handle(id), &p));
                    });
      }
    }

    for (const Toggle& t : plan.enable) {
      const int32_t id = resolve(t.node);
      auto it = enabled.find(id);
      const bool changed = it == enabled.end() ? !t.enabled : it->second != t.enabled;
      enabled[id] = t.enabled;
      if (in_place && changed)
        XG_CHECK(cudaGraphNodeSetEnabled(exec, handle(id), t.enabled ? 1u : 0u));
    }
    return plan.needs_instantiate;
  }
};

GraphPatch::GraphPatch(uint64_t graph) : impl_(new Impl) {
  if (!graph) throw std::invalid_argument("xmix graph patch: null cudaGraph_t");
  impl_->graph = from_addr<cudaGraph_t>(graph);
}

GraphPatch::~GraphPatch() {
  if (impl_ && impl_->own && !impl_->own_is_torchs) {
    if (cudaGraphExecDestroy(impl_->own) != cudaSuccess) cudaGetLastError();
  }
}

namespace {
// What torch's CUDAGraph::instantiate() passes (aten/src/ATen/cuda/CUDAGraph.cpp).
constexpr unsigned long long kTorchInstantiateFlags =
    cudaGraphInstantiateFlagAutoFreeOnLaunch | cudaGraphInstantiateFlagUseNodePriority;
}  // namespace

std::string GraphPatch::try_instantiate() {
  NvtxRange r("xmix.graph.try_instantiate");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiateWithFlags(&exec, impl_->graph, kTorchInstantiateFlags);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
  }
  XG_CHECK(cudaGraphExecDestroy(exec));
  return "";
}

uint64_t GraphPatch::instantiate_own(uint64_t stale) {
  NvtxRange r("xmix.graph.instantiate_own");
  if (impl_->own && !impl_->own_is_torchs) XG_CHECK(cudaGraphExecDestroy(impl_->own));
  impl_->own = nullptr;
  cudaGraphExec_t exec = nullptr;
  XG_CHECK(cudaGraphInstantiateWithFlags(&exec, impl_->graph, kTorchInstantiateFlags));
  impl_->own = exec;
  impl_->own_is_torchs = addr(exec) == stale;
  bind(addr(exec));
  return addr(exec);
}

void GraphPatch::launch_own(uint64_t stream) {
  if (!impl_->own) throw std::logic_error("xmix graph patch: no executable graph of its own");
  XG_CHECK(cudaGraphLaunch(impl_->own, from_addr<cudaStream_t>(stream)));
}

uint64_t GraphPatch::own_exec() const { return addr(impl_->own); }

uint64_t GraphPatch::graph() const { return addr(impl_->graph); }

Graph GraphPatch::read() {
  NvtxRange r("xmix.graph.read");
  return impl_->read();
}

bool GraphPatch::apply(const Plan& plan, uint64_t exec) {
  NvtxRange r("xmix.graph.patch " + std::to_string(plan.n_anchors) + " anchors, +" +
              std::to_string(plan.add.size()) + " -" + std::to_string(plan.remove.size()) +
              " nodes" + (plan.fallback ? " (fallback: " + plan.reason + ")" : ""));
  try {
    return impl_->apply(plan, exec);
  } catch (...) {
    try {
      impl_->restore_captured();
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string("xmix graph patch: applying a plan failed and the "
                                           "graph could not be put back as captured: ") +
                               e.what());
    }
    throw;
  }
}

void GraphPatch::bind(uint64_t exec_u) {
  NvtxRange r("xmix.graph.bind");
  cudaGraphExec_t exec = from_addr<cudaGraphExec_t>(exec_u);
  if (!exec) throw std::invalid_argument("xmix graph patch: null cudaGraphExec_t");
  for (auto& [id, on] : impl_->enabled)
    if (impl_->handles.count(id))
      XG_CHECK(cudaGraphNodeSetEnabled(exec, impl_->handle(id), on ? 1u : 0u));
}

int GraphPatch::set_app_enabled(uint64_t exec_u, int32_t app, bool on) {
  NvtxRange r("xmix.graph.toggle app " + std::to_string(app) + (on ? " on" : " off"));
  cudaGraphExec_t exec = from_addr<cudaGraphExec_t>(exec_u);
  int touched = 0;
  for (Splice& sp : impl_->splices)
    for (Segment& s : sp.segments) {
      if (s.app != app) continue;
      s.enabled = on;
      std::vector<int32_t> ids = s.gated    ? std::vector<int32_t>{s.gate}
                                 : s.custom ? std::vector<int32_t>{s.sel, s.user, s.fin}
                                            : std::vector<int32_t>{s.op};
      for (int32_t id : ids) {
        impl_->enabled[id] = on;
        if (exec) XG_CHECK(cudaGraphNodeSetEnabled(exec, impl_->handle(id), on ? 1u : 0u));
        ++touched;
      }
    }
  return touched;
}

int GraphPatch::refresh_app_params(uint64_t exec_u, int32_t app) {
  NvtxRange r("xmix.graph.params app " + std::to_string(app));
  cudaGraphExec_t exec = from_addr<cudaGraphExec_t>(exec_u);
  if (!exec) throw std::invalid_argument("xmix graph patch: null cudaGraphExec_t");
  int updated = 0;
  for (const Splice& sp : impl_->splices) {
    const AnchorArgs& a = impl_->anchor_args(sp.anchor);
    for (const Segment& s : sp.segments) {
      if (s.app != app) continue;
      const std::pair<int32_t, Role> parts[] = {{s.gate, Role::Gate},
                                                {s.op, Role::Op},
                                                {s.sel, Role::CustomSelect},
                                                {s.user, Role::CustomUser},
                                                {s.fin, Role::CustomFinish}};
      for (const auto& part : parts) {
        const int32_t id = part.first;
        const Role role = part.second;
        if (id == -1 || impl_->info[id].parent != -1) continue;
        with_launch(role, a, s, s.cond != -1 ? impl_->if_handle(s.cond) : 0,
                    [&](const cudaKernelNodeParams& p) {
                      XG_CHECK(cudaGraphExecKernelNodeSetParams(exec, impl_->handle(id), &p));
                    });
        ++updated;
      }
    }
  }
  return updated;
}

void GraphPatch::set_anchor_config(uint64_t exec_u, bool anchors) {
  NvtxRange r(anchors ? "xmix.graph.config anchors" : "xmix.graph.config patched");
  if (!anchors) {
    bind(exec_u);
    return;
  }
  cudaGraphExec_t exec = from_addr<cudaGraphExec_t>(exec_u);
  if (!exec) throw std::invalid_argument("xmix graph patch: null cudaGraphExec_t");
  for (const Toggle& t : anchor_config(impl_->read()))
    if (impl_->handles.count(t.node))
      XG_CHECK(cudaGraphNodeSetEnabled(exec, impl_->handle(t.node), t.enabled ? 1u : 0u));
}

std::map<std::string, int> GraphPatch::anchor_forms() const {
  std::map<std::string, int> out;
  for (const auto& [id, inf] : impl_->info)
    if (inf.role == Role::Anchor) ++out[form_name(inf.form)];
  return out;
}

void copy_device(uint64_t dst, uint64_t src, uint64_t nbytes, uint64_t stream) {
  XG_CHECK(cudaMemcpyAsync(ptr<void>(dst), ptr<const void>(src), nbytes, cudaMemcpyDeviceToDevice,
                           from_addr<cudaStream_t>(stream)));
}

std::string GraphPatch::verify(const Graph& expected) {
  const std::string want = describe(expected), got = describe(impl_->read());
  if (want == got) return "";
  return "expected:\n" + want + "read back:\n" + got;
}

int32_t GraphPatch::n_segments() const {
  int32_t n = 0;
  for (const Splice& sp : impl_->splices) n += static_cast<int32_t>(sp.segments.size());
  return n;
}

int32_t GraphPatch::n_parked() const { return static_cast<int32_t>(impl_->parked.size()); }

bool GraphPatch::one_instance_at_a_time() const {
  return !impl_->ifs.empty() || !impl_->parked.empty();
}

}  // namespace xmix::graph
