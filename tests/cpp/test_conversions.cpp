// Scalar conversions shared by both twins: round-to-nearest-even like torch's .to(dtype).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "xmix/control.h"

using namespace xmix;

TEST(Conversions, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 is exactly half-way between two bf16 values (1 and 1 + 2^-7): ties to even = 1.
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // Slightly above half-way rounds up.
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3f81);
  EXPECT_FLOAT_EQ(bf16_to_float(0x3fc0), 1.5f);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
}

TEST(Conversions, F16KnownValues) {
  EXPECT_EQ(float_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(1e6f), 0x7c00);                 // overflow to +inf
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -24)), 0x0001); // smallest subnormal
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -26)), 0x0000); // below half of it: zero
  EXPECT_FLOAT_EQ(f16_to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_FLOAT_EQ(f16_to_float(0x3555), 0.333251953125f);
  // 1 + 2^-11 is half-way between 1 and 1 + 2^-10: ties to even = 1.
  EXPECT_EQ(float_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(float_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
}

TEST(Conversions, F16RoundTripsEveryFiniteValue) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    if (((h >> 10) & 0x1f) == 0x1f) continue;  // inf / NaN
    EXPECT_EQ(float_to_f16(f16_to_float(h)), h) << "bits " << b;
  }
}

namespace {
int seven(int x) { return 7 * x; }
}  // namespace

// Addresses cross the Python boundary as uint64 (control.h): ptr, from_addr and addr give back
// the very object or function, and addr is the address's integer value.
TEST(Conversions, AddressesRoundTripThroughUint64) {
  float data[4] = {1.f, 2.f, 3.f, 4.f};
  const uint64_t a = addr(&data[2]);
  EXPECT_EQ(a, static_cast<uint64_t>(reinterpret_cast<uintptr_t>(data)) + 2 * sizeof(float));
  EXPECT_EQ(ptr<float>(a), &data[2]);
  EXPECT_EQ(ptr<const float>(a)[1], 4.f);
  EXPECT_EQ(ptr<void>(addr(static_cast<void*>(data))), static_cast<void*>(data));
  EXPECT_EQ(ptr<float>(0), nullptr);
  using Fn = int (*)(int);
  EXPECT_EQ(from_addr<Fn>(addr(&seven))(6), 42);
}
