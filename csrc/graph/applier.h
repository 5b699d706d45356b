// The CUDA side of graph interposition: reads a kept cudaGraph_t into the IR, performs a
// planner's Plan on it, and switches spliced nodes in an executable graph. Handles cross
// this interface as uint64 so the Python bindings need no CUDA header.
//
// Ownership: the cudaGraph_t and every cudaGraphExec_t belong to torch.cuda.CUDAGraph (the
// caller); every node and conditional handle xmix adds belongs to that graph and dies with
// it. A GraphPatch holds the bookkeeping (node handles per (graph, anchor, op)) and must not
// outlive the graph's use. The one CUDA object it may own is the executable graph of
// instantiate_own(), the last resort after torch's instantiate() failed (torch then keeps a
// destroyed handle as its own); the destructor destroys that, and nothing else. Compiled only
// with a CUDA toolkit (XMIX_WITH_CUDA).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "ir.h"

namespace xmix::graph {

// True when the driver runs IF conditional nodes set from the device (CUDA >= 12.3).
bool conditionals_supported();

class GraphPatch {
 public:
  explicit GraphPatch(uint64_t graph);
  ~GraphPatch();
  GraphPatch(const GraphPatch&) = delete;
  GraphPatch& operator=(const GraphPatch&) = delete;

  uint64_t graph() const;

  // The template graph as IR: node ids stay stable across calls; the nodes xmix spliced, the
  // bodies of its IF nodes and the exec states it set come from the bookkeeping.
  Graph read();

  // Performs `plan` (planned on what read() returned) on the template graph. With exec != 0
  // and a plan that needs no re-instantiation, the executable graph is updated in place
  // (cudaGraphExecKernelNodeSetParams, cudaGraphNodeSetEnabled). Returns
  // plan.needs_instantiate: the caller then instantiates and calls bind(). On a CUDA error
  // the template is put back as captured (spliced nodes removed, anchors enabled) and the
  // error is thrown.
  bool apply(const Plan& plan, uint64_t exec);

  // Pushes every recorded exec state (anchors off, ops per app mode) into a freshly
  // instantiated executable graph.
  void bind(uint64_t exec);

  // Switches every spliced node of one app on or off in `exec`; returns the nodes touched.
  int set_app_enabled(uint64_t exec, int32_t app, bool enabled);

  // Re-sends the kernel parameters of the app's top-level spliced nodes to `exec`
  // (cudaGraphExecKernelNodeSetParams); returns the nodes updated.
  int refresh_app_params(uint64_t exec, int32_t app);

  // The first-replay check (python/xmix/graphs.py): anchors = true switches `exec` to the
  // anchor configuration (planner.h anchor_config: every anchor on, built-in ops' top-level
  // nodes off, so their IF bodies stay skipped; user kernels' nodes as recorded, since the
  // anchor cannot run those) without changing the recorded states; false pushes the recorded
  // states back (as bind()).
  void set_anchor_config(uint64_t exec, bool anchors);

  // How the anchor nodes read so far were recognised: form name ("stub", "function",
  // "kernel", "name") -> count.
  std::map<std::string, int> anchor_forms() const;

  // Empty when read() matches `expected` structurally (planner.h describe()), else both
  // descriptions.
  std::string verify(const Graph& expected);

  // Instantiates the template with torch's flags (cudaGraphInstantiateFlagAutoFreeOnLaunch |
  // UseNodePriority) and destroys the result: empty when the driver accepts the template, else
  // the error. torch's instantiate() destroys the old executable graph before it tries, so a
  // template goes to torch only once the driver has accepted it here.
  std::string try_instantiate();

  // The last resort when torch's instantiate() failed on a template the driver had accepted
  // (torch's handle is then stale): an executable graph of the template owned by this object,
  // launched with launch_own(). `stale` is torch's handle: if the driver gave the new graph
  // the same address, torch's reset() will destroy it, and the destructor leaves it alone.
  uint64_t instantiate_own(uint64_t stale);
  void launch_own(uint64_t stream);
  uint64_t own_exec() const;

  int32_t n_segments() const;
  int32_t n_parked() const;  // IF nodes kept with an empty body (see applier.cu)
  // The template holds conditional nodes (live or parked IF nodes: they stay for the graph's
  // life). The runtime then allows one executable graph of it at a time: try_instantiate()
  // answers cudaErrorNotSupported while torch's (or our own) exists, whatever the template.
  bool one_instance_at_a_time() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Device-to-device copy of raw memory on `stream` (the check's snapshots of a graph's pool).
void copy_device(uint64_t dst, uint64_t src, uint64_t nbytes, uint64_t stream);

// NVTX ranges in the "xmix" domain (no-ops unless a tool such as Nsight is attached).
void nvtx_push(const std::string& message);
void nvtx_pop();
void nvtx_mark(const std::string& message);

}  // namespace xmix::graph
