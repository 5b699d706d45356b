// The CUDA twins against the CPU twins on the same hand-built control block: the anchor
// kernel of a site must leave the activations, result channels and latch state exactly as
// run_site_cpu does (up to fp32 reassociation in block reductions). Label `gpu`: skips with
// a message where no GPU is usable.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "block.h"
#include "xmix/site.h"

using namespace xmix_test;

namespace {

std::string gpu_missing() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return cudaGetErrorString(e);
  }
  return n > 0 ? "" : "no CUDA device";
}

// Device copies of every array of a Block, and the ControlBlock (with device pointers) on
// the device. Owns its allocations.
struct DeviceMirror {
  std::vector<void*> owned;
  ControlBlock cb{};
  ControlBlock* d_cb = nullptr;

  template <class T>
  uint64_t up(const std::vector<T>& v) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, v.size() * sizeof(T) + 8), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    owned.push_back(p);
    return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
  }
  template <class T>
  void down(uint64_t d, std::vector<T>& v) {
    EXPECT_EQ(cudaMemcpy(v.data(), reinterpret_cast<void*>(static_cast<uintptr_t>(d)),
                         v.size() * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  // ops must already hold device artifact pointers.
  DeviceMirror(Block& b, const std::vector<OpDesc>& dev_ops) {
    cb = b.cb;
    cb.tok_slot = up(b.tok_slot); cb.tok_pos = up(b.tok_pos); cb.tok_flags = up(b.tok_flags);
    cb.tok_row = up(b.tok_row); cb.row_slot = up(b.row_slot); cb.row_tok_start = up(b.row_tok_start);
    cb.row_n_tok = up(b.row_n_tok); cb.row_reset = up(b.row_reset); cb.row_n_prompt = up(b.row_n_prompt);
    cb.row_done = up(b.row_done); cb.slot_apps = up(b.slot_apps); cb.slot_params = up(b.slot_params);
    cb.slot_span = up(b.slot_span); cb.read_state = up(b.read_state); cb.vec_state = up(b.vec_state);
    cb.counters = up(b.counters); cb.app_mode = up(b.app_mode); cb.site_first = up(b.site_first);
    cb.site_count = up(b.site_count); cb.ops = up(dev_ops); cb.cond_code = up(b.cond);
    cb.tokset_bits = up(b.sets); cb.span_def = up(b.span_def); cb.results = up(b.results);
    cb.capture = up(b.capture); cb.result_valid = up(b.result_valid);
    std::vector<ControlBlock> one{cb};
    d_cb = reinterpret_cast<ControlBlock*>(static_cast<uintptr_t>(up(one)));
  }
  ~DeviceMirror() {
    for (void* p : owned) cudaFree(p);
  }
};

uint64_t addr(const void* p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); }

}  // namespace

TEST(KernelTwins, SiteAnchorMatchesTheCpuInterpreter) {
  const std::string why = gpu_missing();
  if (!why.empty()) GTEST_SKIP() << "gpu test skipped: " << why;

  // request 0 (slot 0, 3 prompt tokens) uses app 0; request 1 (slot 1, 2 tokens) does not.
  Block b;
  b.request(0, 0, 0, 3, 0, 3);
  b.request(1, 1, 3, 2, 0, 2);
  b.slot_apps[0] = 1;
  b.slot_params[0] = 0.25f;  // probe bias
  b.slot_params[1] = 1.5f;   // add scale
  b.slot_params[2] = 0.5f;   // gate threshold
  // ops at site 1: probe (channel 2), add gated on it, ablate on the prompt
  const std::vector<float> w = {0.5f, -0.25f, 1.f, 0.f}, v = {1.f, 2.f, -1.f, 0.5f},
                           u = {0.5f, 0.5f, 0.5f, 0.5f};
  b.cond = {C_GATE, 2, CMP_GE, 2, C_FLAG, 1, 0, 0};
  auto make_ops = [&](uint64_t pw, uint64_t pv, uint64_t pu) {
    OpDesc probe{};
    probe.kind = OP_PROBE; probe.app = 0; probe.cond_begin = -1; probe.param_base = 0;
    probe.channel = 2; probe.state_base = -1; probe.n = Block::D; probe.a0 = pw;
    OpDesc add = add_op(0, nullptr, 1, 0, 1);
    add.a0 = pv;
    OpDesc abl{};
    abl.kind = OP_ABLATE; abl.app = 0; abl.cond_begin = 1; abl.cond_len = 1; abl.param_base = 0;
    abl.channel = -1; abl.state_base = -1; abl.n = Block::D; abl.a0 = pu;
    return std::vector<OpDesc>{probe, add, abl};
  };
  b.ops = make_ops(addr(w.data()), addr(v.data()), addr(u.data()));
  b.site_first[1] = 0;
  b.site_count[1] = 3;
  b.build(5, 2);

  std::vector<float> h(5 * Block::D), r(5 * Block::D);
  for (size_t i = 0; i < h.size(); ++i) {
    h[i] = std::sin(0.7f * static_cast<float>(i));
    r[i] = std::cos(0.3f * static_cast<float>(i));
  }
  std::vector<float> h_gpu = h;

  // device side first (the CPU run below changes the host Block's state arrays)
  DeviceMirror m0(b, {});  // to allocate artifacts through the same helper
  const uint64_t dw = m0.up(w), dv = m0.up(v), du = m0.up(u);
  DeviceMirror m(b, make_ops(dw, dv, du));
  const uint64_t dh = m.up(h_gpu), dr = m.up(r);
  ASSERT_EQ(launch_site_anchor(m.d_cb, 1, reinterpret_cast<void*>(dh), reinterpret_cast<void*>(dr), 5,
                               Block::D, Block::D, Block::D, DT_F32, nullptr), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> res_gpu(b.results.size()), state_gpu(b.read_state.size());
  std::vector<uint8_t> valid_gpu(b.result_valid.size());
  m.down(dh, h_gpu);
  m.down(m.cb.results, res_gpu);
  m.down(m.cb.result_valid, valid_gpu);
  m.down(m.cb.read_state, state_gpu);

  run_site_cpu(b.cb, 1, h.data(), r.data(), 5, Block::D, Block::D, Block::D, DT_F32);
  for (size_t i = 0; i < h.size(); ++i) EXPECT_NEAR(h_gpu[i], h[i], 1e-5f) << "h[" << i << "]";
  for (size_t i = 0; i < b.results.size(); ++i) {
    if (std::isnan(b.results[i])) EXPECT_TRUE(std::isnan(res_gpu[i])) << "results[" << i << "]";
    else EXPECT_NEAR(res_gpu[i], b.results[i], 1e-5f) << "results[" << i << "]";
  }
  for (size_t i = 0; i < b.result_valid.size(); ++i)
    EXPECT_EQ(valid_gpu[i], b.result_valid[i]) << "result_valid[" << i << "]";
  for (size_t i = 0; i < b.read_state.size(); ++i) {
    if (std::isnan(b.read_state[i])) EXPECT_TRUE(std::isnan(state_gpu[i]));
    else EXPECT_NEAR(state_gpu[i], b.read_state[i], 1e-5f) << "read_state[" << i << "]";
  }
  // request 1 rows untouched on both
  for (int i = 3 * Block::D; i < 5 * Block::D; ++i)
    EXPECT_EQ(h_gpu[i], std::sin(0.7f * static_cast<float>(i)));
}

TEST(KernelTwins, LatchFromGeneratedOnBothTwins) {
  const std::string why = gpu_missing();
  if (!why.empty()) GTEST_SKIP() << "gpu test skipped: " << why;

  // row 0: the last prompt token of a 4-token prompt; row 1: another request's first
  // generated token. Both latches hold (prompt mean 0.6 >= 0.5); the add flagged
  // kLatchFromGenerated may only touch row 1, the plain one touches both.
  Block b;
  b.request(0, 0, 0, 1, 3, 4);
  b.request(1, 1, 1, 1, 4, 4);
  for (int s = 0; s < 2; ++s) {
    b.slot_apps[s] = 1;
    b.slot_params[s * Block::P + 0] = 2.f;   // add scale
    b.slot_params[s * Block::P + 1] = 0.5f;  // latch threshold
    float* st = &b.read_state[(s * Block::R + 1) * kReadStateWidth];
    st[0] = 1.8f; st[1] = 3.f; st[2] = 0.9f;
  }
  b.cond = {C_LATCH, 1, CMP_GE | (RED_MEAN << 8) | kLatchFromGenerated, 1,
            C_LATCH, 1, CMP_GE | (RED_MEAN << 8), 1};
  const std::vector<float> v = {1.f, 2.f, -1.f, 0.5f}, u = {0.25f, -0.5f, 0.75f, 1.f};
  auto make_ops = [&](uint64_t pv, uint64_t pu) {
    OpDesc late = add_op(0, nullptr, 0, 0, 1);
    late.a0 = pv;
    OpDesc plain = add_op(0, nullptr, 0, 1, 1);
    plain.a0 = pu;
    return std::vector<OpDesc>{late, plain};
  };
  b.ops = make_ops(addr(v.data()), addr(u.data()));
  b.site_first[1] = 0;
  b.site_count[1] = 2;
  b.build(2, 2);

  std::vector<float> h(2 * Block::D), r(2 * Block::D, 0.f);
  for (size_t i = 0; i < h.size(); ++i) h[i] = std::sin(0.7f * static_cast<float>(i));
  std::vector<float> want = h;
  for (int j = 0; j < Block::D; ++j) {
    want[j] += 2.f * u[j];
    want[Block::D + j] += 2.f * v[j] + 2.f * u[j];
  }
  std::vector<float> h_gpu = h;

  DeviceMirror m0(b, {});
  const uint64_t dv = m0.up(v), du = m0.up(u);
  DeviceMirror m(b, make_ops(dv, du));
  const uint64_t dh = m.up(h_gpu), dr = m.up(r);
  ASSERT_EQ(launch_site_anchor(m.d_cb, 1, reinterpret_cast<void*>(dh), reinterpret_cast<void*>(dr), 2,
                               Block::D, Block::D, Block::D, DT_F32, nullptr), 0);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  m.down(dh, h_gpu);

  run_site_cpu(b.cb, 1, h.data(), r.data(), 2, Block::D, Block::D, Block::D, DT_F32);
  for (size_t i = 0; i < h.size(); ++i) {
    EXPECT_NEAR(h[i], want[i], 1e-6f) << "cpu h[" << i << "]";
    EXPECT_NEAR(h_gpu[i], want[i], 1e-6f) << "gpu h[" << i << "]";
  }
}
