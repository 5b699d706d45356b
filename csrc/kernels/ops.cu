// CUDA twins of the built-in primitives and the kernels that run them: the site anchor (all
// ops of a site, self-dispatching from the control block), the per-op kernel a graph splice
// uses, the gate kernel that sets an IF conditional node, and the per-step prologue.
//
// One block per token row. Formulas and accumulation order per element match ops_cpu.cpp;
// dot products are reduced across the block (fp32), so sums differ from the CPU only by
// reassociation. Cross-token state (latch sums, CAST running means) uses atomics; the CAST
// value is computed by the last block of a request to arrive (threadfence reduction).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "xmix/control.h"
#include "xmix/custom.h"
#include "xmix/site.h"
#include "xmix/smem.h"

namespace xmix {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float nan_f() { return __int_as_float(0x7fc00000); }

__device__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x < 32) {
    total = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    if (threadIdx.x == 0) red[32] = total;
  }
  __syncthreads();
  return red[32];
}

__device__ float block_max(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float m = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (threadIdx.x == 0) red[32] = m;
  }
  __syncthreads();
  return red[32];
}

__device__ float block_min(float v, float* red) { return -block_max(-v, red); }

struct DRow {
  char* h;
  const char* r;
  int32_t d;
  int32_t dtype;
  __device__ float x(int32_t i) const {
    float v = load(h, i, dtype);
    return r ? v + load(r, i, dtype) : v;
  }
  __device__ float hid(int32_t i) const { return load(h, i, dtype); }
  __device__ float res(int32_t i) const { return r ? load(r, i, dtype) : 0.f; }
  mutable int32_t refused = 0;  // this thread's elements store_finite kept
  __device__ void set_h(int32_t i, float v) const {
    refused += store_finite(h, i, dtype, v) ? 1 : 0;
  }
};

// A row's elements, kChunk per thread at a time: every load of a chunk is issued before any of
// its values is used, so a thread waits for memory once a chunk instead of once an element
// (at 256 threads a row of 4 096 is 16 elements a thread; one round trip each made an add node
// ~10 us at any batch on an H200, 2026-12-04). Elements are visited in the same order as a plain
// strided loop, so every sum is bit for bit what it was. The dtype is a template argument: no
// branch inside the unrolled bodies.
constexpr int kChunk = 8;

template <int32_t DT>
__device__ __forceinline__ float ld(const void* p, int32_t i) {
  if constexpr (DT == DT_F32) {
    return static_cast<const float*>(p)[i];
  } else {
    const uint16_t b = static_cast<const uint16_t*>(p)[i];
    return DT == DT_BF16 ? bf16_to_float(b) : f16_to_float(b);
  }
}

template <int32_t DT>
__device__ __forceinline__ float dot_x_t(const char* h, const char* r, int32_t d,
                                         const float* __restrict__ w) {
  float acc = 0.f;
  for (int32_t base = threadIdx.x; base < d; base += kChunk * blockDim.x) {
    float x[kChunk], wv[kChunk];
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      const int32_t i = base + k * static_cast<int32_t>(blockDim.x);
      if (i < d) {
        x[k] = r ? ld<DT>(h, i) + ld<DT>(r, i) : ld<DT>(h, i);
        wv[k] = __ldg(&w[i]);
      }
    }
#pragma unroll
    for (int k = 0; k < kChunk; ++k)
      if (base + k * static_cast<int32_t>(blockDim.x) < d) acc += x[k] * wv[k];
  }
  return acc;
}

__device__ float dot_x(const DRow& row, const float* w, float* red) {
  float acc;
  if (row.dtype == DT_F32)
    acc = dot_x_t<DT_F32>(row.h, row.r, row.d, w);
  else if (row.dtype == DT_BF16)
    acc = dot_x_t<DT_BF16>(row.h, row.r, row.d, w);
  else
    acc = dot_x_t<DT_F16>(row.h, row.r, row.d, w);
  return block_sum(acc, red);
}

// h[i] = a * v[i] + h[i] over a row, each element with store_finite's rule (the add, ablate and
// clamp writes: a is the scale, minus the projection, the clamp's delta); chunked as above.
// Returns how many elements this thread left as they were.
template <int32_t DT>
__device__ __forceinline__ int32_t axpy_row_t(char* h, int32_t d, float a,
                                              const float* __restrict__ v) {
  int32_t refused = 0;
  for (int32_t base = threadIdx.x; base < d; base += kChunk * blockDim.x) {
    float hv[kChunk], vv[kChunk];
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      const int32_t i = base + k * static_cast<int32_t>(blockDim.x);
      if (i < d) {
        hv[k] = ld<DT>(h, i);
        vv[k] = __ldg(&v[i]);
      }
    }
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      const int32_t i = base + k * static_cast<int32_t>(blockDim.x);
      if (i < d) refused += store_finite(h, i, DT, hv[k] + a * vv[k]) ? 1 : 0;
    }
  }
  return refused;
}

__device__ void axpy_row(const DRow& row, float a, const float* v) {
  if (row.dtype == DT_F32)
    row.refused += axpy_row_t<DT_F32>(row.h, row.d, a, v);
  else if (row.dtype == DT_BF16)
    row.refused += axpy_row_t<DT_BF16>(row.h, row.d, a, v);
  else
    row.refused += axpy_row_t<DT_F16>(row.h, row.d, a, v);
}

__device__ void note_read(const ControlBlock& cb, int32_t channel, int32_t slot, uint32_t flags,
                          float v) {
  if (!(flags & TF_PROMPT)) return;
  float* s = ptr<float>(cb.read_state) +
             (static_cast<int64_t>(slot) * cb.n_channels + channel) * kReadStateWidth;
  atomicAdd(&s[0], v);
  atomicAdd(&s[1], 1.f);
  if (flags & TF_LAST) s[2] = v;
}

__device__ float cosine_of_mean(const float* sum, float count, const OpDesc& op, int32_t d,
                                float* red) {
  const float* v = ptr<const float>(op.a0);
  const float inv_vv = ptr<const float>(op.a1)[0];
  float vm = 0.f;
  for (int32_t i = threadIdx.x; i < d; i += blockDim.x) vm += v[i] * (__ldcg(&sum[i]) / count);
  const float a = block_sum(vm, red) * inv_vv;
  float mu = 0.f, mm = 0.f, uu = 0.f;
  for (int32_t i = threadIdx.x; i < d; i += blockDim.x) {
    const float m = __ldcg(&sum[i]) / count;
    const float u = tanhf(a * v[i]);
    mu += m * u;
    mm += m * m;
    uu += u * u;
  }
  mu = block_sum(mu, red);
  mm = block_sum(mm, red);
  uu = block_sum(uu, red);
  const float den = sqrtf(mm) * sqrtf(uu);
  return den > 0.f ? mu / den : 0.f;
}

// ---------------------------------------------------------------- SAEs
// One block per selected row, as every op: rows of requests without the app return before
// any encoder work. The encoder input sits in shared memory; each warp computes whole
// pre-activations (lanes over d, butterfly sum: the same value in every lane); top-K keeps
// one candidate list per warp, merged by ranks. Semantics: ops_cpu.cpp, xmix.lang.reference.
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float warp_dot(const float* w, const float* xs, int32_t d) {
  const int lane = threadIdx.x & 31;
  float acc = 0.f;
  for (int32_t i = lane; i < d; i += 32) acc += w[i] * xs[i];
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return acc;
}

// The encoder input of the row into xs[0, d); returns the decoder-to-stream scale.
__device__ float sae_input_row(const DRow& row, const OpDesc& op, const float* b_dec, int32_t d,
                               float* red, float* xs) {
  for (int32_t i = threadIdx.x; i < d; i += blockDim.x) xs[i] = row.x(i);
  const int32_t norm = sae_norm(op);
  float scale = 1.f;
  if (norm == SAE_NORM_RESCALE) {
    float ss = 0.f;
    for (int32_t i = threadIdx.x; i < d; i += blockDim.x) ss += xs[i] * xs[i];
    const float nrm = sqrtf(block_sum(ss, red));
    const float coeff = nrm > 0.f ? sqrtf(static_cast<float>(d)) / nrm : 0.f;
    scale = nrm > 0.f ? nrm / sqrtf(static_cast<float>(d)) : 0.f;
    for (int32_t i = threadIdx.x; i < d; i += blockDim.x) xs[i] *= coeff;
  } else if (norm == SAE_NORM_LAYER) {
    float sum = 0.f;
    for (int32_t i = threadIdx.x; i < d; i += blockDim.x) sum += xs[i];
    const float mu = block_sum(sum, red) / static_cast<float>(d);
    float var = 0.f;
    for (int32_t i = threadIdx.x; i < d; i += blockDim.x) {
      xs[i] -= mu;
      var += xs[i] * xs[i];
    }
    const float sd = sqrtf(block_sum(var, red) / static_cast<float>(d - 1));
    for (int32_t i = threadIdx.x; i < d; i += blockDim.x) xs[i] /= sd + kSaeLnEps;
    scale = sd;
  }
  if (sae_b_dec_in(op))
    for (int32_t i = threadIdx.x; i < d; i += blockDim.x) xs[i] -= b_dec[i];
  __syncthreads();
  return scale;
}

__device__ void sae_row(const ControlBlock& cb, const OpDesc& op, int32_t t, bool sel, int32_t slot,
                        const DRow& row, uint32_t flags, const float* p, int32_t d, float* red,
                        float* xs) {
  __shared__ float s_v[kWarps][kSaeMaxTopK];
  __shared__ int32_t s_i[kWarps][kSaeMaxTopK];
  __shared__ int32_t s_n[kWarps];
  __shared__ float s_pre[kSaeMaxFeatures], s_act[kSaeMaxFeatures];
  __shared__ int32_t s_ahead[kSaeMaxFeatures], s_pos;
  const bool is_read = op.kind == OP_SAE_READ;
  const bool listed = sae_listed(op);
  const int32_t n_ch = read_channels(op);
  if (t < cb.max_tokens)
    for (int32_t c = threadIdx.x; c < n_ch; c += blockDim.x)
      set_result(cb, t, op.channel + c, 0.f, false);
  if (!sel) return;  // block-uniform
  const int32_t F = sae_n_features(op), arch = sae_arch(op);
  const float* w_enc = ptr<const float>(op.a0);
  const float* aux = ptr<const float>(op.a2);
  const float* b_enc = aux;
  const float* thr = aux + F;
  const float* b_dec = aux + 2 * static_cast<int64_t>(F);
  const int32_t k = static_cast<int32_t>(aux[2 * static_cast<int64_t>(F) + d]);
  const float* feats = ptr<const float>(op.a3);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float scale = sae_input_row(row, op, b_dec, d, red, xs);

  if (listed) {
    const int32_t n = op.n;
    for (int32_t j = warp; j < n; j += kWarps) {
      const int32_t f = static_cast<int32_t>(feats[j]);
      const float pre = warp_dot(w_enc + static_cast<int64_t>(f) * d, xs, d) + b_enc[f];
      if (lane == 0) s_pre[j] = pre;
    }
    for (int32_t j = threadIdx.x; j < n; j += blockDim.x) s_ahead[j] = 0;
    __syncthreads();
    if (arch == SAE_TOPK) {
      int32_t ahead[2] = {0, 0};  // lane's listed features: lane, lane + 32
      for (int32_t g = warp; g < F; g += kWarps) {
        const float pg = warp_dot(w_enc + static_cast<int64_t>(g) * d, xs, d) + b_enc[g];
        for (int32_t q = 0; q < 2; ++q) {
          const int32_t j = lane + 32 * q;
          if (j < n)
            ahead[q] += sae_before(pg, g, s_pre[j], static_cast<int32_t>(feats[j])) ? 1 : 0;
        }
      }
      for (int32_t q = 0; q < 2; ++q)
        if (lane + 32 * q < n) atomicAdd(&s_ahead[lane + 32 * q], ahead[q]);
      __syncthreads();
    }
    for (int32_t j = threadIdx.x; j < n; j += blockDim.x) {
      const int32_t f = static_cast<int32_t>(feats[j]);
      float a = sae_act(s_pre[j], arch, thr[f]);
      if (arch == SAE_TOPK && s_ahead[j] >= k) a = 0.f;
      s_act[j] = a;
      if (is_read) {
        set_result(cb, t, op.channel + j, a, true);
        note_read(cb, op.channel + j, slot, flags, a);
      }
    }
    __syncthreads();
    if (is_read) return;
    const float value = p[op.param_base + P_SAE_CLAMP_VALUE];
    for (int32_t j = threadIdx.x; j < n; j += blockDim.x) s_pre[j] = (value - s_act[j]) * scale;
    __syncthreads();
    const float* w_dec = ptr<const float>(op.a1);
    for (int32_t i = threadIdx.x; i < d; i += blockDim.x) {
      float delta = 0.f;
      for (int32_t j = 0; j < n; ++j)
        delta += s_pre[j] * w_dec[static_cast<int64_t>(feats[j]) * d + i];
      row.set_h(i, row.hid(i) + delta);
    }
    return;
  }

  // Top-K read.
  const int32_t K = op.n;
  const int32_t keep = arch == SAE_TOPK ? min(K, k) : K;
  float* sv = s_v[warp];
  int32_t* si = s_i[warp];
  int32_t cnt = 0;              // warp-uniform
  float worst_v = 0.f;
  int32_t worst_slot = 0, worst_i = 0;
  for (int32_t g = warp; g < F; g += kWarps) {
    const float pre = warp_dot(w_enc + static_cast<int64_t>(g) * d, xs, d) + b_enc[g];
    const float v = arch == SAE_TOPK ? pre : sae_act(pre, arch, thr[g]);
    if (arch != SAE_TOPK && !(v > 0.f)) continue;
    if (cnt < keep) {
      if (lane == 0) {
        sv[cnt] = v;
        si[cnt] = g;
      }
      ++cnt;
      if (cnt < keep) continue;
    } else if (sae_before(v, g, worst_v, worst_i)) {
      if (lane == 0) {
        sv[worst_slot] = v;
        si[worst_slot] = g;
      }
    } else {
      continue;
    }
    __syncwarp();
    // The list is full: find its worst entry (lanes over slots, then a warp reduction).
    float bv = 0.f;
    int32_t bi = -1, bs = -1;
    for (int32_t q = lane; q < keep; q += 32) {
      if (bs < 0 || sae_before(bv, bi, sv[q], si[q])) {
        bv = sv[q];
        bi = si[q];
        bs = q;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int32_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
      const int32_t os = __shfl_xor_sync(0xffffffffu, bs, o);
      if (os >= 0 && (bs < 0 || sae_before(bv, bi, ov, oi))) {
        bv = ov;
        bi = oi;
        bs = os;
      }
    }
    worst_v = bv;
    worst_i = bi;
    worst_slot = bs;
    __syncwarp();
  }
  if (lane == 0) s_n[warp] = cnt;
  if (threadIdx.x == 0) s_pos = 0;
  __syncthreads();
  // Merge: each candidate's rank among all is its place in the output.
  float* dst = ptr<float>(cb.capture) + op.capture_offset + static_cast<int64_t>(t) * 2 * K;
  for (int32_t c = threadIdx.x; c < kWarps * keep; c += blockDim.x) {
    const int32_t w = c / keep, q = c % keep;
    if (q >= s_n[w]) continue;
    const float v = s_v[w][q];
    const int32_t id = s_i[w][q];
    int32_t rank = 0;
    for (int32_t w2 = 0; w2 < kWarps; ++w2)
      for (int32_t q2 = 0; q2 < s_n[w2]; ++q2)
        rank += sae_before(s_v[w2][q2], s_i[w2][q2], v, id) ? 1 : 0;
    if (rank < keep && v > 0.f) {
      dst[rank] = static_cast<float>(id);
      dst[K + rank] = v;
      atomicAdd(&s_pos, 1);
    }
  }
  __syncthreads();
  const int32_t n_out = s_pos;
  for (int32_t q = n_out + threadIdx.x; q < K; q += blockDim.x) {
    dst[q] = -1.f;
    dst[K + q] = 0.f;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const float v = n_out ? dst[K] : 0.f;
    if (t < cb.max_tokens) set_result(cb, t, op.channel, v, true);
    note_read(cb, op.channel, slot, flags, v);
  }
}

// One op on the token row of this block. All threads of the block call it.
__device__ void run_op_row(const ControlBlock& cb, const OpDesc& op, int32_t t, void* h,
                           const void* r, int32_t d, int64_t sh, int64_t sr, int32_t dtype,
                           float* red, float* xs) {
  __shared__ int32_t s_sel, s_slot;
  if (threadIdx.x == 0) {
    int32_t slot;
    s_sel = op_selects(cb, op, t, &slot) ? 1 : 0;
    s_slot = slot;
  }
  __syncthreads();
  const bool sel = s_sel != 0;
  const int32_t slot = s_slot;
  const int64_t es = dtype_size(dtype);
  DRow row{static_cast<char*>(h) + t * sh * es,
           r ? static_cast<const char*>(r) + t * sr * es : nullptr, d, dtype};
  const uint32_t flags = ptr<const uint32_t>(cb.tok_flags)[t];
  const float* p = slot >= 0 ? slot_params_row(cb, slot) : nullptr;
  switch (op.kind) {
    case OP_PROBE: {
      float v = nan_f();
      if (sel)
        v = sigmoid(dot_x(row, ptr<const float>(op.a0), red) + p[op.param_base + P_PROBE_BIAS]);
      if (threadIdx.x == 0) {
        set_result(cb, t, op.channel, v, sel);
        if (sel) note_read(cb, op.channel, slot, flags, v);
      }
      break;
    }
    case OP_DISTANCE: {
      float v = nan_f();
      if (sel) {
        const float* mu = ptr<const float>(op.a0);
        float best = INFINITY;
        for (int32_t k = 0; k < op.n; ++k) {
          float acc = 0.f;
          for (int32_t i = threadIdx.x; i < d; i += blockDim.x) {
            const float e = row.x(i) - mu[static_cast<int64_t>(k) * d + i];
            acc += e * e;
          }
          best = fminf(best, sqrtf(block_sum(acc, red)));
        }
        v = best;
      }
      if (threadIdx.x == 0) {
        set_result(cb, t, op.channel, v, sel);
        if (sel) note_read(cb, op.channel, slot, flags, v);
      }
      break;
    }
    case OP_CAPTURE: {
      if (sel) {
        const int32_t w = capture_width(op), d0 = capture_first_dim(op);
        float* dst = ptr<float>(cb.capture) + op.capture_offset + static_cast<int64_t>(t) * w;
        for (int32_t i = threadIdx.x; i < w; i += blockDim.x) dst[i] = row.x(d0 + i);
      }
      if (threadIdx.x == 0) {
        set_result(cb, t, op.channel, 1.f, sel);
        if (sel) note_read(cb, op.channel, slot, flags, 1.f);
      }
      break;
    }
    case OP_COSINE: {
      // Every block writes its own NaN first; the last block of the request to arrive
      // writes the value at the last prompt token row (see file comment).
      if (threadIdx.x == 0) set_result(cb, t, op.channel, 0.f, false);
      if (slot < 0 || t >= cb.n_tokens || !app_active(cb, op.app, slot) || !(flags & TF_PROMPT))
        break;
      float* st = ptr<float>(cb.vec_state) + static_cast<int64_t>(slot) * cb.vec_state_width +
                  op.state_base;
      if (sel) {
        for (int32_t i = threadIdx.x; i < d; i += blockDim.x) atomicAdd(&st[i], row.x(i));
        if (threadIdx.x == 0) atomicAdd(&st[d], 1.f);
      }
      // threadFenceReduction: every thread fences its own adds, and the barrier makes thread
      // 0 count this block's arrival only after all of them have; without it the last block
      // could read the sums before this block's adds are visible.
      __threadfence();
      __syncthreads();
      __shared__ int32_t s_last;
      const int32_t rw = ptr<const int32_t>(cb.tok_row)[t];
      if (threadIdx.x == 0) {
        int32_t* counter =
            ptr<int32_t>(cb.counters) + static_cast<int64_t>(slot) * cb.n_channels + op.channel;
        const int32_t expected = ptr<const int32_t>(cb.row_n_prompt)[rw];
        s_last = atomicAdd(counter, 1) == expected - 1;
        if (s_last) *counter = 0;
      }
      __syncthreads();
      if (s_last) {
        __threadfence();
        // The sums were written by other blocks' atomics (in L2): read them past L1.
        const float count = __ldcg(&st[d]);
        if (ptr<const int32_t>(cb.row_done)[rw] && count > 0.f) {
          const float v = cosine_of_mean(st, count, op, d, red);
          if (threadIdx.x == 0) {
            const int32_t t_last = ptr<const int32_t>(cb.row_tok_start)[rw] +
                                   ptr<const int32_t>(cb.row_n_prompt)[rw] - 1;
            set_result(cb, t_last, op.channel, v, true);
            note_read(cb, op.channel, slot, TF_PROMPT | TF_LAST, v);
          }
        }
      }
      break;
    }
    case OP_ADD: {
      if (!sel) break;
      const float* v = ptr<const float>(op.a0);
      const float s = p[op.param_base + P_ADD_SCALE];
      axpy_row(row, s, v);
      break;
    }
    case OP_ABLATE: {
      if (!sel) break;
      const float* u = ptr<const float>(op.a0);
      const float proj = dot_x(row, u, red);
      axpy_row(row, -proj, u);
      break;
    }
    case OP_CLAMP: {
      if (!sel) break;
      const float* u = ptr<const float>(op.a0);
      const float proj = dot_x(row, u, red);
      const float lo = p[op.param_base + P_CLAMP_LO], hi = p[op.param_base + P_CLAMP_HI];
      const float delta = fminf(fmaxf(proj, lo), hi) - proj;
      axpy_row(row, delta, u);
      break;
    }
    case OP_AFFINE: {
      if (!sel) break;
      const float* A = ptr<const float>(op.a0);
      const float* mus = ptr<const float>(op.a1);
      const float* mut = ptr<const float>(op.a2);
      for (int32_t j = threadIdx.x; j < d; j += blockDim.x) xs[j] = row.x(j) - mus[j];
      __syncthreads();
      // One warp per output element; every x is in shared memory before h is written.
      const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
      float* outs = xs + d;
      for (int32_t i = warp; i < d; i += n_warps) {
        const float* a = A + static_cast<int64_t>(i) * d;
        float acc = 0.f;
        for (int32_t j = lane; j < d; j += 32) acc += a[j] * xs[j];
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) outs[i] = acc + mut[i];
      }
      __syncthreads();
      for (int32_t i = threadIdx.x; i < d; i += blockDim.x) row.set_h(i, outs[i] - row.res(i));
      break;
    }
    case OP_ROUTER: {
      if (!sel) break;
      const float* mask = ptr<const float>(op.a0);
      const float delta = p[op.param_base + P_ROUTER_DELTA];
      float m = -INFINITY;
      for (int32_t e = threadIdx.x; e < d; e += blockDim.x) m = fmaxf(m, row.hid(e));
      const float mx = block_max(m, red);
      float se = 0.f;
      for (int32_t e = threadIdx.x; e < d; e += blockDim.x) se += expf(row.hid(e) - mx);
      const float lse = mx + logf(block_sum(se, red));
      float lmax = -INFINITY, lmin = INFINITY;
      for (int32_t e = threadIdx.x; e < d; e += blockDim.x) {
        const float l = row.hid(e) - lse;
        lmax = fmaxf(lmax, l);
        lmin = fminf(lmin, l);
      }
      lmax = block_max(lmax, red);
      lmin = block_min(lmin, red);
      // Each thread rewrites only the experts it read, after every reduction is done.
      for (int32_t e = threadIdx.x; e < d; e += blockDim.x) {
        float l = row.hid(e) - lse;
        if (mask[e] > 0.f)
          l = lmax + delta;
        else if (mask[e] < 0.f)
          l = lmin - delta;
        row.set_h(e, l);
      }
      break;
    }
    case OP_SAE_READ:
    case OP_SAE_CLAMP: sae_row(cb, op, t, sel, slot, row, flags, p, d, red, xs); break;
    case OP_STOP:
    case OP_SINCE:
      if (sel && threadIdx.x == 0) monitor_token(cb, op, t, slot);
      break;
    default: break;  // OP_CUSTOM runs as its own launch (launch_custom)
  }
  if (row.refused) atomicAdd(ptr<int32_t>(cb.app_nonfinite) + op.app, row.refused);
  __syncthreads();
}

__device__ void off_op_row(const ControlBlock& cb, const OpDesc& op, int32_t t) {
  if (op.channel >= 0 && threadIdx.x == 0) set_result(cb, t, op.channel, 0.f, false);
}

__global__ void __launch_bounds__(kThreads)
    xmix_site_anchor(const ControlBlock* __restrict__ cbp, int32_t site, void* h, const void* r,
                     int32_t d, int64_t sh, int64_t sr, int32_t dtype) {
  extern __shared__ float xs[];
  __shared__ float red[33];
  const ControlBlock& cb = *cbp;
  const int32_t t = blockIdx.x;
  if (site < 0 || site >= cb.n_sites || t >= cb.max_tokens) return;
  const int32_t first = ptr<const int32_t>(cb.site_first)[site];
  const int32_t count = ptr<const int32_t>(cb.site_count)[site];
  const OpDesc* ops = ptr<const OpDesc>(cb.ops);
  for (int32_t k = 0; k < count; ++k) {
    const OpDesc& op = ops[first + k];
    if (op.kind == OP_CUSTOM) continue;
    if (ptr<const int32_t>(cb.app_mode)[op.app] == MODE_OFF) {
      off_op_row(cb, op, t);
      continue;
    }
    run_op_row(cb, op, t, h, r, d, sh, sr, dtype, red, xs);
  }
}

// A spliced node names its op by (site, index); a graph that was not re-planned after the
// site's op list shrank must read nothing past the list.
__device__ __forceinline__ bool op_in_range(const ControlBlock& cb, int32_t site,
                                            int32_t op_index) {
  return site >= 0 && site < cb.n_sites && op_index >= 0 &&
         op_index < ptr<const int32_t>(cb.site_count)[site];
}

__global__ void __launch_bounds__(kThreads)
    xmix_op_kernel(const ControlBlock* __restrict__ cbp, int32_t site, int32_t op_index, void* h,
                   const void* r, int32_t d, int64_t sh, int64_t sr, int32_t dtype) {
  extern __shared__ float xs[];
  __shared__ float red[33];
  const ControlBlock& cb = *cbp;
  const int32_t t = blockIdx.x;
  if (t >= cb.max_tokens || !op_in_range(cb, site, op_index)) return;
  const OpDesc& op = ptr<const OpDesc>(cb.ops)[ptr<const int32_t>(cb.site_first)[site] + op_index];
  if (ptr<const int32_t>(cb.app_mode)[op.app] == MODE_OFF) {
    off_op_row(cb, op, t);
    return;
  }
  run_op_row(cb, op, t, h, r, d, sh, sr, dtype, red, xs);
}

// One block: whether any token is selected; a single thread sets the handle (concurrent
// cudaGraphSetConditional calls are undefined behaviour).
__global__ void xmix_gate_kernel(const ControlBlock* __restrict__ cbp, int32_t site,
                                 int32_t op_index, int32_t n_rows,
                                 cudaGraphConditionalHandle handle) {
  const ControlBlock& cb = *cbp;
  if (!op_in_range(cb, site, op_index)) {
    if (threadIdx.x == 0) cudaGraphSetConditional(handle, 0u);
    return;
  }
  const OpDesc& op = ptr<const OpDesc>(cb.ops)[ptr<const int32_t>(cb.site_first)[site] + op_index];
  int any = 0;
  if (ptr<const int32_t>(cb.app_mode)[op.app] != MODE_OFF) {
    for (int32_t t = threadIdx.x; t < n_rows && !any; t += blockDim.x) {
      int32_t slot;
      any = op_selects(cb, op, t, &slot) ? 1 : 0;
    }
  }
  any = __syncthreads_or(any);
  if (threadIdx.x == 0) cudaGraphSetConditional(handle, any ? 1u : 0u);
}

// Prologue: per-slot resets, then one thread per scheduled request walks its tokens in
// order (span state is sequential within a request).
__global__ void xmix_prologue_reset(const ControlBlock* __restrict__ cbp) {
  prologue_reset_row(*cbp, blockIdx.x, threadIdx.x, blockDim.x);
}

__global__ void xmix_prologue_tokens(const ControlBlock* __restrict__ cbp, const void* ids,
                                     int32_t ids_dtype) {
  prologue_row_tokens(*cbp, blockIdx.x * blockDim.x + threadIdx.x, ids, ids_dtype);
}

// Custom ops: a select kernel materialises the mask, the user kernel runs, a finish kernel
// turns its per-row output into the result channel and latch state.
__global__ void xmix_custom_select(const ControlBlock* __restrict__ cbp, int32_t site,
                                   int32_t op_index, int32_t n_rows, uint8_t* select, float* out) {
  const ControlBlock& cb = *cbp;
  const int32_t t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n_rows) return;
  if (!op_in_range(cb, site, op_index)) {
    select[t] = 0;
    out[t] = nan_f();
    return;
  }
  const OpDesc& op = ptr<const OpDesc>(cb.ops)[ptr<const int32_t>(cb.site_first)[site] + op_index];
  int32_t slot;
  const bool mode_on = ptr<const int32_t>(cb.app_mode)[op.app] != MODE_OFF;
  select[t] = mode_on && op_selects(cb, op, t, &slot) ? 1 : 0;
  out[t] = nan_f();
}

__global__ void xmix_custom_finish(const ControlBlock* __restrict__ cbp, int32_t site,
                                   int32_t op_index, int32_t n_rows, const uint8_t* select,
                                   const float* out) {
  const ControlBlock& cb = *cbp;
  const int32_t t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n_rows || !op_in_range(cb, site, op_index)) return;
  const OpDesc& op = ptr<const OpDesc>(cb.ops)[ptr<const int32_t>(cb.site_first)[site] + op_index];
  if (op.channel < 0) return;
  const float v = out[t];
  if (t < cb.max_tokens) set_result(cb, t, op.channel, v, select[t] != 0);
  if (select[t] && v == v)
    note_read(cb, op.channel, ptr<const int32_t>(cb.tok_slot)[t],
              ptr<const uint32_t>(cb.tok_flags)[t], v);
}

// After a user write kernel: non-finite elements of the rows it was given become 0 (the CPU
// twin does the same); one block per row.
__global__ void xmix_custom_guard(const ControlBlock* __restrict__ cbp, int32_t site,
                                  int32_t op_index, const uint8_t* select, void* h, int64_t sh,
                                  int32_t d, int32_t dtype) {
  const ControlBlock& cb = *cbp;
  const int32_t t = blockIdx.x;
  if (!select[t] || !op_in_range(cb, site, op_index)) return;
  const OpDesc& op = ptr<const OpDesc>(cb.ops)[ptr<const int32_t>(cb.site_first)[site] + op_index];
  if (op.channel >= 0) return;  // a read does not write
  char* row = static_cast<char*>(h) + static_cast<int64_t>(t) * sh * dtype_size(dtype);
  int32_t refused = 0;
  for (int32_t i = threadIdx.x; i < d; i += blockDim.x)
    if (!is_finite_f(load(row, i, dtype))) {
      store(row, i, dtype, 0.f);
      ++refused;
    }
  if (refused) atomicAdd(ptr<int32_t>(cb.app_nonfinite) + op.app, refused);
}

// Static shared memory of a kernel and this device's opt-in limit, read once (smem.h).
struct KernelSmem {
  const void* kernel = nullptr;
  size_t static_bytes = 0;
  size_t opted_in = 0;  // MaxDynamicSharedMemorySize as this process set it (0: never)
};

int device_optin_limit(size_t* limit) {
  static int cached = -1;
  if (cached < 0) {
    int dev = 0, v = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (e != cudaSuccess) return static_cast<int>(e);
    cached = v;
  }
  *limit = static_cast<size_t>(cached);
  return 0;
}

KernelSmem& smem_of(const void* kernel) {
  static KernelSmem anchor, op;
  KernelSmem& k = kernel == reinterpret_cast<const void*>(&xmix_site_anchor) ? anchor : op;
  k.kernel = kernel;
  return k;
}

int kernel_static_smem(KernelSmem& k) {
  if (k.static_bytes) return 0;
  cudaFuncAttributes a;
  const cudaError_t e = cudaFuncGetAttributes(&a, k.kernel);
  if (e != cudaSuccess) return static_cast<int>(e);
  k.static_bytes = a.sharedSizeBytes ? a.sharedSizeBytes : 1;
  return 0;
}

// Opts the kernel in to the launch's dynamic shared memory where static + dynamic passes the
// default limit (once per size increase); cudaErrorInvalidValue where no opt-in can fit
// (refused at start by site_smem_check, which names the hidden size).
int prepare_smem(const void* kernel, int32_t d) {
  KernelSmem& k = smem_of(kernel);
  if (int e = kernel_static_smem(k)) return e;
  size_t limit = 0;
  if (int e = device_optin_limit(&limit)) return e;
  const SmemPlan p = plan_smem(k.static_bytes, site_dynamic_smem(d), limit);
  if (!p.fits) return static_cast<int>(cudaErrorInvalidValue);
  if (!must_raise_attribute(p, k.opted_in)) return 0;
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(p.dynamic_bytes));
  if (e != cudaSuccess) return static_cast<int>(e);
  k.opted_in = p.dynamic_bytes;
  return 0;
}

}  // namespace

int launch_site_anchor(const ControlBlock* cb, int32_t site, void* h, const void* r, int32_t n_rows,
                       int32_t d, int64_t stride_h, int64_t stride_r, int32_t dtype, void* stream) {
  if (n_rows <= 0) return 0;
  if (int e = prepare_smem(reinterpret_cast<const void*>(&xmix_site_anchor), d)) return e;
  xmix_site_anchor<<<n_rows, kThreads, site_dynamic_smem(d), static_cast<cudaStream_t>(stream)>>>(
      cb, site, h, r, d, stride_h, stride_r, dtype);
  return static_cast<int>(cudaGetLastError());
}

int launch_op(const ControlBlock* cb, int32_t site, int32_t op_index, void* h, const void* r,
              int32_t n_rows, int32_t d, int64_t stride_h, int64_t stride_r, int32_t dtype,
              void* stream) {
  if (n_rows <= 0) return 0;
  if (int e = prepare_smem(reinterpret_cast<const void*>(&xmix_op_kernel), d)) return e;
  xmix_op_kernel<<<n_rows, kThreads, site_dynamic_smem(d), static_cast<cudaStream_t>(stream)>>>(
      cb, site, op_index, h, r, d, stride_h, stride_r, dtype);
  return static_cast<int>(cudaGetLastError());
}

int launch_gate(const ControlBlock* cb, int32_t site, int32_t op_index, int32_t n_rows,
                uint64_t cond_handle, void* stream) {
  xmix_gate_kernel<<<1, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      cb, site, op_index, n_rows, static_cast<cudaGraphConditionalHandle>(cond_handle));
  return static_cast<int>(cudaGetLastError());
}

int launch_prologue(const ControlBlock* cb, const void* input_ids, int32_t ids_dtype,
                    int32_t max_rows, void* stream) {
  if (max_rows <= 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  xmix_prologue_reset<<<max_rows, 128, 0, s>>>(cb);
  xmix_prologue_tokens<<<(max_rows + 127) / 128, 128, 0, s>>>(cb, input_ids, ids_dtype);
  return static_cast<int>(cudaGetLastError());
}

int launch_custom(const ControlBlock* cb, int32_t site, int32_t op_index, uint64_t kernel,
                  const xmix_custom_args* host_args, uint8_t* select_scratch, float* out_scratch,
                  void* stream) {
  const int32_t n_rows = host_args->n_rows;
  if (n_rows <= 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  const int blocks = (n_rows + 255) / 256;
  xmix_custom_select<<<blocks, 256, 0, s>>>(cb, site, op_index, n_rows, select_scratch,
                                            out_scratch);
  xmix_custom_args args = *host_args;
  args.select = select_scratch;
  args.out = out_scratch;
  void* params[] = {&args};
  cudaError_t e =
      cudaLaunchKernel(ptr<const void>(kernel), dim3(n_rows), dim3(kThreads), params, 0, s);
  if (e != cudaSuccess) return static_cast<int>(e);
  xmix_custom_guard<<<n_rows, 256, 0, s>>>(cb, site, op_index, select_scratch, args.h,
                                           args.stride_h, args.d, args.dtype);
  xmix_custom_finish<<<blocks, 256, 0, s>>>(cb, site, op_index, n_rows, select_scratch,
                                            out_scratch);
  return static_cast<int>(cudaGetLastError());
}

int load_custom_cuda(const void* image, const char* name, uint64_t* kernel) {
  cudaLibrary_t lib;
  cudaError_t e = cudaLibraryLoadData(&lib, image, nullptr, nullptr, 0, nullptr, nullptr, 0);
  if (e != cudaSuccess) return static_cast<int>(e);
  cudaKernel_t k;
  e = cudaLibraryGetKernel(&k, lib, name);
  if (e != cudaSuccess) return static_cast<int>(e);
  // Launched through cudaLaunchKernel with the handle cast to a function pointer, as the
  // runtime documents for context-less kernels.
  *kernel = addr(k);
  return 0;
}

int preload_kernels(int* count) {
  // Loads every module-level kernel now (lazy loading would otherwise load one the first
  // time it is launched, which may be in the middle of a stream capture).
  const void* kernels[] = {reinterpret_cast<const void*>(&xmix_site_anchor),
                           reinterpret_cast<const void*>(&xmix_op_kernel),
                           reinterpret_cast<const void*>(&xmix_gate_kernel),
                           reinterpret_cast<const void*>(&xmix_prologue_reset),
                           reinterpret_cast<const void*>(&xmix_prologue_tokens),
                           reinterpret_cast<const void*>(&xmix_custom_select),
                           reinterpret_cast<const void*>(&xmix_custom_guard),
                           reinterpret_cast<const void*>(&xmix_custom_finish)};
  int n = 0;
  for (const void* k : kernels) {
    cudaFuncAttributes a;
    const cudaError_t e = cudaFuncGetAttributes(&a, k);
    if (e != cudaSuccess) {
      cudaGetLastError();
      if (count) *count = n;
      return static_cast<int>(e);
    }
    ++n;
  }
  if (count) *count = n;
  return 0;
}

int site_smem_check(int32_t d, std::string* refusal) {
  size_t limit = 0;
  if (int e = device_optin_limit(&limit)) return e;
  for (const void* kernel : {reinterpret_cast<const void*>(&xmix_site_anchor),
                             reinterpret_cast<const void*>(&xmix_op_kernel)}) {
    KernelSmem& k = smem_of(kernel);
    if (int e = kernel_static_smem(k)) return e;
    const std::string why =
        smem_refusal(d, plan_smem(k.static_bytes, site_dynamic_smem(d), limit), limit);
    if (!why.empty()) {
      *refusal = why;
      return 0;
    }
  }
  refusal->clear();
  return 0;
}

int prepare_op_kernel_smem(int32_t d) {
  return prepare_smem(reinterpret_cast<const void*>(&xmix_op_kernel), d);
}

const void* anchor_kernel_symbol() { return reinterpret_cast<const void*>(&xmix_site_anchor); }
const void* op_kernel_symbol() { return reinterpret_cast<const void*>(&xmix_op_kernel); }
const void* gate_kernel_symbol() { return reinterpret_cast<const void*>(&xmix_gate_kernel); }
// For the graph applier (csrc/graph/applier.cu), which splices custom ops as kernel nodes.
const void* custom_select_kernel_symbol() {
  return reinterpret_cast<const void*>(&xmix_custom_select);
}
const void* custom_finish_kernel_symbol() {
  return reinterpret_cast<const void*>(&xmix_custom_finish);
}

}  // namespace xmix
