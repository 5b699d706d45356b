// The site interpreter and condition evaluation on the CPU, on hand-built control blocks.
// Expected values are hand-computed.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "xmix/control.h"
#include "xmix/site.h"
#include "block.h"

using namespace xmix;

using namespace xmix_test;

TEST(Interpreter, AddTouchesOnlyRequestsThatUseTheApp) {
  Block b;
  b.request(0, 0, 0, 2, 0, 2);
  b.request(1, 1, 2, 1, 0, 1);
  b.slot_apps[0] = 1;  // slot 0 uses app 0, slot 1 does not
  b.slot_params[0 * Block::P + 0] = 2.f;
  const float v[Block::D] = {1, 2, 3, 4};
  b.ops.push_back(add_op(0, v, 0));
  b.site_first[1] = 0; b.site_count[1] = 1;
  std::vector<float> h(3 * Block::D, 1.f);
  run_site_cpu(b.build(3, 2), 1, h.data(), nullptr, 3, Block::D, Block::D, 0, DT_F32);
  EXPECT_FLOAT_EQ(h[0], 3.f);   // 1 + 2*1
  EXPECT_FLOAT_EQ(h[7], 9.f);   // token 1, dim 3: 1 + 2*4
  EXPECT_FLOAT_EQ(h[8], 1.f);   // token 2 (slot 1): untouched
  // other sites run nothing
  run_site_cpu(b.cb, 0, h.data(), nullptr, 3, Block::D, Block::D, 0, DT_F32);
  EXPECT_FLOAT_EQ(h[0], 3.f);
}

TEST(Interpreter, ModesOffAndAll) {
  Block b;
  b.request(0, 0, 0, 1, 0, 1);
  const float v[Block::D] = {1, 1, 1, 1};
  b.slot_params[0] = 1.f;
  b.ops.push_back(add_op(0, v, 0));
  b.site_count[0] = 1;
  std::vector<float> h(Block::D, 0.f);
  b.app_mode[0] = MODE_ALL;  // the request did not ask, mode all applies anyway
  run_site_cpu(b.build(1, 1), 0, h.data(), nullptr, 1, Block::D, Block::D, 0, DT_F32);
  EXPECT_FLOAT_EQ(h[0], 1.f);
  b.slot_apps[0] = 1;
  b.app_mode[0] = MODE_OFF;  // the request asks, but the app is off
  run_site_cpu(b.cb, 0, h.data(), nullptr, 1, Block::D, Block::D, 0, DT_F32);
  EXPECT_FLOAT_EQ(h[0], 1.f);
}

TEST(Interpreter, PaddingRowsAreNeverTouched) {
  Block b;
  b.request(0, 0, 0, 2, 0, 2);
  b.app_mode[0] = MODE_ALL;
  b.slot_params[0] = 1.f;
  const float v[Block::D] = {1, 1, 1, 1};
  b.ops.push_back(add_op(0, v, 0));
  b.site_count[0] = 1;
  std::vector<float> h(4 * Block::D, 0.f);  // 2 real rows + 2 padding rows
  run_site_cpu(b.build(2, 1), 0, h.data(), nullptr, 4, Block::D, Block::D, 0, DT_F32);
  EXPECT_FLOAT_EQ(h[0], 1.f);
  EXPECT_FLOAT_EQ(h[2 * Block::D], 0.f);
  EXPECT_FLOAT_EQ(h[3 * Block::D + 3], 0.f);
}

TEST(Conditions, FlagsAndOrNot) {
  Block b;
  b.request(0, 0, 0, 3, 0, 2);  // positions 0,1 prompt; 2 generated (and last)
  b.slot_apps[0] = 1;
  // (prompt and not last_token) or generated
  b.add_cond({C_FLAG, 1, 0, 0, C_FLAG, 3, 0, 0, C_NOT, 0, 0, 0, C_AND, 0, 0, 0,
              C_FLAG, 2, 0, 0, C_OR, 0, 0, 0});
  OpDesc op = add_op(0, nullptr, 0, 0, 6);
  b.build(3, 1);
  int32_t slot;
  EXPECT_TRUE(op_selects(b.cb, op, 0, &slot));
  EXPECT_TRUE(op_selects(b.cb, op, 1, &slot));
  EXPECT_TRUE(op_selects(b.cb, op, 2, &slot));
  // prompt and last_token: token 1 is the last prompt token but the chunk runs on, so no
  b.cond.clear();
  b.add_cond({C_FLAG, 1, 0, 0, C_FLAG, 3, 0, 0, C_AND, 0, 0, 0});
  b.build(3, 1);
  op.cond_len = 3;
  EXPECT_FALSE(op_selects(b.cb, op, 0, &slot));
  EXPECT_FALSE(op_selects(b.cb, op, 1, &slot));
  EXPECT_FALSE(op_selects(b.cb, op, 2, &slot));
}

TEST(Conditions, GateReadsThisTokensResult) {
  Block b;
  b.request(0, 0, 0, 3, 0, 3);
  b.slot_apps[0] = 1;
  b.slot_params[5] = 0.5f;  // threshold column
  b.results[0 * Block::R + 2] = 0.7f;
  b.results[1 * Block::R + 2] = 0.2f;
  b.results[2 * Block::R + 2] = NAN;  // the read did not run on token 2
  b.add_cond({C_GATE, 2, CMP_GE, 5});
  OpDesc op = add_op(0, nullptr, 0, 0, 1);
  b.build(3, 1);
  int32_t slot;
  EXPECT_TRUE(op_selects(b.cb, op, 0, &slot));
  EXPECT_FALSE(op_selects(b.cb, op, 1, &slot));
  EXPECT_FALSE(op_selects(b.cb, op, 2, &slot));
  b.cond[2] = CMP_NE;  // NaN is never "not equal" either
  EXPECT_FALSE(op_selects(b.cb, op, 2, &slot));
}

TEST(Conditions, LatchIsDecidedAtTheLastPromptToken) {
  Block b;
  // chunk: positions 0..2 of a 4-token prompt -> not decided anywhere in this chunk
  b.request(0, 0, 0, 3, 0, 4);
  b.slot_apps[0] = 1;
  b.slot_params[1] = 0.5f;
  float* st = &b.read_state[(0 * Block::R + 1) * kReadStateWidth];
  st[0] = 1.8f; st[1] = 3.f; st[2] = NAN;  // mean 0.6, no last value yet
  b.add_cond({C_LATCH, 1, CMP_GE | (RED_MEAN << 8), 1});
  OpDesc op = add_op(0, nullptr, 0, 0, 1);
  b.build(3, 1);
  int32_t slot;
  for (int t = 0; t < 3; ++t) EXPECT_FALSE(op_selects(b.cb, op, t, &slot)) << t;
  // next step: the last prompt token (position 3) and one more step with a generated token
  Block c = b;
  c.tok_slot.assign(Block::T, -1);
  c.request(0, 0, 0, 1, 3, 4);
  c.build(1, 1);
  EXPECT_TRUE(op_selects(c.cb, op, 0, &slot));
  Block g = b;
  g.tok_slot.assign(Block::T, -1);
  g.request(0, 0, 0, 1, 4, 4);
  g.build(1, 1);
  EXPECT_TRUE(op_selects(g.cb, op, 0, &slot));
  // prompt_last reads the last value: NaN -> false
  g.cond = {C_LATCH, 1, CMP_GE | (RED_LAST << 8), 1};
  g.build(1, 1);
  EXPECT_FALSE(op_selects(g.cb, op, 0, &slot));
}

TEST(Conditions, LatchFromGeneratedWaitsForTheFirstGeneratedToken) {
  // An op at or before the read's site: the last prompt token's forward runs it before the
  // read has seen that token, so the latch holds only from the first generated token.
  Block b;
  b.request(0, 0, 0, 1, 3, 4);  // the last prompt token of a 4-token prompt
  b.slot_apps[0] = 1;
  b.slot_params[1] = 0.5f;
  float* st = &b.read_state[(0 * Block::R + 1) * kReadStateWidth];
  st[0] = 1.8f; st[1] = 3.f; st[2] = 0.9f;  // mean 0.6 >= 0.5, last 0.9 >= 0.5
  b.add_cond({C_LATCH, 1, CMP_GE | (RED_MEAN << 8) | kLatchFromGenerated, 1});
  OpDesc op = add_op(0, nullptr, 0, 0, 1);
  b.build(1, 1);
  int32_t slot;
  EXPECT_FALSE(op_selects(b.cb, op, 0, &slot));
  Block g = b;
  g.tok_slot.assign(Block::T, -1);
  g.request(0, 0, 0, 1, 4, 4);  // the first generated token
  g.build(1, 1);
  EXPECT_TRUE(op_selects(g.cb, op, 0, &slot));
  // the reduce field is still read correctly next to the flag: prompt_last 0.9 < 0.95 -> false
  g.slot_params[1] = 0.95f;
  g.cond = {C_LATCH, 1, CMP_GE | (RED_LAST << 8) | kLatchFromGenerated, 1};
  g.build(1, 1);
  EXPECT_FALSE(op_selects(g.cb, op, 0, &slot));
  g.cond = {C_LATCH, 1, CMP_LT | (RED_LAST << 8) | kLatchFromGenerated, 1};
  g.build(1, 1);
  EXPECT_TRUE(op_selects(g.cb, op, 0, &slot));
}

TEST(Prologue, TokenSetsAndSpansAcrossSteps) {
  Block b;
  // set 0 = {5} (opener), set 1 = {6} (closer); span 0 = [set 0, set 1)
  b.sets[0 * 2 + 0] = 1u << 5;
  b.sets[1 * 2 + 0] = 1u << 6;
  b.span_def[0] = 0; b.span_def[1] = 1;
  b.request(0, 0, 0, 4, 0, 4);
  const int32_t ids1[4] = {1, 5, 2, 6};
  run_prologue_cpu(b.build(4, 1), ids1, 4);
  const uint32_t span_bit = 1u << kSpanBit0, set0 = 1u << kTokenSetBit0;
  EXPECT_EQ(b.tok_flags[0] & span_bit, 0u);
  EXPECT_EQ(b.tok_flags[1] & (span_bit | set0), span_bit | set0);  // the opener is inside
  EXPECT_NE(b.tok_flags[2] & span_bit, 0u);
  EXPECT_EQ(b.tok_flags[3] & span_bit, 0u);  // the closer is not
  // next step: opener then a token; the span state carries over in slot_span
  Block c = b;
  c.request(0, 0, 0, 1, 4, 4);
  const int32_t ids2[1] = {5};
  c.tok_flags[0] = TF_VALID | TF_GENERATED | TF_LAST;
  run_prologue_cpu(c.build(1, 1), ids2, 4);
  EXPECT_EQ(c.slot_span[0], 1u);
  Block d = c;
  d.request(0, 0, 0, 1, 5, 4);
  d.tok_flags[0] = TF_VALID | TF_GENERATED | TF_LAST;
  const int64_t ids3[1] = {2};
  run_prologue_cpu(d.build(1, 1), ids3, 8);
  EXPECT_NE(d.tok_flags[0] & span_bit, 0u);
  // a request restarting at position 0 (new or preempted) resets its state
  Block e = d;
  e.request(0, 0, 0, 1, 0, 4);
  const int32_t ids4[1] = {2};
  run_prologue_cpu(e.build(1, 1), ids4, 4);
  EXPECT_EQ(e.tok_flags[0] & span_bit, 0u);
  EXPECT_EQ(e.slot_span[0], 0u);
}

TEST(Reads, ProbeFeedsLatchStateOnPromptTokens) {
  Block b;
  b.request(0, 0, 0, 2, 0, 2);
  b.slot_apps[0] = 1;
  const float w[Block::D] = {1, 0, 0, 0};
  OpDesc op{};
  op.kind = OP_PROBE; op.app = 0; op.cond_begin = -1; op.param_base = 0; op.channel = 3;
  op.state_base = -1; op.n = Block::D; op.a0 = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(w));
  b.ops.push_back(op);
  b.site_count[0] = 1;
  b.slot_params[0] = 0.f;  // bias
  std::vector<float> h = {0, 9, 9, 9, 2, 9, 9, 9};
  run_site_cpu(b.build(2, 1), 0, h.data(), nullptr, 2, Block::D, Block::D, 0, DT_F32);
  const float s0 = 0.5f, s1 = 1.f / (1.f + std::exp(-2.f));
  EXPECT_FLOAT_EQ(b.results[0 * Block::R + 3], s0);
  EXPECT_FLOAT_EQ(b.results[1 * Block::R + 3], s1);
  const float* st = &b.read_state[(0 * Block::R + 3) * kReadStateWidth];
  EXPECT_FLOAT_EQ(st[0], s0 + s1);
  EXPECT_FLOAT_EQ(st[1], 2.f);
  EXPECT_FLOAT_EQ(st[2], s1);  // value at the last prompt token
}

TEST(Reads, ValidityFlagSaysWhereAReadRanEvenWhenItsValueIsNaN) {
  // request 0 (slot 0, 3 tokens) uses the app, request 1 (slot 1, 1 token) does not; token 1's
  // stream holds a NaN, so the probe's value there is NaN, and it still ran there.
  Block b;
  b.request(0, 0, 0, 3, 0, 3);
  b.request(1, 1, 3, 1, 0, 1);
  b.slot_apps[0] = 1;
  const float w[Block::D] = {1, 0, 0, 0};
  OpDesc op{};
  op.kind = OP_PROBE; op.app = 0; op.cond_begin = -1; op.param_base = 0; op.channel = 2;
  op.state_base = -1; op.n = Block::D; op.a0 = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(w));
  b.ops.push_back(op);
  b.site_count[0] = 1;
  std::vector<float> h = {0, 0, 0, 0, NAN, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  run_site_cpu(b.build(4, 2), 0, h.data(), nullptr, 4, Block::D, Block::D, 0, DT_F32);
  const auto valid = [&](int t) { return b.result_valid[t * Block::R + 2]; };
  EXPECT_EQ(valid(0), 1);
  EXPECT_EQ(valid(1), 1);
  EXPECT_TRUE(std::isnan(b.results[1 * Block::R + 2]));
  EXPECT_EQ(valid(2), 1);
  EXPECT_FLOAT_EQ(b.results[2 * Block::R + 2], 0.5f);
  EXPECT_EQ(valid(3), 0);  // request 1 does not use the app
  EXPECT_TRUE(std::isnan(b.results[3 * Block::R + 2]));
  // the NaN stays out of the latch sums: two prompt tokens counted
  const float* st = &b.read_state[(0 * Block::R + 2) * kReadStateWidth];
  EXPECT_FLOAT_EQ(st[1], 2.f);
  // switched off: the channel reports nothing, whatever it held
  b.app_mode[0] = MODE_OFF;
  run_site_cpu(b.build(4, 2), 0, h.data(), nullptr, 4, Block::D, Block::D, 0, DT_F32);
  for (int t = 0; t < 4; ++t) EXPECT_EQ(valid(t), 0) << t;
}

namespace {
int g_position_reads = 0;
// A user read kernel that reports each row's position, and throws from its second call on.
void position_then_throw(const xmix_custom_args* a) {
  if (++g_position_reads > 1) throw std::runtime_error("lookup table gone");
  for (int32_t t = 0; t < a->n_rows; ++t)
    if (a->select[t]) a->out[t] = static_cast<float>(a->tok_pos[t]);
}
}  // namespace

TEST(Reads, AReadThatFailsReportsNothingThatStep) {
  // Step 1: the read runs on request 0's two tokens (flags 1). Step 2: it throws; the flags
  // of step 1 must not stay, or the drain reports them for whoever holds those rows now.
  Block b;
  b.request(0, 0, 0, 2, 0, 2);
  b.slot_apps[0] = 1;
  OpDesc op{};
  op.kind = OP_CUSTOM; op.app = 0; op.cond_begin = -1; op.param_base = 0; op.channel = 1;
  op.state_base = -1;
  op.fn = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(&position_then_throw));
  b.ops.push_back(op);
  b.site_count[0] = 1;
  std::vector<float> h(2 * Block::D, 0.f);
  const auto valid = [&](int t) { return b.result_valid[t * Block::R + 1]; };
  g_position_reads = 0;
  auto failed = run_site_cpu(b.build(2, 1), 0, h.data(), nullptr, 2, Block::D, Block::D, 0, DT_F32);
  ASSERT_TRUE(failed.empty());
  EXPECT_EQ(valid(0), 1);
  EXPECT_EQ(valid(1), 1);
  EXPECT_FLOAT_EQ(b.results[1 * Block::R + 1], 1.f);
  failed = run_site_cpu(b.cb, 0, h.data(), nullptr, 2, Block::D, Block::D, 0, DT_F32);
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].app, 0);
  EXPECT_EQ(failed[0].what, "lookup table gone");
  EXPECT_EQ(valid(0), 0);
  EXPECT_EQ(valid(1), 0);
}
