// What a node that does nothing costs in a CUDA graph, by where it sits: the question behind
// xmix's unused-app cost on a GPU (docs/cuda_graphs.md, Results). A chain of K work kernels
// (a memory pass each, a few microseconds, as the decoder's kernels) is captured with an
// "anchor" kernel between every two of them, as xmix's sites sit between vLLM's kernels, and
// replayed in five forms from the same capture:
//
//   plain      the chain captured without anchors
//   enabled    anchors in the chain, enabled (each launches and returns at once)
//   disabled   anchors in the chain, disabled in the executable graph (what xmix does with an
//              anchor whose site has nothing deployed: plan rule 1)
//   leaf       anchors disabled, their outgoing edge replaced by one from their predecessor to
//              their successor (each anchor a leaf off the chain)
//   removed    anchors destroyed, predecessor joined to successor
//
// Twice: with plain launches, and with the work kernels launched for programmatic dependent
// launch (PDL: cudaLaunchAttributeProgrammaticStreamSerialization, the kernel waiting in
// cudaGridDependencySynchronize), as cuBLAS and others launch on Hopper: there an anchor's
// full edges also take away the overlap of one kernel's launch with the previous one's tail.
// The joined edge (leaf, removed) copies the anchor's outgoing edge, as a planner would.
// Prints microseconds per replay (median of rounds) and per anchor against plain.
//
//   nvcc -O2 -arch=sm_90 bench/graph_node_cost.cu -o build/device/graph_node_cost
//   build/device/graph_node_cost [K=96] [rounds=7] [replays=50]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(call)                                                                         \
  do {                                                                                   \
    cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call,                  \
                   cudaGetErrorString(e_));                                              \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

__global__ void work(float* __restrict__ dst, const float* __restrict__ src, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    dst[i] = src[i] * 1.0001f + 1.f;
}

__global__ void work_pdl(float* __restrict__ dst, const float* __restrict__ src, int n) {
  cudaGridDependencySynchronize();
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    dst[i] = src[i] * 1.0001f + 1.f;
}

// An anchor with nothing deployed: reads one flag and returns.
__global__ void anchor(const int* __restrict__ flag, float* __restrict__ h) {
  if (*flag) h[threadIdx.x] += 1.f;
}

namespace {

constexpr int kN = 1 << 21;  // 8 MB of floats per pass

float time_exec(cudaGraphExec_t exec, cudaStream_t s, int rounds, int replays) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(exec, s));
  std::vector<float> us;
  for (int r = 0; r < rounds; ++r) {
    CK(cudaEventRecord(a, s));
    for (int i = 0; i < replays; ++i) CK(cudaGraphLaunch(exec, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, a, b));
    us.push_back(ms * 1000.f / static_cast<float>(replays));
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// Captures K work kernels, with an anchor before each when `anchors`; returns the graph and,
// in order, the anchor nodes.
cudaGraph_t capture(int K, bool anchors, bool pdl, cudaStream_t s, float* x, float* y, int* flag,
                    std::vector<cudaGraphNode_t>* anchor_nodes) {
  cudaGraph_t g = nullptr;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int k = 0; k < K; ++k) {
    if (anchors) anchor<<<1, 32, 0, s>>>(flag, y);
    float* dst = k % 2 ? x : y;
    const float* src = k % 2 ? y : x;
    if (!pdl) {
      work<<<528, 256, 0, s>>>(dst, src, kN);
      continue;
    }
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(528);
    cfg.blockDim = dim3(256);
    cfg.stream = s;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, work_pdl, dst, src, static_cast<int>(kN)));
  }
  CK(cudaStreamEndCapture(s, &g));
  if (anchor_nodes) {
    size_t n = 0;
    CK(cudaGraphGetNodes(g, nullptr, &n));
    std::vector<cudaGraphNode_t> nodes(n);
    CK(cudaGraphGetNodes(g, nodes.data(), &n));
    for (cudaGraphNode_t node : nodes) {
      cudaKernelNodeParams p{};
      cudaGraphNodeType t;
      CK(cudaGraphNodeGetType(node, &t));
      if (t != cudaGraphNodeTypeKernel) continue;
      CK(cudaGraphKernelNodeGetParams(node, &p));
      if (p.func == reinterpret_cast<void*>(&anchor)) anchor_nodes->push_back(node);
    }
  }
  return g;
}

// The one predecessor and the one successor of a node of the captured chain (nullptr: none),
// and the data of the edge to the successor.
void neighbours(cudaGraphNode_t node, cudaGraphNode_t* pred, cudaGraphNode_t* succ,
                cudaGraphEdgeData* out_edge) {
  size_t n = 1;
  *pred = *succ = nullptr;
  *out_edge = cudaGraphEdgeData{};
  CK(cudaGraphNodeGetDependencies(node, pred, nullptr, &n));
  if (n == 0) *pred = nullptr;
  n = 1;
  CK(cudaGraphNodeGetDependentNodes(node, succ, out_edge, &n));
  if (n == 0) *succ = nullptr;
}

// pred -> succ with the anchor's outgoing edge data where pred is a kernel (a programmatic
// edge must leave a kernel node), else a full edge.
void join(cudaGraph_t g, cudaGraphNode_t p, cudaGraphNode_t q, cudaGraphEdgeData e) {
  cudaGraphNodeType t;
  CK(cudaGraphNodeGetType(p, &t));
  if (t != cudaGraphNodeTypeKernel) e = cudaGraphEdgeData{};
  CK(cudaGraphAddDependencies(g, &p, &q, &e, 1));
}

cudaGraphExec_t instantiate(cudaGraph_t g) {
  cudaGraphExec_t e = nullptr;
  CK(cudaGraphInstantiateWithFlags(&e, g, 0));
  return e;
}

}  // namespace

int main(int argc, char** argv) {
  const int K = argc > 1 ? std::atoi(argv[1]) : 96;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  const int replays = argc > 3 ? std::atoi(argv[3]) : 50;
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  int driver = 0, runtime = 0;
  CK(cudaDriverGetVersion(&driver));
  CK(cudaRuntimeGetVersion(&runtime));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  float *x, *y;
  int* flag;
  CK(cudaMalloc(&x, kN * sizeof(float)));
  CK(cudaMalloc(&y, kN * sizeof(float)));
  CK(cudaMalloc(&flag, sizeof(int)));
  CK(cudaMemset(x, 0, kN * sizeof(float)));
  CK(cudaMemset(y, 0, kN * sizeof(float)));
  CK(cudaMemset(flag, 0, sizeof(int)));

  for (int pdl = 0; pdl < 2; ++pdl) {
    cudaGraph_t plain = capture(K, false, pdl, s, x, y, flag, nullptr);
    std::vector<cudaGraphNode_t> an;
    cudaGraph_t with = capture(K, true, pdl, s, x, y, flag, &an);
    if (static_cast<int>(an.size()) != K) {
      std::fprintf(stderr, "found %zu anchor nodes, expected %d\n", an.size(), K);
      return 1;
    }
    cudaGraphExec_t e_plain = instantiate(plain);
    cudaGraphExec_t e_enabled = instantiate(with);
    cudaGraphExec_t e_disabled = instantiate(with);  // a graph without conditionals: two instances
    for (cudaGraphNode_t a : an) CK(cudaGraphNodeSetEnabled(e_disabled, a, 0));

    // leaf: anchor -> successor replaced by predecessor -> successor
    cudaGraph_t leaf = nullptr;
    CK(cudaGraphClone(&leaf, with));
    std::vector<cudaGraphNode_t> an_leaf;
    for (cudaGraphNode_t a : an) {
      cudaGraphNode_t c = nullptr;
      CK(cudaGraphNodeFindInClone(&c, a, leaf));
      an_leaf.push_back(c);
    }
    for (cudaGraphNode_t a : an_leaf) {
      cudaGraphNode_t p, q;
      cudaGraphEdgeData e;
      neighbours(a, &p, &q, &e);
      if (q) CK(cudaGraphRemoveDependencies(leaf, &a, &q, &e, 1));
      if (p && q) join(leaf, p, q, e);
    }
    cudaGraphExec_t e_leaf = instantiate(leaf);
    for (cudaGraphNode_t a : an_leaf) CK(cudaGraphNodeSetEnabled(e_leaf, a, 0));

    // removed: anchors destroyed, predecessor joined to successor
    cudaGraph_t removed = nullptr;
    CK(cudaGraphClone(&removed, with));
    for (cudaGraphNode_t a : an) {
      cudaGraphNode_t c = nullptr, p, q;
      cudaGraphEdgeData e;
      CK(cudaGraphNodeFindInClone(&c, a, removed));
      neighbours(c, &p, &q, &e);
      CK(cudaGraphDestroyNode(c));
      if (p && q) join(removed, p, q, e);
    }
    cudaGraphExec_t e_removed = instantiate(removed);

    std::printf("graph_node_cost: %s, driver %d, runtime %d; chain of %d work kernels (8 MB pass "
                "each, %s launches), %d anchors; median of %d rounds of %d replays\n",
                prop.name, driver, runtime, K, pdl ? "PDL" : "plain", K, rounds, replays);
    struct Row {
      const char* name;
      cudaGraphExec_t e;
    } rows[] = {{"plain", e_plain},
                {"enabled", e_enabled},
                {"disabled", e_disabled},
                {"leaf", e_leaf},
                {"removed", e_removed}};
    // interleaved rounds: each form measured once per pass, passes repeated
    std::vector<std::vector<float>> t(5);
    for (int pass = 0; pass < 3; ++pass)
      for (int i = 0; i < 5; ++i) t[i].push_back(time_exec(rows[i].e, s, rounds, replays));
    float base = 0.f;
    for (int i = 0; i < 5; ++i) {
      std::sort(t[i].begin(), t[i].end());
      const float us = t[i][1];
      if (i == 0) base = us;
      std::printf("  %-9s %9.1f us per replay  %+7.1f us  %+6.3f us per anchor\n", rows[i].name, us,
                  us - base, (us - base) / static_cast<float>(K));
    }
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
