// How the applier decides that a kernel node of a captured graph is one of xmix's kernels
// (csrc/graph/kernel_match.h): by any registered handle form first, by the exact mangled
// name only when no handle matches, and never by a name that merely contains ours.
#include <gtest/gtest.h>

#include <string>

#include "graph/kernel_match.h"

using namespace xmix::graph;

namespace {

// Stand-ins for the handles the runtime may report: distinct addresses, never dereferenced.
int stub_anchor, fn_anchor, kern_anchor, stub_op, fn_op, foreign_fn;

const char* kAnchorName = "_ZN4xmix12_GLOBAL__N_116xmix_site_anchorEPKNS_12ControlBlockEiPvPKviiii";
const char* kOpName = "_ZN4xmix12_GLOBAL__N_114xmix_op_kernelEPKNS_12ControlBlockEiiPvPKviiii";

KnownKernels ours() {
  KnownKernels k;
  k.add_handle(&stub_anchor, Role::Anchor, MatchForm::Stub);
  k.add_handle(&fn_anchor, Role::Anchor, MatchForm::Function);
  k.add_handle(&kern_anchor, Role::Anchor, MatchForm::Kernel);
  k.add_handle(&stub_op, Role::Op, MatchForm::Stub);
  k.add_handle(&fn_op, Role::Op, MatchForm::Function);
  k.add_name(kAnchorName, Role::Anchor);
  k.add_name(kOpName, Role::Op);
  return k;
}

}  // namespace

TEST(KernelMatch, EveryRegisteredHandleFormIsRecognisedAndReported) {
  const KnownKernels k = ours();
  int name_lookups = 0;
  auto no_name = [&]() -> const char* { ++name_lookups; return nullptr; };
  KernelMatch m = k.match(&stub_anchor, no_name);
  EXPECT_EQ(m.role, Role::Anchor);
  EXPECT_EQ(m.form, MatchForm::Stub);
  m = k.match(&fn_anchor, no_name);
  EXPECT_EQ(m.role, Role::Anchor);
  EXPECT_EQ(m.form, MatchForm::Function);
  m = k.match(&kern_anchor, no_name);
  EXPECT_EQ(m.role, Role::Anchor);
  EXPECT_EQ(m.form, MatchForm::Kernel);
  m = k.match(&fn_op, no_name);
  EXPECT_EQ(m.role, Role::Op);
  EXPECT_EQ(m.form, MatchForm::Function);
  EXPECT_EQ(name_lookups, 0) << "a handle match must not pay for a name lookup";
  EXPECT_STREQ(form_name(MatchForm::Kernel), "kernel");
  EXPECT_STREQ(form_name(MatchForm::Name), "name");
}

TEST(KernelMatch, AnUnknownHandleIsMatchedByItsExactMangledName) {
  const KnownKernels k = ours();
  int unknown_anchor_handle = 0;  // a handle from a module this runtime did not load
  KernelMatch m = k.match(&unknown_anchor_handle, [] { return kAnchorName; });
  EXPECT_EQ(m.role, Role::Anchor);
  EXPECT_EQ(m.form, MatchForm::Name);
  // no handle at all (the runtime could not read the node's parameters): the name decides
  m = k.match(nullptr, [] { return kOpName; });
  EXPECT_EQ(m.role, Role::Op);
  EXPECT_EQ(m.form, MatchForm::Name);
}

TEST(KernelMatch, ForeignKernelsStayForeign) {
  const KnownKernels k = ours();
  const std::string containing = std::string("my_") + kAnchorName + "_copy";
  const std::string other_sig = "_ZN4xmix12_GLOBAL__N_116xmix_site_anchorEPKNS_12ControlBlockEi";
  for (const char* name : {"_Z22vectorized_elementwise", containing.c_str(), other_sig.c_str(), "",
                           static_cast<const char*>(nullptr)}) {
    const KernelMatch m = k.match(&foreign_fn, [&] { return name; });
    EXPECT_EQ(m.role, Role::Foreign) << (name ? name : "(null)");
    EXPECT_EQ(m.form, MatchForm::None);
  }
}

TEST(KernelMatch, WithoutNamesOnlyHandlesDecide) {
  KnownKernels k;
  k.add_handle(&stub_anchor, Role::Anchor, MatchForm::Stub);
  EXPECT_FALSE(k.has_names());
  int lookups = 0;
  const KernelMatch m = k.match(&foreign_fn, [&]() -> const char* { ++lookups; return kAnchorName; });
  EXPECT_EQ(m.role, Role::Foreign);
  EXPECT_EQ(lookups, 0);
}

TEST(KernelMatch, TheFirstRegistrationOfAHandleWins) {
  KnownKernels k;
  // a runtime that returns the stub itself as the cudaFunction_t
  k.add_handle(&stub_anchor, Role::Anchor, MatchForm::Stub);
  k.add_handle(&stub_anchor, Role::Anchor, MatchForm::Function);
  k.add_handle(nullptr, Role::Op, MatchForm::Kernel);  // a form the runtime could not give
  EXPECT_EQ(k.by_handle(&stub_anchor).form, MatchForm::Stub);
  EXPECT_EQ(k.by_handle(nullptr).role, Role::Foreign);
}
