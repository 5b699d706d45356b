// The site kernels' shared-memory decision (xmix/smem.h) at the hidden sizes models have.
#include <gtest/gtest.h>

#include "xmix/smem.h"

namespace {

using xmix::plan_smem;
using xmix::site_dynamic_smem;

constexpr size_t kStatic = 10176;      // xmix_site_anchor / xmix_op_kernel on sm_90 (cuobjdump)
constexpr size_t kOptinSm90 = 232448;  // cudaDevAttrMaxSharedMemoryPerBlockOptin on H100/H200

TEST(Smem, DynamicPartIsTwoRowsOfFloats) {
  EXPECT_EQ(site_dynamic_smem(4096), 32768u);
  EXPECT_EQ(site_dynamic_smem(0), 0u);
  EXPECT_EQ(site_dynamic_smem(-3), 0u);
}

TEST(Smem, UnderTheDefaultLimitNoOptIn) {
  const auto p = plan_smem(kStatic, site_dynamic_smem(4096), kOptinSm90);
  EXPECT_FALSE(p.opt_in);
  EXPECT_TRUE(p.fits);
  EXPECT_EQ(p.total(), 42944u);
}

TEST(Smem, StaticPlusDynamicDecidesTheOptIn) {
  // 5 120 (Qwen2.5-14B/32B, Llama-2-13B, Phi-4): 40 960 dynamic alone is under 48 KB, but with
  // the static arrays the block needs 51 136 bytes: without the opt-in the launch fails
  const auto p = plan_smem(kStatic, site_dynamic_smem(5120), kOptinSm90);
  EXPECT_LT(p.dynamic_bytes, xmix::kDefaultSmemPerBlock);
  EXPECT_TRUE(p.opt_in);
  EXPECT_TRUE(p.fits);
  // exactly at the default limit: no opt-in needed
  const auto edge = plan_smem(xmix::kDefaultSmemPerBlock - 1024, 1024, kOptinSm90);
  EXPECT_FALSE(edge.opt_in);
  EXPECT_TRUE(edge.fits);
  EXPECT_TRUE(plan_smem(xmix::kDefaultSmemPerBlock - 1024, 1028, kOptinSm90).opt_in);
}

TEST(Smem, TheFirstOptInRaisesTheAttributeEvenBelow48KB) {
  // d = 5 120: the opt-in's dynamic part (40 960) is under 48 KB, yet the attribute's default
  // is 48 KB less the static part; a process that has not raised it yet must (the first H200
  // run, 2026-12-04, launched without it: cudaErrorInvalidValue at capture)
  const auto p = plan_smem(kStatic, site_dynamic_smem(5120), kOptinSm90);
  EXPECT_TRUE(xmix::must_raise_attribute(p, 0));
  EXPECT_FALSE(xmix::must_raise_attribute(p, p.dynamic_bytes));
  EXPECT_TRUE(xmix::must_raise_attribute(plan_smem(kStatic, site_dynamic_smem(8192), kOptinSm90),
                                         p.dynamic_bytes));
  // no opt-in, nothing to raise
  EXPECT_FALSE(
      xmix::must_raise_attribute(plan_smem(kStatic, site_dynamic_smem(4096), kOptinSm90), 0));
}

TEST(Smem, LargeModelsFitAfterTheOptIn) {
  for (int32_t d : {6144, 8192, 12288, 16384, 18432}) {
    const auto p = plan_smem(kStatic, site_dynamic_smem(d), kOptinSm90);
    EXPECT_TRUE(p.opt_in) << d;
    EXPECT_TRUE(p.fits) << d;
    EXPECT_EQ(xmix::smem_refusal(d, p, kOptinSm90), "") << d;
  }
}

TEST(Smem, TooLargeIsRefusedNamingTheHiddenSize) {
  const auto p = plan_smem(kStatic, site_dynamic_smem(28672), kOptinSm90);
  EXPECT_TRUE(p.opt_in);
  EXPECT_FALSE(p.fits);
  const std::string why = xmix::smem_refusal(28672, p, kOptinSm90);
  EXPECT_NE(why.find("hidden size 28672"), std::string::npos) << why;
  EXPECT_NE(why.find("232448"), std::string::npos) << why;
  // a device without an opt-in above the default (limit 48 KB) refuses 5 120
  EXPECT_FALSE(plan_smem(kStatic, site_dynamic_smem(5120), 49152).fits);
}

}  // namespace
