// The site program on the CPU: the reference behaviour of the CUDA anchor kernel.
#include <exception>

#include "xmix/control.h"
#include "xmix/site.h"

namespace xmix {
namespace {

// The op reports nothing this step on any of its channels (an SAE read of listed features
// owns op.n consecutive ones).
void clear_results(const ControlBlock& cb, const OpDesc& op, int32_t n_rows) {
  if (op.channel < 0) return;
  const int32_t n_ch = read_channels(op);
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
      } catch (const std::exception& e) { failed.push_back({op.app, e.what()}); } catch (...) {
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
  // Resets first for every row, then tokens: the CUDA twin's two kernels, in the same order.
  for (int32_t row = 0; row < cb.n_rows; ++row) prologue_reset_row(cb, row, 0, 1);
  for (int32_t row = 0; row < cb.n_rows; ++row) prologue_row_tokens(cb, row, input_ids, ids_dtype);
}

}  // namespace xmix
