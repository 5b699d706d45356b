// The site interpreter and condition evaluation on the CPU, on hand-built control blocks.
// Expected values are hand-computed.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "xmix/control.h"
#include "xmix/site.h"

using namespace xmix;

namespace {

// A control block over std::vectors: 2 layers (13 sites), up to 8 tokens, 4 slots.
struct Block {
  static constexpr int T = 8, S = 4, P = 8, R = 4, A = 4, D = 4, SITES = 13;
  std::vector<int32_t> tok_slot = std::vector<int32_t>(T, -1), tok_pos = std::vector<int32_t>(T, 0);
  std::vector<uint32_t> tok_flags = std::vector<uint32_t>(T, 0);
  std::vector<int32_t> tok_row = std::vector<int32_t>(T, -1);
  std::vector<int32_t> row_slot = std::vector<int32_t>(S, 0), row_tok_start = std::vector<int32_t>(S, 0),
                       row_n_tok = std::vector<int32_t>(S, 0), row_reset = std::vector<int32_t>(S, 0),
                       row_n_prompt = std::vector<int32_t>(S, 0), row_done = std::vector<int32_t>(S, 0);
  std::vector<uint64_t> slot_apps = std::vector<uint64_t>(S, 0);
  std::vector<float> slot_params = std::vector<float>(S * P, 0.f);
  std::vector<uint32_t> slot_span = std::vector<uint32_t>(S, 0);
  std::vector<float> read_state = std::vector<float>(S * R * kReadStateWidth, 0.f);
  std::vector<float> vec_state = std::vector<float>(S * (D + 1), 0.f);
  std::vector<int32_t> counters = std::vector<int32_t>(S * R, 0);
  std::vector<int32_t> app_mode = std::vector<int32_t>(A, MODE_REQUEST);
  std::vector<int32_t> site_first = std::vector<int32_t>(SITES, 0), site_count = std::vector<int32_t>(SITES, 0);
  std::vector<OpDesc> ops;
  std::vector<int32_t> cond;
  std::vector<uint32_t> sets = std::vector<uint32_t>(kMaxTokenSets * 2, 0);  // vocab 64
  std::vector<int32_t> span_def = std::vector<int32_t>(kMaxSpans * 2, -1);
  std::vector<float> results = std::vector<float>(T * R, NAN);
  std::vector<float> capture = std::vector<float>(64, 0.f);
  ControlBlock cb{};

  ControlBlock& build(int n_tokens, int n_rows) {
    cb.max_tokens = T; cb.max_slots = S; cb.max_apps = A; cb.n_params = P; cb.n_channels = R;
    cb.n_sites = SITES; cb.vec_state_width = D + 1; cb.vocab_words = 2;
    cb.n_tokens = n_tokens; cb.n_rows = n_rows;
    auto u = [](const void* p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); };
    cb.tok_slot = u(tok_slot.data()); cb.tok_pos = u(tok_pos.data()); cb.tok_flags = u(tok_flags.data());
    cb.tok_row = u(tok_row.data());
    cb.row_slot = u(row_slot.data()); cb.row_tok_start = u(row_tok_start.data());
    cb.row_n_tok = u(row_n_tok.data()); cb.row_reset = u(row_reset.data());
    cb.row_n_prompt = u(row_n_prompt.data()); cb.row_done = u(row_done.data());
    cb.slot_apps = u(slot_apps.data()); cb.slot_params = u(slot_params.data());
    cb.slot_span = u(slot_span.data()); cb.read_state = u(read_state.data());
    cb.vec_state = u(vec_state.data()); cb.counters = u(counters.data());
    cb.app_mode = u(app_mode.data()); cb.site_first = u(site_first.data());
    cb.site_count = u(site_count.data()); cb.ops = u(ops.data()); cb.cond_code = u(cond.data());
    cb.tokset_bits = u(sets.data()); cb.span_def = u(span_def.data());
    cb.n_spans = 1; cb.n_token_sets = 2;
    cb.results = u(results.data()); cb.capture = u(capture.data()); cb.capture_size = 64;
    return cb;
  }
  // One request per row, tokens contiguous.
  void request(int row, int slot, int start_tok, int n, int start_pos, int prompt_len) {
    row_slot[row] = slot; row_tok_start[row] = start_tok; row_n_tok[row] = n;
    row_reset[row] = start_pos == 0;
    for (int i = 0; i < n; ++i) {
      const int t = start_tok + i, pos = start_pos + i;
      tok_slot[t] = slot; tok_pos[t] = pos; tok_row[t] = row;
      tok_flags[t] = TF_VALID | (pos < prompt_len ? TF_PROMPT : TF_GENERATED);
      if (i == n - 1 && start_pos + n >= prompt_len) tok_flags[t] |= TF_LAST;
    }
  }
  void add_cond(std::initializer_list<int32_t> words) { cond.insert(cond.end(), words); }
};

OpDesc add_op(int app, const float* v, int param_base, int cond_begin = -1, int cond_len = 0) {
  OpDesc op{};
  op.kind = OP_ADD; op.app = app; op.cond_begin = cond_begin; op.cond_len = cond_len;
  op.param_base = param_base; op.channel = -1; op.state_base = -1; op.n = Block::D;
  op.a0 = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(v));
  return op;
}

}  // namespace

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
