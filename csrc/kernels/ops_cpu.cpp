// CPU twins of the built-in primitives. The CUDA twins (ops.cu) compute the same formulas
// with the same fp32 accumulation; tests/test_kernels.py checks both against xmix.lang.reference.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "xmix/control.h"
#include "xmix/custom.h"
#include "xmix/site.h"

namespace xmix {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---------------------------------------------------------------- fp32 row loops
// Every built-in op works on whole rows in fp32 scratch, so its loops vectorise: a row is
// converted once on load and once on store (an element at a time, these loops cost the
// ablation of 24 sites ~40 ms per 1 024-token prefill step on the CPU engine).
// Dot products (ablation, clamp, probes, LEACE, SAE encoders) use 32 partial sums in a fixed
// order (vectorisable without reassociation, and enough independent chains to
// hide the add latency); the CUDA twin reduces across lanes, so the two differ only by fp32
// reassociation (neither twin fuses multiply-adds: CMakeLists.txt).
constexpr int32_t kLanes = 32;
typedef float v8 __attribute__((vector_size(32), aligned(4)));  // unaligned loads allowed

// Lane j of the 32 accumulates elements i = j (mod 32); then halves are added pairwise
// (j += j + 16, j += j + 8, ...), then the tail in order.
inline float dot32(const float* a, const float* b, int32_t n) {
  v8 acc0 = {}, acc1 = {}, acc2 = {}, acc3 = {};
  int32_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    acc0 += *reinterpret_cast<const v8*>(a + i) * *reinterpret_cast<const v8*>(b + i);
    acc1 += *reinterpret_cast<const v8*>(a + i + 8) * *reinterpret_cast<const v8*>(b + i + 8);
    acc2 += *reinterpret_cast<const v8*>(a + i + 16) * *reinterpret_cast<const v8*>(b + i + 16);
    acc3 += *reinterpret_cast<const v8*>(a + i + 24) * *reinterpret_cast<const v8*>(b + i + 24);
  }
  acc0 += acc2;
  acc1 += acc3;
  acc0 += acc1;
  float sum =
      ((acc0[0] + acc0[4]) + (acc0[2] + acc0[6])) + ((acc0[1] + acc0[5]) + (acc0[3] + acc0[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// One encoder row against n input rows: the encoder's hot loop, compiled for AVX-512 and
// AVX2 as well as the baseline and chosen at load time by the CPU it runs on.
__attribute__((target_clones("avx512f", "avx2,fma", "default"))) void dot_rows(
    const float* w, const float* x, int32_t n, int32_t d, float bias, float* out) {
  for (int32_t r = 0; r < n; ++r) out[r] = dot32(w, x + static_cast<int64_t>(r) * d, d) + bias;
}

__attribute__((target_clones("avx512f", "avx2,fma", "default"))) float dot_f(const float* a,
                                                                             const float* b,
                                                                             int32_t n) {
  return dot32(a, b, n);
}

// dst[i] = src[i] converted to fp32.
__attribute__((target_clones("avx512f", "avx2,fma", "default"))) void load_row(const void* src,
                                                                               int32_t dtype,
                                                                               int32_t d,
                                                                               float* dst) {
  if (dtype == DT_F32) {
    std::memcpy(dst, src, sizeof(float) * static_cast<size_t>(d));
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src);
  if (dtype == DT_BF16)
    for (int32_t i = 0; i < d; ++i) dst[i] = bf16_to_float(s[i]);
  else
    for (int32_t i = 0; i < d; ++i) dst[i] = f16_to_float(s[i]);
}

// dst[i] += src[i] converted to fp32 (the stream: hidden + residual).
__attribute__((target_clones("avx512f", "avx2,fma", "default"))) void add_row(float* dst,
                                                                              const void* src,
                                                                              int32_t dtype,
                                                                              int32_t d) {
  if (dtype == DT_F32) {
    const float* s = static_cast<const float*>(src);
    for (int32_t i = 0; i < d; ++i) dst[i] += s[i];
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src);
  if (dtype == DT_BF16)
    for (int32_t i = 0; i < d; ++i) dst[i] += bf16_to_float(s[i]);
  else
    for (int32_t i = 0; i < d; ++i) dst[i] += f16_to_float(s[i]);
}

// out[i] = h[i] + a * v[i]
__attribute__((target_clones("avx512f", "avx2,fma", "default"))) void axpy(float* out,
                                                                           const float* h, float a,
                                                                           const float* v,
                                                                           int32_t d) {
  for (int32_t i = 0; i < d; ++i) out[i] = h[i] + a * v[i];
}

// Stores v[0..d) into a row of dtype with store_finite's rule (an element whose new value is
// not finite in dtype keeps its old value); returns how many elements kept theirs. The common
// case, every element finite, is one vectorised check and one copy.
__attribute__((target_clones("avx512f", "avx2,fma", "default"))) int32_t store_row(void* dst,
                                                                                   int32_t dtype,
                                                                                   const float* v,
                                                                                   int32_t d) {
  int32_t refused = 0;
  if (dtype == DT_F32) {
    int32_t bad = 0;
    for (int32_t i = 0; i < d; ++i) bad += is_finite_f(v[i]) ? 0 : 1;
    float* o = static_cast<float*>(dst);
    if (!bad) {
      std::memcpy(o, v, sizeof(float) * static_cast<size_t>(d));
      return 0;
    }
    for (int32_t i = 0; i < d; ++i) {
      if (is_finite_f(v[i]))
        o[i] = v[i];
      else
        ++refused;
    }
    return refused;
  }
  // Finite after rounding to 16 bits: the exponent field is not all ones. bf16 without a
  // branch (select and count), so it vectorises like fp32.
  uint16_t* o = static_cast<uint16_t*>(dst);
  if (dtype == DT_BF16) {
    const uint32_t* u = reinterpret_cast<const uint32_t*>(v);
    for (int32_t i = 0; i < d; ++i) {
      // float_to_bf16's rounding; a NaN (which it keeps a NaN) is refused, as is a value
      // that rounds to Inf, so the NaN branch is folded into the check
      const uint16_t b = static_cast<uint16_t>((u[i] + 0x7fffu + ((u[i] >> 16) & 1u)) >> 16);
      const uint32_t ok = ((u[i] & 0x7fffffffu) <= 0x7f800000u) & ((b & 0x7f80u) != 0x7f80u);
      o[i] = ok ? b : o[i];
      refused += static_cast<int32_t>(ok ^ 1u);
    }
    return refused;
  }
  for (int32_t i = 0; i < d; ++i) {
    const uint16_t b = float_to_f16(v[i]);
    if ((b & 0x7c00u) != 0x7c00u)
      o[i] = b;
    else
      ++refused;
  }
  return refused;
}

struct Row {
  void* h;
  const void* r;
  int32_t d;
  int32_t dtype;
  float hid(int32_t i) const { return load(h, i, dtype); }
  mutable int32_t refused = 0;  // elements store_finite kept
  // Whole rows: the stream or the hidden states into dst (d floats), v into the hidden states.
  void load_x(float* dst) const {
    load_row(h, dtype, d, dst);
    if (r) add_row(dst, r, dtype, d);
  }
  void load_hid(float* dst) const { load_row(h, dtype, d, dst); }
  void store_h(const float* v) const { refused += store_row(h, dtype, v, d); }
};

// Per-op fp32 scratch rows: the stream, the hidden states, the new hidden states.
struct Scratch {
  explicit Scratch(int32_t d)
      : x(static_cast<size_t>(d)), hid(static_cast<size_t>(d)), out(static_cast<size_t>(d)) {}
  std::vector<float> x, hid, out;
};

void count_refused(const ControlBlock& cb, const OpDesc& op, int32_t n) {
  if (n) ptr<int32_t>(cb.app_nonfinite)[op.app] += n;
}

Row row_at(void* h, const void* r, int64_t t, int32_t d, int64_t sh, int64_t sr, int32_t dtype) {
  const int64_t es = dtype_size(dtype);
  Row row;
  row.h = static_cast<char*>(h) + t * sh * es;
  row.r = r ? static_cast<const char*>(r) + t * sr * es : nullptr;
  row.d = d;
  row.dtype = dtype;
  return row;
}

// Latch bookkeeping shared by every read: prompt tokens accumulate sum/count/last.
void note_read(const ControlBlock& cb, int32_t channel, int32_t slot, uint32_t flags, float v) {
  if (!(flags & TF_PROMPT)) return;
  float* s = ptr<float>(cb.read_state) +
             (static_cast<int64_t>(slot) * cb.n_channels + channel) * kReadStateWidth;
  s[0] += v;
  s[1] += 1.f;
  if (flags & TF_LAST) s[2] = v;
}

// x: the row's stream (d floats).
float probe_value(const float* x, int32_t d, const OpDesc& op, const float* p) {
  return sigmoid(dot_f(x, ptr<const float>(op.a0), d) + p[op.param_base + P_PROBE_BIAS]);
}

float distance_value(const float* x, int32_t d, const OpDesc& op) {
  const float* mu = ptr<const float>(op.a0);
  float best = std::numeric_limits<float>::infinity();
  for (int32_t k = 0; k < op.n; ++k) {
    float acc = 0.f;
    for (int32_t i = 0; i < d; ++i) {
      float e = x[i] - mu[static_cast<int64_t>(k) * d + i];
      acc += e * e;
    }
    best = std::fmin(best, std::sqrt(acc));
  }
  return best;
}

// CAST: m = running sum / count over prompt tokens (vec_state holds sum[d], count);
// value = cos(m, tanh(P m)), P = v v^T / (v^T v). a0 = v, a1 = {1 / (v^T v)}.
float cosine_of_mean(const float* sum, float count, const OpDesc& op, int32_t d) {
  const float* v = ptr<const float>(op.a0);
  const float inv_vv = ptr<const float>(op.a1)[0];
  float vm = 0.f;
  for (int32_t i = 0; i < d; ++i) vm += v[i] * (sum[i] / count);
  const float a = vm * inv_vv;
  float mu = 0.f, mm = 0.f, uu = 0.f;
  for (int32_t i = 0; i < d; ++i) {
    const float m = sum[i] / count;
    const float u = std::tanh(a * v[i]);
    mu += m * u;
    mm += m * m;
    uu += u * u;
  }
  const float den = std::sqrt(mm) * std::sqrt(uu);
  return den > 0.f ? mu / den : 0.f;
}

void apply_write(const Row& row, const OpDesc& op, const float* p, Scratch& sc) {
  const int32_t d = row.d;
  float* x = sc.x.data();
  float* hid = sc.hid.data();
  float* out = sc.out.data();
  switch (op.kind) {
    case OP_ADD: {
      row.load_hid(hid);
      axpy(out, hid, p[op.param_base + P_ADD_SCALE], ptr<const float>(op.a0), d);
      break;
    }
    case OP_ABLATE: {
      const float* u = ptr<const float>(op.a0);
      row.load_x(x);
      row.load_hid(hid);
      axpy(out, hid, -dot_f(x, u, d), u, d);
      break;
    }
    case OP_CLAMP: {
      const float* u = ptr<const float>(op.a0);
      row.load_x(x);
      row.load_hid(hid);
      const float proj = dot_f(x, u, d);
      const float lo = p[op.param_base + P_CLAMP_LO], hi = p[op.param_base + P_CLAMP_HI];
      axpy(out, hid, std::fmin(std::fmax(proj, lo), hi) - proj, u, d);
      break;
    }
    case OP_AFFINE: {
      const float* A = ptr<const float>(op.a0);
      const float* mus = ptr<const float>(op.a1);
      const float* mut = ptr<const float>(op.a2);
      row.load_x(x);
      for (int32_t j = 0; j < d; ++j) x[j] -= mus[j];
      // out = A (x - mu_s) + mu_t - r: the new stream, less the residual, is the new h.
      for (int32_t i = 0; i < d; ++i)
        out[i] = dot_f(A + static_cast<int64_t>(i) * d, x, d) + mut[i];
      if (row.r) {
        load_row(row.r, row.dtype, d, hid);
        for (int32_t i = 0; i < d; ++i) out[i] -= hid[i];
      }
      break;
    }
    case OP_ROUTER: {
      // Row = router logits of one token over d experts; a0 = mask in {-1, 0, 1}.
      const float* mask = ptr<const float>(op.a0);
      const float delta = p[op.param_base + P_ROUTER_DELTA];
      row.load_hid(hid);
      float mx = -std::numeric_limits<float>::infinity();
      for (int32_t e = 0; e < d; ++e) mx = std::fmax(mx, hid[e]);
      float se = 0.f;
      for (int32_t e = 0; e < d; ++e) se += std::exp(hid[e] - mx);
      const float lse = mx + std::log(se);
      float lmax = -std::numeric_limits<float>::infinity(), lmin = -lmax;
      for (int32_t e = 0; e < d; ++e) {
        out[e] = hid[e] - lse;
        lmax = std::fmax(lmax, out[e]);
        lmin = std::fmin(lmin, out[e]);
      }
      for (int32_t e = 0; e < d; ++e) {
        if (mask[e] > 0.f)
          out[e] = lmax + delta;
        else if (mask[e] < 0.f)
          out[e] = lmin - delta;
      }
      break;
    }
    default: return;
  }
  row.store_h(out);
}

// ---------------------------------------------------------------- SAEs
struct Sae {
  const float* w_enc;  // [F, d]: one encoder row per feature
  const float* w_dec;  // [F, d]
  const float* b_enc;
  const float* thr;
  const float* b_dec;
  const float* feats;  // listed features (float ids)
  int32_t F, d, arch, norm, k;
  bool b_dec_in;
  float pre(const float* xin, int32_t f) const {
    float out;
    dot_rows(w_enc + static_cast<int64_t>(f) * d, xin, 1, d, b_enc[f], &out);
    return out;
  }
};

Sae sae_of(const OpDesc& op, int32_t d) {
  Sae s;
  const float* aux = ptr<const float>(op.a2);
  s.F = sae_n_features(op);
  s.d = d;
  s.w_enc = ptr<const float>(op.a0);
  s.w_dec = ptr<const float>(op.a1);
  s.b_enc = aux;
  s.thr = aux + s.F;
  s.b_dec = aux + 2 * static_cast<int64_t>(s.F);
  s.k = static_cast<int32_t>(aux[2 * static_cast<int64_t>(s.F) + d]);
  s.feats = ptr<const float>(op.a3);
  s.arch = sae_arch(op);
  s.norm = sae_norm(op);
  s.b_dec_in = sae_b_dec_in(op);
  return s;
}

// The encoder input of a row (normalised, b_dec removed) into xin; returns the factor by
// which decoder output appears in the stream.
float sae_input(const Row& row, const Sae& s, float* xin) {
  const int32_t d = s.d;
  row.load_x(xin);
  float scale = 1.f;
  if (s.norm == SAE_NORM_RESCALE) {
    float ss = 0.f;
    for (int32_t i = 0; i < d; ++i) ss += xin[i] * xin[i];
    const float nrm = std::sqrt(ss);
    const float coeff = nrm > 0.f ? std::sqrt(static_cast<float>(d)) / nrm : 0.f;
    scale = nrm > 0.f ? nrm / std::sqrt(static_cast<float>(d)) : 0.f;
    for (int32_t i = 0; i < d; ++i) xin[i] *= coeff;
  } else if (s.norm == SAE_NORM_LAYER) {
    float mu = 0.f;
    for (int32_t i = 0; i < d; ++i) mu += xin[i];
    mu /= static_cast<float>(d);
    float var = 0.f;
    for (int32_t i = 0; i < d; ++i) {
      xin[i] -= mu;
      var += xin[i] * xin[i];
    }
    const float sd = std::sqrt(var / static_cast<float>(d - 1));  // unbiased, as torch.std
    for (int32_t i = 0; i < d; ++i) xin[i] /= sd + kSaeLnEps;
    scale = sd;
  }
  if (s.b_dec_in)
    for (int32_t i = 0; i < d; ++i) xin[i] -= s.b_dec[i];
  return scale;
}

// Activations of the n listed features at one row. TopK: a feature is active when fewer
// than k features come before it in the order of sae_before, which takes a full pass.
void sae_listed_acts(const Sae& s, const float* xin, int32_t n, float* acts) {
  float pre[kSaeMaxFeatures];
  int32_t ids[kSaeMaxFeatures];
  for (int32_t j = 0; j < n; ++j) {
    ids[j] = static_cast<int32_t>(s.feats[j]);
    pre[j] = s.pre(xin, ids[j]);
    acts[j] = sae_act(pre[j], s.arch, s.thr[ids[j]]);
  }
  if (s.arch != SAE_TOPK) return;
  int32_t ahead[kSaeMaxFeatures] = {0};
  for (int32_t g = 0; g < s.F; ++g) {
    const float pg = s.pre(xin, g);
    for (int32_t j = 0; j < n; ++j) ahead[j] += sae_before(pg, g, pre[j], ids[j]) ? 1 : 0;
  }
  for (int32_t j = 0; j < n; ++j)
    if (ahead[j] >= s.k) acts[j] = 0.f;
}

struct Cand {
  float v;
  int32_t id;
};

void run_sae_cpu(const ControlBlock& cb, const OpDesc& op, void* h, const void* r, int32_t n_rows,
                 int32_t d, int64_t sh, int64_t sr, int32_t dtype) {
  const Sae s = sae_of(op, d);
  const uint32_t* tok_flags = ptr<const uint32_t>(cb.tok_flags);
  const float* params = ptr<const float>(cb.slot_params);
  const bool is_read = op.kind == OP_SAE_READ;
  const bool listed = sae_listed(op);
  const int32_t n_ch = read_channels(op);
  // Selected rows only: rows of requests without the app are skipped, never computed.
  std::vector<int32_t> rows, slots;
  for (int32_t t = 0; t < n_rows; ++t) {
    int32_t slot;
    const bool sel = op_selects(cb, op, t, &slot);
    if (is_read && t < cb.max_tokens)
      for (int32_t c = 0; c < n_ch; ++c) set_result(cb, t, op.channel + c, 0.f, false);
    if (sel) {
      rows.push_back(t);
      slots.push_back(slot);
    }
  }
  if (rows.empty()) return;
  const int32_t n_sel = static_cast<int32_t>(rows.size());
  std::vector<float> xin(static_cast<size_t>(n_sel) * d), scale(static_cast<size_t>(n_sel));
  for (int32_t j = 0; j < n_sel; ++j) {
    const Row row = row_at(h, r, rows[j], d, sh, sr, dtype);
    scale[j] = sae_input(row, s, xin.data() + static_cast<int64_t>(j) * d);
  }
  if (listed) {
    float acts[kSaeMaxFeatures];
    std::vector<float> delta(static_cast<size_t>(d)), hid(static_cast<size_t>(d));
    for (int32_t j = 0; j < n_sel; ++j) {
      const int32_t t = rows[j], slot = slots[j];
      sae_listed_acts(s, xin.data() + static_cast<int64_t>(j) * d, op.n, acts);
      if (is_read) {
        for (int32_t c = 0; c < op.n; ++c) {
          set_result(cb, t, op.channel + c, acts[c], true);
          note_read(cb, op.channel + c, slot, tok_flags[t], acts[c]);
        }
        continue;
      }
      const float value =
          params[static_cast<int64_t>(slot) * cb.n_params + op.param_base + P_SAE_CLAMP_VALUE];
      const Row row = row_at(h, r, t, d, sh, sr, dtype);
      std::fill(delta.begin(), delta.end(), 0.f);
      for (int32_t c = 0; c < op.n; ++c) {
        const float coef = (value - acts[c]) * scale[j];
        const float* w = s.w_dec + static_cast<int64_t>(s.feats[c]) * d;
        for (int32_t i = 0; i < d; ++i) delta[i] += coef * w[i];
      }
      row.load_hid(hid.data());
      for (int32_t i = 0; i < d; ++i) hid[i] += delta[i];
      row.store_h(hid.data());
      count_refused(cb, op, row.refused);
    }
    return;
  }
  // Top-K read: features in the outer loop, so each encoder row is read once per step.
  // A heap per row keeps its best K candidates with the worst on top. TopK SAEs select on
  // the pre-activation: the best min(K, k) pre-activations are all among the SAE's k.
  const int32_t K = op.n;
  const int32_t keep = s.arch == SAE_TOPK ? std::min(K, s.k) : K;
  auto worse_on_top = [](const Cand& a, const Cand& b) { return sae_before(a.v, a.id, b.v, b.id); };
  std::vector<std::vector<Cand>> heaps(static_cast<size_t>(n_sel));
  for (auto& hp : heaps) hp.reserve(static_cast<size_t>(keep));
  std::vector<float> pres(static_cast<size_t>(n_sel));
  for (int32_t f = 0; f < s.F; ++f) {
    dot_rows(s.w_enc + static_cast<int64_t>(f) * d, xin.data(), n_sel, d, s.b_enc[f], pres.data());
    for (int32_t j = 0; j < n_sel; ++j) {
      const float pre = pres[j];
      const float v = s.arch == SAE_TOPK ? pre : sae_act(pre, s.arch, s.thr[f]);
      if (s.arch != SAE_TOPK && !(v > 0.f)) continue;
      auto& hp = heaps[j];
      if (static_cast<int32_t>(hp.size()) < keep) {
        hp.push_back({v, f});
        std::push_heap(hp.begin(), hp.end(), worse_on_top);
      } else if (sae_before(v, f, hp.front().v, hp.front().id)) {
        std::pop_heap(hp.begin(), hp.end(), worse_on_top);
        hp.back() = {v, f};
        std::push_heap(hp.begin(), hp.end(), worse_on_top);
      }
    }
  }
  for (int32_t j = 0; j < n_sel; ++j) {
    const int32_t t = rows[j];
    auto& hp = heaps[j];
    std::sort(hp.begin(), hp.end(), worse_on_top);
    float* dst = ptr<float>(cb.capture) + op.capture_offset + static_cast<int64_t>(t) * 2 * K;
    int32_t n_out = 0;
    for (const Cand& c : hp) {
      if (!(c.v > 0.f)) break;  // only active features are reported
      dst[n_out] = static_cast<float>(c.id);
      dst[K + n_out] = c.v;
      ++n_out;
    }
    for (int32_t i = n_out; i < K; ++i) {
      dst[i] = -1.f;
      dst[K + i] = 0.f;
    }
    const float v = n_out ? dst[K] : 0.f;
    if (t < cb.max_tokens) set_result(cb, t, op.channel, v, true);
    note_read(cb, op.channel, slots[j], tok_flags[t], v);
  }
}

}  // namespace

void run_op_cpu(const ControlBlock& cb, const OpDesc& op, void* h, const void* r, int32_t n_rows,
                int32_t d, int64_t stride_h, int64_t stride_r, int32_t dtype) {
  const bool is_read = op_is_read(op.kind);
  const uint32_t* tok_flags = ptr<const uint32_t>(cb.tok_flags);
  const float* params = ptr<const float>(cb.slot_params);

  if (op.kind == OP_SAE_READ || op.kind == OP_SAE_CLAMP) {
    run_sae_cpu(cb, op, h, r, n_rows, d, stride_h, stride_r, dtype);
    return;
  }
  if (op.kind == OP_STOP || op.kind == OP_SINCE) {
    for (int32_t t = 0; t < n_rows; ++t) {
      int32_t slot;
      if (op_selects(cb, op, t, &slot)) monitor_token(cb, op, t, slot);
    }
    return;
  }
  if (op.kind == OP_CUSTOM) {
    std::vector<uint8_t> select(static_cast<size_t>(n_rows), 0);
    for (int32_t t = 0; t < n_rows; ++t) {
      int32_t slot;
      select[t] = op_selects(cb, op, t, &slot) ? 1 : 0;
    }
    std::vector<float> out;
    if (op.channel >= 0) out.assign(static_cast<size_t>(n_rows), kNaN);
    xmix_custom_args args{};
    args.h = h;
    args.r = r;
    args.stride_h = stride_h;
    args.stride_r = stride_r;
    args.n_rows = n_rows;
    args.d = d;
    args.dtype = dtype;
    args.n_params = cb.n_params;
    args.select = select.data();
    args.tok_slot = ptr<const int32_t>(cb.tok_slot);
    args.tok_pos = ptr<const int32_t>(cb.tok_pos);
    args.slot_params = params;
    args.param_base = op.param_base;
    args.artifact = ptr<const float>(op.a0);
    args.artifact_numel = custom_artifact_numel(op);
    args.out = op.channel >= 0 ? out.data() : nullptr;
    from_addr<xmix_custom_cpu_fn>(op.fn)(&args);
    // A user kernel's non-finite elements in the rows it was given become 0 (its value
    // before the kernel is not kept: the CUDA twin has no copy of the rows either).
    int32_t refused = 0;
    for (int32_t t = 0; op.channel < 0 && t < n_rows; ++t) {
      if (!select[t]) continue;
      const Row row = row_at(h, r, t, d, stride_h, stride_r, dtype);
      for (int32_t i = 0; i < d; ++i)
        if (!is_finite_f(row.hid(i))) {
          store(row.h, i, dtype, 0.f);
          ++refused;
        }
    }
    count_refused(cb, op, refused);
    if (op.channel >= 0) {
      for (int32_t t = 0; t < n_rows; ++t) {
        const float v = out[t];
        if (t < cb.max_tokens) set_result(cb, t, op.channel, v, select[t] != 0);
        if (select[t] && v == v)
          note_read(cb, op.channel, ptr<const int32_t>(cb.tok_slot)[t], tok_flags[t], v);
      }
    }
    return;
  }

  Scratch sc(d);
  float* x = sc.x.data();
  for (int32_t t = 0; t < n_rows; ++t) {
    int32_t slot;
    const bool sel = op_selects(cb, op, t, &slot);
    const Row row = row_at(h, r, t, d, stride_h, stride_r, dtype);
    const uint32_t flags = tok_flags[t];
    if (!is_read) {
      if (sel) {
        apply_write(row, op, params + static_cast<int64_t>(slot) * cb.n_params, sc);
        count_refused(cb, op, row.refused);
      }
      continue;
    }
    float v = kNaN;
    bool has = false;
    const float* p = slot >= 0 ? params + static_cast<int64_t>(slot) * cb.n_params : nullptr;
    switch (op.kind) {
      case OP_PROBE:
        if (sel) {
          row.load_x(x);
          v = probe_value(x, d, op, p);
        }
        has = sel;
        break;
      case OP_DISTANCE:
        if (sel) {
          row.load_x(x);
          v = distance_value(x, d, op);
        }
        has = sel;
        break;
      case OP_CAPTURE:
        if (sel) {
          const int32_t w = capture_width(op), d0 = capture_first_dim(op);
          float* dst = ptr<float>(cb.capture) + op.capture_offset + static_cast<int64_t>(t) * w;
          row.load_x(x);
          std::memcpy(dst, x + d0, sizeof(float) * static_cast<size_t>(w));
          v = 1.f;
          has = true;
        }
        break;
      case OP_COSINE: {
        // Accumulate selected prompt tokens; the value exists once at the last prompt token.
        if (slot < 0 || t >= cb.n_tokens || !app_active(cb, op.app, slot)) break;
        float* st = ptr<float>(cb.vec_state) + static_cast<int64_t>(slot) * cb.vec_state_width +
                    op.state_base;
        if (sel && (flags & TF_PROMPT)) {
          row.load_x(x);
          for (int32_t i = 0; i < d; ++i) st[i] += x[i];
          st[d] += 1.f;
        }
        if ((flags & TF_PROMPT) && (flags & TF_LAST) && st[d] > 0.f) {
          v = cosine_of_mean(st, st[d], op, d);
          has = true;
        }
        break;
      }
      default: break;
    }
    if (t < cb.max_tokens) set_result(cb, t, op.channel, v, has);
    // A NaN read is reported but kept out of the latch sums (as before validity flags).
    if (has && v == v && slot >= 0) note_read(cb, op.channel, slot, flags, v);
  }
}

}  // namespace xmix
