// xmix::site's CPU kernel, registered with PyTorch's dispatcher (xmix/_site_op.so).
//
// Every active hook site of a CPU engine calls torch.ops.xmix.site once per step; with this
// kernel the call goes from the dispatcher straight into the site program (run_site_cpu) with
// no Python in between. The op itself is defined in Python (xmix/runtime/ops.py, with its fake for
// torch.compile); this library only registers the CPU implementation. It is built against
// PyTorch's stable ABI (torch/csrc/stable), so it links none of libtorch's C++ symbols: like
// xmix._C, one build serves every torch from the targeted version on.
//
// Python binds the process's control block and two host buffers owned by numpy (which sites
// have an active app this step; SiteOpState below) through xmix_site_bind. A failing op is
// recorded in SiteOpState, not thrown: the forward goes on, and Python collects the failures
// after it (ControlBlock.collect_site_failures), as it does on the GPU.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <string>

#include "xmix/site.h"
#include "xmix/site_op.h"

#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define XMIX_HAVE_CALLGRIND 1
#else
#define XMIX_HAVE_CALLGRIND 0
#endif

namespace xmix {
namespace {

using torch::stable::Tensor;

struct Bound {
  const ControlBlock* cb = nullptr;
  const uint8_t* active = nullptr;  // per site: 1 when an app of this step has an op there
  int32_t n_sites = 0;
  SiteOpState* state = nullptr;
};

// Written by xmix_site_bind while no forward runs (the worker binds before its first step);
// read by every site call.
std::atomic<Bound*> g_bound{nullptr};
Bound g_slots[2];
std::mutex g_failure_mu;

void record(SiteOpState* st, int32_t site, int32_t app, const char* what) {
  std::lock_guard<std::mutex> lock(g_failure_mu);
  const int64_t i = st->n_failed++;
  if (i >= kSiteOpMaxFailures) return;  // counted: Python fails every app that ran
  st->failed_site[i] = site;
  st->failed_app[i] = app;
  if (i >= kSiteOpMaxMessages) return;
  std::strncpy(st->failed_what[i], what, kSiteOpFailureLen - 1);
  st->failed_what[i][kSiteOpFailureLen - 1] = '\0';
}

int32_t dtype_of(const Tensor& t, bool* ok) {
  *ok = true;
  switch (t.scalar_type()) {
    case torch::headeronly::ScalarType::Float: return DT_F32;
    case torch::headeronly::ScalarType::BFloat16: return DT_BF16;
    case torch::headeronly::ScalarType::Half: return DT_F16;
    default: *ok = false; return -1;
  }
}

// The same checks and row geometry as xmix/runtime/ops.py's _args (the Python reference kernel).
bool geometry(const Tensor& h, const std::optional<Tensor>& r, int32_t* n, int32_t* d, int64_t* sh,
              int64_t* sr, const void** rp, int32_t* dt, std::string* why) {
  bool ok;
  *dt = dtype_of(h, &ok);
  if (!ok) {
    *why = "hook site on an unsupported dtype; supported: fp32, bf16, fp16";
    return false;
  }
  const int64_t dim = h.dim();
  const int64_t dd = dim ? h.size(dim - 1) : 1;
  const int64_t numel = h.numel();
  const int64_t rows = dd ? numel / dd : 0;
  const int64_t s_last = dim ? h.stride(dim - 1) : 1;
  const int64_t s_row = dim > 1 ? h.stride(dim - 2) : dd;
  if (s_last != 1 || (dim > 1 && s_row != dd && rows > 1)) {
    *why = "hook site needs rows of contiguous elements";
    return false;
  }
  *n = static_cast<int32_t>(rows);
  *d = static_cast<int32_t>(dd);
  *sh = s_row;
  *sr = 0;
  *rp = nullptr;
  if (r.has_value()) {
    const Tensor& rt = *r;
    bool same = rt.scalar_type() == h.scalar_type() && rt.dim() == dim;
    for (int64_t i = 0; same && i < dim; ++i) same = rt.size(i) == h.size(i);
    if (!same) {
      *why = "residual must match hidden states in shape and dtype";
      return false;
    }
    *sr = dim > 1 ? rt.stride(dim - 2) : dd;
    *rp = rt.const_data_ptr();
  }
  return true;
}

void site_cpu(Tensor h, std::optional<Tensor> r, int64_t site) {
  const Bound* b = g_bound.load(std::memory_order_acquire);
  if (b == nullptr || site < 0 || site >= b->n_sites || !b->active[site]) return;
  const auto t0 = std::chrono::steady_clock::now();
  int32_t n, d, dt;
  int64_t sh, sr;
  const void* rp;
  std::string why;
  if (!geometry(h, r, &n, &d, &sh, &sr, &rp, &dt, &why)) {
    // nothing of the site ran: every app with an op here fails its requests, not the step
    record(b->state, static_cast<int32_t>(site), -1, why.c_str());
  } else {
    try {
      for (const SiteFailure& f : run_site_cpu(*b->cb, static_cast<int32_t>(site),
                                               h.mutable_data_ptr(), rp, n, d, sh, sr, dt))
        record(b->state, static_cast<int32_t>(site), f.app, f.what.c_str());
    } catch (const std::exception& e) {
      record(b->state, static_cast<int32_t>(site), -1, e.what());
    }
  }
  b->state->seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace
}  // namespace xmix

extern "C" {

// Binds the control block and the host buffers (or unbinds, with cb == 0). Not thread-safe
// against a running forward: the worker calls it between steps.
__attribute__((visibility("default"))) int32_t xmix_site_bind(uint64_t cb, uint64_t active,
                                                              int32_t n_sites, uint64_t state) {
  using namespace xmix;
  if (cb == 0) {
    g_bound.store(nullptr, std::memory_order_release);
    return 0;
  }
  Bound* next = &g_slots[g_bound.load() == &g_slots[0] ? 1 : 0];
  next->cb = ptr<const ControlBlock>(cb);
  next->active = ptr<const uint8_t>(active);
  next->n_sites = n_sites;
  next->state = ptr<SiteOpState>(state);
  g_bound.store(next, std::memory_order_release);
  return 0;
}

// sizeof(SiteOpState): Python checks its numpy layout against it before binding.
__attribute__((visibility("default"))) int64_t xmix_site_state_size() {
  return static_cast<int64_t>(sizeof(xmix::SiteOpState));
}

// Instruction counts of a stretch of the caller's work (bench/step_host.py --instructions): under
// `valgrind --tool=callgrind --collect-atstart=no`, start zeroes the counters and turns
// collection on, stop turns it off and dumps a part file labelled `label`. Valgrind's client
// requests are a few no-op instructions outside valgrind; without its header at build time
// they are absent and xmix_cg_available() says so.
__attribute__((visibility("default"))) int32_t xmix_cg_available() {
#if XMIX_HAVE_CALLGRIND
  return 1;
#else
  return 0;
#endif
}

__attribute__((visibility("default"))) void xmix_cg_start() {
#if XMIX_HAVE_CALLGRIND
  CALLGRIND_ZERO_STATS;
  CALLGRIND_TOGGLE_COLLECT;
#endif
}

__attribute__((visibility("default"))) void xmix_cg_stop(const char* label) {
#if XMIX_HAVE_CALLGRIND
  CALLGRIND_TOGGLE_COLLECT;
  CALLGRIND_DUMP_STATS_AT(label);
#else
  (void)label;
#endif
}

}  // extern "C"

STABLE_TORCH_LIBRARY_IMPL(xmix, CPU, m) { m.impl("site", TORCH_BOX(&xmix::site_cpu)); }
