// What the native xmix::site CPU kernel (csrc/site/site_op_cpu.cpp) shares with Python: one
// host struct owned by numpy (xmix/runtime/control/native_site.py spells the same layout and checks
// its size against xmix_site_state_size()).
#pragma once
#include <cstdint>

namespace xmix {

// Failures kept per collection (one step): where and which app for the first 256, the message
// for the first 16 (the others say "see the first"); past 256 Python fails every app that ran.
constexpr int32_t kSiteOpMaxFailures = 256;
constexpr int32_t kSiteOpMaxMessages = 16;
constexpr int32_t kSiteOpFailureLen = 240;

struct SiteOpState {
  double seconds;  // host seconds spent in active site programs
  int64_t n_failed;  // failures since Python last collected them
  int32_t failed_site[kSiteOpMaxFailures];
  int32_t failed_app[kSiteOpMaxFailures];  // -1: the whole site did not run
  char failed_what[kSiteOpMaxMessages][kSiteOpFailureLen];
};

}  // namespace xmix
