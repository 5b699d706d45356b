// The site program on the CPU: the reference behaviour of the CUDA anchor kernel.
#include <cstring>
#include <exception>

#include "xmix/control.h"
#include "xmix/site.h"

namespace xmix {
namespace {

// The op reports nothing this step on any of its channels (an SAE read of listed features
// owns op.n consecutive ones).
void clear_results(const ControlBlock& cb, const OpDesc& op, int32_t n_rows) {
  if (op.channel < 0) return;
  const int32_t n_ch = op.kind == OP_SAE_READ && (op.flags & SAE_FEATURES) ? op.n : 1;
  for (int32_t t = 0; t < n_rows && t < cb.max_tokens; ++t)
    for (int32_t c = 0; c < n_ch; ++c) set_result(cb, t, op.channel + c, 0.f, false);
}

}  // namespace

std::vector<SiteFailure> run_site_cpu(const ControlBlock& cb, int32_t site, void* h, const void* r,
                                      int32_t n_rows, int32_t d, int64_t stride_h, int64_t stride_r,
                                      int32_t dtype) {
  std::vector<SiteFailure> failed;
  if (site < 0 || site >= cb.n_sites) return failed;
  const int32_t first = ptr<const int32_t>(cb.site_first)[site];
  const int32_t count = ptr<const int32_t>(cb.site_count)[site];
  const OpDesc* ops = ptr<const OpDesc>(cb.ops);
  // Built-in ops in site order, then custom kernels (on the GPU they are separate launches
  // after the anchor; the CPU keeps the same order).
  for (int32_t pass = 0; pass < 2; ++pass)
  for (int32_t k = 0; k < count; ++k) {
    const OpDesc& op = ops[first + k];
    if ((op.kind == OP_CUSTOM) != (pass == 1)) continue;
    if (ptr<const int32_t>(cb.app_mode)[op.app] == MODE_OFF) {
      // An app switched off still owns its result channels: it reports nothing this step.
      clear_results(cb, op, n_rows);
      continue;
    }
    // One op's failure must not cost the other ops of the site (other requests' apps) their
    // turn: it is recorded and the site goes on.
    const size_t n_failed = failed.size();
    try {
      run_op_cpu(cb, op, h, r, n_rows, d, stride_h, stride_r, dtype);
    } catch (const std::exception& e) {
      failed.push_back({op.app, e.what()});
    } catch (...) {
      failed.push_back({op.app, "unknown exception"});
    }
    // A read that failed before it set its flags would leave an earlier step's there, and the
    // drain would report them for whichever request holds those rows now.
    if (failed.size() != n_failed) clear_results(cb, op, n_rows);
  }
  return failed;
}

bool op_any_selected_cpu(const ControlBlock& cb, const OpDesc& op) {
  for (int32_t t = 0; t < cb.n_tokens; ++t) {
    int32_t slot;
    if (op_selects(cb, op, t, &slot)) return true;
  }
  return false;
}

void run_prologue_cpu(const ControlBlock& cb, const void* input_ids, int32_t ids_dtype) {
  const int32_t* row_slot = ptr<const int32_t>(cb.row_slot);
  const int32_t* row_start = ptr<const int32_t>(cb.row_tok_start);
  const int32_t* row_n = ptr<const int32_t>(cb.row_n_tok);
  const int32_t* row_reset = ptr<const int32_t>(cb.row_reset);
  uint32_t* flags = ptr<uint32_t>(cb.tok_flags);
  uint32_t* span = ptr<uint32_t>(cb.slot_span);
  const uint32_t* sets = ptr<const uint32_t>(cb.tokset_bits);
  const int32_t* span_def = ptr<const int32_t>(cb.span_def);
  const int64_t vocab = static_cast<int64_t>(cb.vocab_words) * 32;

  for (int32_t row = 0; row < cb.n_rows; ++row) {
    const int32_t slot = row_slot[row];
    if (!row_reset[row]) continue;
    span[slot] = 0;
    float* rs = ptr<float>(cb.read_state) + static_cast<int64_t>(slot) * cb.n_channels * kReadStateWidth;
    for (int32_t c = 0; c < cb.n_channels; ++c) {
      rs[c * kReadStateWidth + 0] = 0.f;
      rs[c * kReadStateWidth + 1] = 0.f;
      rs[c * kReadStateWidth + 2] = __builtin_nanf("");
    }
    std::memset(ptr<float>(cb.vec_state) + static_cast<int64_t>(slot) * cb.vec_state_width, 0,
                sizeof(float) * cb.vec_state_width);
  }
  for (int32_t row = 0; row < cb.n_rows; ++row) {
    const int32_t slot = row_slot[row];
    uint32_t state = span[slot];
    for (int32_t t = row_start[row]; t < row_start[row] + row_n[row]; ++t) {
      const int64_t id = ids_dtype == 8 ? static_cast<const int64_t*>(input_ids)[t]
                                        : static_cast<const int32_t*>(input_ids)[t];
      uint32_t f = flags[t];
      if (id >= 0 && id < vocab) {
        for (int32_t s = 0; s < cb.n_token_sets; ++s) {
          if ((sets[static_cast<int64_t>(s) * cb.vocab_words + (id >> 5)] >> (id & 31)) & 1u)
            f |= 1u << (kTokenSetBit0 + s);
        }
      }
      // A span covers [opener, closer): the opener is inside, the closer is not.
      for (int32_t k = 0; k < cb.n_spans; ++k) {
        const int32_t open = span_def[2 * k], close = span_def[2 * k + 1];
        if (open >= 0 && ((f >> (kTokenSetBit0 + open)) & 1u)) state |= 1u << k;
        if (close >= 0 && ((f >> (kTokenSetBit0 + close)) & 1u)) state &= ~(1u << k);
        if ((state >> k) & 1u) f |= 1u << (kSpanBit0 + k);
      }
      flags[t] = f;
    }
    span[slot] = state;
  }
}

}  // namespace xmix
