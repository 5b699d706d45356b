// Shared memory of the site kernels (xmix_site_anchor, xmix_op_kernel): how much a launch at a
// hidden size needs and whether it must opt in above the default per-block limit.
//
// A block's shared memory is the kernel's static arrays (reductions, SAE candidate lists:
// about 10 KB on sm_90, read from the cubin with cuobjdump --dump-resource-usage) plus the
// dynamic part, two rows of d floats (the affine op's input and output). A launch whose total
// passes 48 KB fails unless the kernel opted in (cudaFuncAttributeMaxDynamicSharedMemorySize,
// which bounds the dynamic part only) up to the device's opt-in limit
// (cudaDevAttrMaxSharedMemoryPerBlockOptin: 227 KB on sm_90). Counting the dynamic part
// alone skipped the opt-in from d ~ 4 900 to 6 144 (5 120: Qwen2.5-14B/32B, Llama-2-13B,
// Phi-4): the capture failed and vLLM died at start. Plain C++: the decision is tested on
// the CPU (tests/cpp/test_smem.cpp, tests/unit/test_smem.py).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace xmix {

constexpr size_t kDefaultSmemPerBlock = 48 * 1024;

// Dynamic shared memory of a site kernel launch at hidden size (row width) d.
inline size_t site_dynamic_smem(int32_t d) {
  return static_cast<size_t>(d > 0 ? 2 * d : 0) * sizeof(float);
}

struct SmemPlan {
  size_t static_bytes = 0;
  size_t dynamic_bytes = 0;
  bool opt_in = false;  // set MaxDynamicSharedMemorySize = dynamic_bytes before launching
  bool fits = true;     // false: no launch can have this much on the device
  size_t total() const { return static_bytes + dynamic_bytes; }
};

inline SmemPlan plan_smem(size_t static_bytes, size_t dynamic_bytes, size_t optin_limit) {
  SmemPlan p;
  p.static_bytes = static_bytes;
  p.dynamic_bytes = dynamic_bytes;
  p.opt_in = p.total() > kDefaultSmemPerBlock;
  p.fits = p.total() <= (p.opt_in ? optin_limit : kDefaultSmemPerBlock);
  return p;
}

// Whether a launch must first raise the kernel's MaxDynamicSharedMemorySize attribute:
// `attribute` is what this process last set it to, 0 when never set (the default then allows
// 48 KB less the static part, which an opt-in plan's dynamic part never fits: starting from
// 48 KB here skipped the raise at d = 5 120, 40 960 dynamic bytes, and the launch failed with
// cudaErrorInvalidValue on an H200, 2026-12-04).
inline bool must_raise_attribute(const SmemPlan& p, size_t attribute) {
  return p.opt_in && p.dynamic_bytes > attribute;
}

// The refusal of a hidden size no launch can serve, naming it (empty when it fits).
inline std::string smem_refusal(int32_t d, const SmemPlan& p, size_t optin_limit) {
  if (p.fits) return "";
  return "xmix: hidden size " + std::to_string(d) + " needs " + std::to_string(p.total()) +
         " bytes of shared memory per block in the site kernels (" +
         std::to_string(p.static_bytes) + " static + " + std::to_string(p.dynamic_bytes) +
         " for two rows of " + std::to_string(d) +
         " floats), more than this GPU's opt-in limit of " + std::to_string(optin_limit) + " bytes";
}

}  // namespace xmix
