// Recognising xmix's own kernels among a captured graph's kernel nodes. The runtime reports a
// kernel node's function in one of several forms (the host stub, a cudaFunction_t, a
// cudaKernel_t, or a handle of a module this runtime did not load, e.g. when the kernel was
// loaded lazily or launched through another copy of the runtime); the applier registers
// every form it can get for each of its kernels and, when no handle matches, compares the
// kernel's mangled name. The decision is here, free of CUDA headers, so GoogleTest covers it
// on a machine without a GPU (tests/cpp/test_kernel_match.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>

#include "ir.h"

namespace xmix::graph {

enum class MatchForm : uint8_t { None, Stub, Function, Kernel, Name };

inline const char* form_name(MatchForm f) {
  switch (f) {
    case MatchForm::Stub: return "stub";
    case MatchForm::Function: return "function";
    case MatchForm::Kernel: return "kernel";
    case MatchForm::Name: return "name";
    default: return "none";
  }
}

struct KernelMatch {
  Role role = Role::Foreign;
  MatchForm form = MatchForm::None;
};

class KnownKernels {
 public:
  // A handle of one of our kernels in one form. The first registration of a handle wins: a
  // runtime may return the stub itself as its cudaFunction_t, and the stub is the better
  // name for it in logs.
  void add_handle(const void* handle, Role role, MatchForm form) {
    if (handle) handles_.emplace(handle, KernelMatch{role, form});
  }

  // The kernel's mangled name as the runtime reports it (cudaFuncGetName on the stub). The
  // mangled name encodes the parameter types, so a name match also says the node's
  // arguments have the layout the applier reads.
  void add_name(const char* name, Role role) {
    if (name && *name) names_.emplace(name, role);
  }

  bool has_names() const { return !names_.empty(); }

  KernelMatch by_handle(const void* func) const {
    auto it = handles_.find(func);
    return it == handles_.end() ? KernelMatch{} : it->second;
  }

  // Exact equality only: a kernel of another library whose name contains one of ours (say
  // "my_xmix_op_kernel_copy") is not ours.
  KernelMatch by_name(const char* name) const {
    if (!name || !*name) return {};
    auto it = names_.find(name);
    return it == names_.end() ? KernelMatch{} : KernelMatch{it->second, MatchForm::Name};
  }

  // Handle first; the name only when no handle matched (looking a name up costs a driver
  // call, and most nodes of a graph are not ours). `name_of()` returns the node's kernel
  // name or nullptr when none can be had.
  template <typename NameOf>
  KernelMatch match(const void* func, NameOf&& name_of) const {
    KernelMatch m = func ? by_handle(func) : KernelMatch{};
    if (m.role != Role::Foreign || names_.empty()) return m;
    return by_name(name_of());
  }

 private:
  std::unordered_map<const void*, KernelMatch> handles_;
  std::unordered_map<std::string, Role> names_;
};

}  // namespace xmix::graph
