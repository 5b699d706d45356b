// Per-step token and row maps, written on the host before every forward (both engines: on a
// GPU these are the pinned mirrors copied to the control block).
#include <cstddef>
#include <cstdint>
#include <cstring>

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

namespace {

// The step's counts into the host image, then the whole image into the block, as Python's
// set_step_header + sync_block did (the block is only ever written as a copy of its image).
void write_counts(const HostStepBuffers& b, int32_t n_tokens, int32_t n_rows) {
  int32_t* counts = ptr<int32_t>(addr(b.block_host) + offsetof(ControlBlock, n_tokens));
  static_assert(offsetof(ControlBlock, n_rows) == offsetof(ControlBlock, n_tokens) + 4,
                "n_tokens and n_rows are adjacent");
  counts[0] = n_tokens;
  counts[1] = n_rows;
  std::memcpy(b.block, b.block_host, static_cast<size_t>(b.block_size));
}

}  // namespace

HostStepResult begin_host_step(const HostStepBuffers& b, const HostStepMasks& m,
                               const StepRows& rows, bool restart, const void* input_ids,
                               int32_t ids_dtype) {
  HostStepResult out;
  const int32_t n = rows.n_req;
  if (restart) {
    // A request that starts again at position 0 without having been preempted (vLLM V1 keeps
    // its slot) recomputes: the prologue resets its state, and its monitors keep what they
    // decided (Slots.recompute: the floor rises to the extent reached).
    for (int32_t i = 0; i < n; ++i) {
      const int32_t s = rows.slots[i];
      if (b.started[s] && rows.start_pos[i] == 0) {
        ++out.restarted;
        if (m.monitor) {
          const int64_t f = b.extent[s] > b.floor[s] ? b.extent[s] : b.floor[s];
          b.floor[s] = f;
          b.slot_floor[s] = static_cast<int32_t>(f);
        }
      }
      b.started[s] = 1;
    }
  }
  // Which apps run: those in mode "all" plus those of the step's requests, not off.
  uint64_t active = m.all;
  for (int32_t i = 0; i < n; ++i) active |= static_cast<uint64_t>(b.slot_apps[rows.slots[i]]);
  active &= m.on;
  if (!active && !m.span) {
    std::memset(b.site_active, 0, static_cast<size_t>(b.n_sites));
    return out;
  }
  int64_t n_tok = 0;
  for (int32_t i = 0; i < n; ++i) n_tok += rows.n_tok[i];
  out.n_tok = n_tok;
  out.active = active;
  if (n_tok > b.max_tokens || n > b.max_slots || rows.padded > b.max_tokens) {
    out.status = 1;
    return out;
  }
  StepRows in = rows;
  in.padded = rows.padded > n_tok ? rows.padded : static_cast<int32_t>(n_tok);
  StepMaps maps = b.maps;
  fill_step_maps(in, maps);
  write_counts(b, static_cast<int32_t>(n_tok), n);
  for (int32_t k = 0; k < b.n_sites; ++k) b.site_active[k] = (b.site_app_mask[k] & active) != 0;
  if (m.monitor) {
    // positions only grow within a request (a restart resets its floor first), so the last
    // step's end is the extent
    for (int32_t i = 0; i < n; ++i) b.extent[rows.slots[i]] = rows.start_pos[i] + rows.n_tok[i];
  }
  out.ran = true;
  if (input_ids != nullptr) {
    run_prologue_cpu(*ptr<const ControlBlock>(addr(b.block)), input_ids, ids_dtype);
  }
  return out;
}

void end_host_step(const HostStepBuffers& b, bool header) {
  if (header) write_counts(b, 0, 0);
  std::memset(b.site_active, 0, static_cast<size_t>(b.n_sites));
}

}  // namespace xmix
