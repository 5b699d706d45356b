// begin_host_step / end_host_step: the unstaged CPU engine's per-step host path in one call
// (csrc/site/step_cpu.cpp). Expected values are worked out by hand from the rules in
// xmix/runtime/control/step.py and the worker's restart check.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "block.h"
#include "xmix/site.h"

using namespace xmix_test;

namespace {

struct Host {
  Block b;
  ControlBlock image{};  // the block's host image (Python's block_host)
  std::vector<uint64_t> site_app_mask = std::vector<uint64_t>(Block::SITES, 0);
  std::vector<uint8_t> site_active = std::vector<uint8_t>(Block::SITES, 7);
  std::vector<uint8_t> started = std::vector<uint8_t>(Block::S, 0);
  std::vector<int64_t> extent = std::vector<int64_t>(Block::S, 0);
  std::vector<int64_t> floor = std::vector<int64_t>(Block::S, 0);
  HostStepBuffers buf{};

  Host() {
    b.build(0, 0);
    image = b.cb;
    buf.block = reinterpret_cast<uint8_t*>(&b.cb);
    buf.block_host = reinterpret_cast<uint8_t*>(&image);
    buf.block_size = sizeof(ControlBlock);
    buf.max_tokens = Block::T;
    buf.max_slots = Block::S;
    buf.slot_apps = reinterpret_cast<const int64_t*>(b.slot_apps.data());
    buf.site_app_mask = site_app_mask.data();
    buf.site_active = site_active.data();
    buf.n_sites = Block::SITES;
    buf.started = started.data();
    buf.extent = extent.data();
    buf.floor = floor.data();
    buf.slot_floor = b.slot_floor.data();
    buf.maps = StepMaps{b.tok_slot.data(),     b.tok_pos.data(),
                        reinterpret_cast<int32_t*>(b.tok_flags.data()),
                        b.tok_row.data(),      b.row_slot.data(),
                        b.row_tok_start.data(), b.row_n_tok.data(),
                        b.row_reset.data(),    b.row_n_prompt.data(),
                        b.row_done.data()};
  }
};

// Three requests in slots 0, 2, 3: slot 0 uses app 1 and starts again at position 0 after a
// step (a restart), slot 2 decodes two tokens, slot 3 is a new prompt with app 0.
const int32_t kSlots[] = {0, 2, 3};
const int64_t kNTok[] = {1, 2, 1}, kStart[] = {0, 5, 0}, kPlen[] = {3, 4, 6};

}  // namespace

TEST(HostStep, OneCallDoesRestartMasksMapsHeaderSitesExtentsAndPrologue) {
  Host h;
  h.b.slot_apps[0] = 0b10;
  h.b.slot_apps[3] = 0b01;
  h.site_app_mask[3] = 0b010;
  h.site_app_mask[5] = 0b100;  // app 2 is in no request: site 5 stays inactive
  h.site_app_mask[7] = 0b001;
  h.started[0] = h.started[2] = 1;
  h.extent[0] = 10;
  h.floor[0] = 4;
  h.b.slot_span[0] = 5;  // reset by the prologue (its row starts at 0)
  h.b.slot_span[2] = 9;  // kept (its row does not)
  h.b.vec_state[0] = 3.f;
  h.b.row_stop[1] = 7;  // every row's monitor record is cleared each step
  HostStepMasks m;
  m.on = 0b111;
  m.monitor = 0b001;
  const int64_t ids[] = {11, 12, 13, 14};
  const StepRows rows{3, kSlots, kNTok, kStart, kPlen, 6};

  const HostStepResult r = begin_host_step(h.buf, m, rows, true, ids, 8);

  EXPECT_EQ(r.status, 0);
  EXPECT_TRUE(r.ran);
  EXPECT_EQ(r.active, 0b11u);
  EXPECT_EQ(r.n_tok, 4);
  EXPECT_EQ(r.restarted, 1);
  // the restart raised slot 0's floor to its extent (max(10, 4)), on the host and in the block
  EXPECT_EQ(h.floor[0], 10);
  EXPECT_EQ(h.b.slot_floor[0], 10);
  EXPECT_EQ(h.b.slot_floor[2], 0);
  EXPECT_EQ(std::vector<uint8_t>(h.started.begin(), h.started.end()),
            (std::vector<uint8_t>{1, 0, 1, 1}));
  // header in the image and in the block, and the block is the image
  EXPECT_EQ(h.image.n_tokens, 4);
  EXPECT_EQ(h.image.n_rows, 3);
  EXPECT_EQ(std::memcmp(&h.b.cb, &h.image, sizeof(ControlBlock)), 0);
  // sites with an op of app 0 or 1
  std::vector<uint8_t> want_sites(Block::SITES, 0);
  want_sites[3] = want_sites[7] = 1;
  EXPECT_EQ(h.site_active, want_sites);
  // maps: 4 tokens, then 2 padding rows
  EXPECT_EQ(h.b.tok_slot, (std::vector<int32_t>{0, 2, 2, 3, -1, -1, -1, -1}));
  EXPECT_EQ(h.b.tok_pos, (std::vector<int32_t>{0, 5, 6, 0, 0, 0, 0, 0}));
  EXPECT_EQ(h.b.tok_row, (std::vector<int32_t>{0, 1, 1, 2, -1, -1, -1, -1}));
  // (the prologue adds token-set and span bits above the token flags: left out here)
  const uint32_t P = TF_VALID | TF_PROMPT, G = TF_VALID | TF_GENERATED;
  const uint32_t kFlags = TF_VALID | TF_PROMPT | TF_GENERATED | TF_LAST;
  std::vector<uint32_t> flags;
  for (uint32_t f : h.b.tok_flags) flags.push_back(f & kFlags);
  EXPECT_EQ(flags, (std::vector<uint32_t>{P, G, G | TF_LAST, P, 0, 0, 0, 0}));
  EXPECT_EQ(h.b.row_reset[0], 1);
  EXPECT_EQ(h.b.row_reset[1], 0);
  // monitors: each slot's extent is the end of this step's positions
  EXPECT_EQ(h.extent, (std::vector<int64_t>{1, 0, 7, 1}));
  // the prologue ran on the block
  EXPECT_EQ(h.b.slot_span[0], 0u);
  EXPECT_EQ(h.b.slot_span[2], 9u);
  EXPECT_EQ(h.b.vec_state[0], 0.f);
  EXPECT_EQ(h.b.row_stop[1], kNoStop);

  end_host_step(h.buf, true);
  EXPECT_EQ(h.image.n_tokens, 0);
  EXPECT_EQ(h.b.cb.n_tokens, 0);
  EXPECT_EQ(h.b.cb.n_rows, 0);
  EXPECT_EQ(h.site_active, std::vector<uint8_t>(Block::SITES, 0));
}

TEST(HostStep, NoAppRunsNothingWrittenButTheRestartCheck) {
  Host h;
  h.b.slot_apps[0] = 0b10;
  h.site_app_mask[3] = 0b010;
  h.started[0] = 1;
  h.extent[0] = 10;
  HostStepMasks m;
  m.on = 0b001;  // app 1 is off
  m.monitor = 0b001;
  const StepRows rows{3, kSlots, kNTok, kStart, kPlen, 0};

  const HostStepResult r = begin_host_step(h.buf, m, rows, true, nullptr, 8);

  EXPECT_FALSE(r.ran);
  EXPECT_EQ(r.restarted, 1);
  EXPECT_EQ(h.floor[0], 10);  // the restart is recorded whether or not an app runs
  EXPECT_EQ(h.site_active, std::vector<uint8_t>(Block::SITES, 0));
  EXPECT_EQ(h.b.tok_slot[0], -1);  // no maps
  EXPECT_EQ(h.image.n_rows, 0);
  EXPECT_EQ(h.extent[2], 0);
}

TEST(HostStep, OverCapacityWritesNoMapsNorHeader) {
  Host h;
  h.b.slot_apps[2] = 0b1;
  HostStepMasks m;
  m.on = 0b1;
  const int64_t many[] = {1, 9, 1};  // 11 tokens > T = 8
  const StepRows rows{3, kSlots, many, kStart, kPlen, 0};
  const HostStepResult r = begin_host_step(h.buf, m, rows, false, nullptr, 8);
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.n_tok, 11);
  EXPECT_EQ(h.b.tok_slot[0], -1);
  EXPECT_EQ(h.image.n_tokens, 0);
  // padded rows beyond capacity are refused the same way
  const StepRows padded{3, kSlots, kNTok, kStart, kPlen, Block::T + 1};
  EXPECT_EQ(begin_host_step(h.buf, m, padded, false, nullptr, 8).status, 1);
}

TEST(HostStep, SpansAloneRunTheStepAndEndWithoutHeaderKeepsIt) {
  Host h;
  HostStepMasks m;
  m.span = 0b1;  // an app follows a span: the step's maps are needed with no app active
  const StepRows rows{1, kSlots, kNTok, kStart, kPlen, 0};
  const HostStepResult r = begin_host_step(h.buf, m, rows, false, nullptr, 8);
  EXPECT_TRUE(r.ran);
  EXPECT_EQ(r.active, 0u);
  EXPECT_EQ(h.image.n_tokens, 1);
  EXPECT_EQ(h.started[0], 0);  // no restart check asked: started untouched
  end_host_step(h.buf, false);
  EXPECT_EQ(h.image.n_tokens, 1);
  EXPECT_EQ(h.site_active, std::vector<uint8_t>(Block::SITES, 0));
}
