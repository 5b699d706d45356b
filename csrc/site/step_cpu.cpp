// Per-step token and row maps, written on the host before every forward (both engines: on a
// GPU these are the pinned mirrors copied to the control block).
#include <cstdint>

#include "xmix/control.h"
#include "xmix/site.h"

namespace xmix {

int32_t fill_step_maps(const StepRows& in, StepMaps& out) {
  int32_t t = 0;
  for (int32_t i = 0; i < in.n_req; ++i) {
    const int64_t n = in.n_tok[i], start = in.start_pos[i], plen = in.prompt_len[i];
    const int64_t end = start + n;  // exclusive
    out.row_slot[i] = in.slots[i];
    out.row_tok_start[i] = t;
    out.row_n_tok[i] = static_cast<int32_t>(n);
    out.row_reset[i] = start == 0;
    const int64_t n_prompt = (end < plen ? end : plen) - start;
    out.row_n_prompt[i] = static_cast<int32_t>(n_prompt > 0 ? n_prompt : 0);
    out.row_done[i] = start < plen && end >= plen;
    // A partial prefill chunk samples nothing, so none of its tokens is "last".
    const bool samples = end >= plen;
    for (int64_t k = 0; k < n; ++k, ++t) {
      const int64_t pos = start + k;
      uint32_t f = TF_VALID | (pos < plen ? TF_PROMPT : TF_GENERATED);
      if (samples && k == n - 1) f |= TF_LAST;
      out.tok_slot[t] = in.slots[i];
      out.tok_pos[t] = static_cast<int32_t>(pos);
      out.tok_flags[t] = static_cast<int32_t>(f);
      out.tok_row[t] = i;
    }
  }
  for (int32_t p = t; p < in.padded; ++p) {  // CUDA-graph padding rows: inert
    out.tok_slot[p] = -1;
    out.tok_row[p] = -1;
    out.tok_flags[p] = 0;
    out.tok_pos[p] = 0;
  }
  return t;
}

}  // namespace xmix
