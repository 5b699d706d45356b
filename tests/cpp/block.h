// A control block over std::vectors, shared by the interpreter tests (CPU) and the kernel
// twin tests (GPU).
#pragma once

#include <cmath>
#include <vector>

#include "xmix/control.h"

namespace xmix_test {
using namespace xmix;

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
  std::vector<uint8_t> result_valid = std::vector<uint8_t>(T * R, 0);
  std::vector<int32_t> slot_sticky = std::vector<int32_t>(S * kMaxSticky, kNoPosition);
  std::vector<int32_t> slot_floor = std::vector<int32_t>(S, 0);
  std::vector<uint64_t> row_stop = std::vector<uint64_t>(S, kNoStop);
  std::vector<uint32_t> row_switched = std::vector<uint32_t>(S, 0);
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
    cb.result_valid = u(result_valid.data());
    cb.slot_sticky = u(slot_sticky.data()); cb.slot_floor = u(slot_floor.data());
    cb.row_stop = u(row_stop.data()); cb.row_switched = u(row_switched.data());
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

inline OpDesc add_op(int app, const float* v, int param_base, int cond_begin = -1, int cond_len = 0) {
  OpDesc op{};
  op.kind = OP_ADD; op.app = app; op.cond_begin = cond_begin; op.cond_len = cond_len;
  op.param_base = param_base; op.channel = -1; op.state_base = -1; op.n = Block::D;
  op.a0 = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(v));
  return op;
}


}  // namespace xmix_test
