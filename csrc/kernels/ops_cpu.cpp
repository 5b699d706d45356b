// CPU twins of the built-in primitives. The CUDA twins (ops.cu) compute the same formulas
// with the same fp32 accumulation; tests/test_kernels.py checks both against xmix.reference.
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

struct Row {
  void* h;
  const void* r;
  int32_t d;
  int32_t dtype;
  float x(int32_t i) const {  // the stream value: hidden + residual
    float v = load(h, i, dtype);
    return r ? v + load(r, i, dtype) : v;
  }
  float hid(int32_t i) const { return load(h, i, dtype); }
  float res(int32_t i) const { return r ? load(r, i, dtype) : 0.f; }
  void set_h(int32_t i, float v) const { store(h, i, dtype, v); }
};

Row row_at(void* h, const void* r, int64_t t, int32_t d, int64_t sh, int64_t sr, int32_t dtype) {
  const int64_t es = dtype_size(dtype);
  Row row;
  row.h = static_cast<char*>(h) + t * sh * es;
  row.r = r ? static_cast<const char*>(r) + t * sr * es : nullptr;
  row.d = d;
  row.dtype = dtype;
  return row;
}

float dot_x(const Row& row, const float* w) {
  float acc = 0.f;
  for (int32_t i = 0; i < row.d; ++i) acc += row.x(i) * w[i];
  return acc;
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

float probe_value(const Row& row, const OpDesc& op, const float* p) {
  return sigmoid(dot_x(row, ptr<const float>(op.a0)) + p[op.param_base + P_PROBE_BIAS]);
}

float distance_value(const Row& row, const OpDesc& op) {
  const float* mu = ptr<const float>(op.a0);
  float best = std::numeric_limits<float>::infinity();
  for (int32_t k = 0; k < op.n; ++k) {
    float acc = 0.f;
    for (int32_t i = 0; i < row.d; ++i) {
      float e = row.x(i) - mu[static_cast<int64_t>(k) * row.d + i];
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

void apply_write(const Row& row, const OpDesc& op, const float* p, std::vector<float>& scratch) {
  const int32_t d = row.d;
  switch (op.kind) {
    case OP_ADD: {
      const float* v = ptr<const float>(op.a0);
      const float s = p[op.param_base + P_ADD_SCALE];
      for (int32_t i = 0; i < d; ++i) row.set_h(i, row.hid(i) + s * v[i]);
      break;
    }
    case OP_ABLATE: {
      const float* u = ptr<const float>(op.a0);
      const float proj = dot_x(row, u);
      for (int32_t i = 0; i < d; ++i) row.set_h(i, row.hid(i) - proj * u[i]);
      break;
    }
    case OP_CLAMP: {
      const float* u = ptr<const float>(op.a0);
      const float proj = dot_x(row, u);
      const float lo = p[op.param_base + P_CLAMP_LO], hi = p[op.param_base + P_CLAMP_HI];
      const float delta = std::fmin(std::fmax(proj, lo), hi) - proj;
      for (int32_t i = 0; i < d; ++i) row.set_h(i, row.hid(i) + delta * u[i]);
      break;
    }
    case OP_AFFINE: {
      const float* A = ptr<const float>(op.a0);
      const float* mus = ptr<const float>(op.a1);
      const float* mut = ptr<const float>(op.a2);
      scratch.resize(static_cast<size_t>(d));
      for (int32_t j = 0; j < d; ++j) scratch[j] = row.x(j) - mus[j];
      // All of x is read before any element of h is written.
      std::vector<float> out(static_cast<size_t>(d));
      for (int32_t i = 0; i < d; ++i) {
        float acc = 0.f;
        const float* a = A + static_cast<int64_t>(i) * d;
        for (int32_t j = 0; j < d; ++j) acc += a[j] * scratch[j];
        out[i] = acc + mut[i];
      }
      for (int32_t i = 0; i < d; ++i) row.set_h(i, out[i] - row.res(i));
      break;
    }
    case OP_ROUTER: {
      // Row = router logits of one token over d experts; a0 = mask in {-1, 0, 1}.
      const float* mask = ptr<const float>(op.a0);
      const float delta = p[op.param_base + P_ROUTER_DELTA];
      float mx = -std::numeric_limits<float>::infinity();
      for (int32_t e = 0; e < d; ++e) mx = std::fmax(mx, row.hid(e));
      float se = 0.f;
      for (int32_t e = 0; e < d; ++e) se += std::exp(row.hid(e) - mx);
      const float lse = mx + std::log(se);
      float lmax = -std::numeric_limits<float>::infinity(), lmin = -lmax;
      scratch.resize(static_cast<size_t>(d));
      for (int32_t e = 0; e < d; ++e) {
        scratch[e] = row.hid(e) - lse;
        lmax = std::fmax(lmax, scratch[e]);
        lmin = std::fmin(lmin, scratch[e]);
      }
      for (int32_t e = 0; e < d; ++e) {
        float v = scratch[e];
        if (mask[e] > 0.f) v = lmax + delta;
        else if (mask[e] < 0.f) v = lmin - delta;
        row.set_h(e, v);
      }
      break;
    }
    default:
      break;
  }
}

}  // namespace

void run_op_cpu(const ControlBlock& cb, const OpDesc& op, void* h, const void* r,
                int32_t n_rows, int32_t d, int64_t stride_h, int64_t stride_r, int32_t dtype) {
  const bool is_read = op_is_read(op.kind);
  float* results = ptr<float>(cb.results);
  const uint32_t* tok_flags = ptr<const uint32_t>(cb.tok_flags);
  const float* params = ptr<const float>(cb.slot_params);
  std::vector<float> scratch;

  if (op.kind == OP_CUSTOM) {
    std::vector<uint8_t> select(static_cast<size_t>(n_rows), 0);
    for (int32_t t = 0; t < n_rows; ++t) {
      int32_t slot;
      select[t] = op_selects(cb, op, t, &slot) ? 1 : 0;
    }
    std::vector<float> out;
    if (op.channel >= 0) out.assign(static_cast<size_t>(n_rows), kNaN);
    xmix_custom_args args{};
    args.h = h; args.r = r; args.stride_h = stride_h; args.stride_r = stride_r;
    args.n_rows = n_rows; args.d = d; args.dtype = dtype; args.n_params = cb.n_params;
    args.select = select.data();
    args.tok_slot = ptr<const int32_t>(cb.tok_slot);
    args.tok_pos = ptr<const int32_t>(cb.tok_pos);
    args.slot_params = params; args.param_base = op.param_base;
    args.artifact = ptr<const float>(op.a0); args.artifact_numel = op.m;
    args.out = op.channel >= 0 ? out.data() : nullptr;
    reinterpret_cast<xmix_custom_cpu_fn>(static_cast<uintptr_t>(op.fn))(&args);
    if (op.channel >= 0) {
      for (int32_t t = 0; t < n_rows; ++t) {
        const float v = select[t] ? out[t] : kNaN;
        results[static_cast<int64_t>(t) * cb.n_channels + op.channel] = v;
        if (select[t] && v == v)
          note_read(cb, op.channel, ptr<const int32_t>(cb.tok_slot)[t], tok_flags[t], v);
      }
    }
    return;
  }

  for (int32_t t = 0; t < n_rows; ++t) {
    int32_t slot;
    const bool sel = op_selects(cb, op, t, &slot);
    const Row row = row_at(h, r, t, d, stride_h, stride_r, dtype);
    const uint32_t flags = tok_flags[t];
    if (!is_read) {
      if (sel) apply_write(row, op, params + static_cast<int64_t>(slot) * cb.n_params, scratch);
      continue;
    }
    float v = kNaN;
    const float* p = slot >= 0 ? params + static_cast<int64_t>(slot) * cb.n_params : nullptr;
    switch (op.kind) {
      case OP_PROBE:
        if (sel) v = probe_value(row, op, p);
        break;
      case OP_DISTANCE:
        if (sel) v = distance_value(row, op);
        break;
      case OP_CAPTURE:
        if (sel) {
          float* dst = ptr<float>(cb.capture) + op.capture_offset + static_cast<int64_t>(t) * op.n;
          for (int32_t i = 0; i < op.n; ++i) dst[i] = row.x(op.m + i);
          v = 1.f;
        }
        break;
      case OP_COSINE: {
        // Accumulate selected prompt tokens; the value exists once at the last prompt token.
        if (slot < 0 || t >= cb.n_tokens || !app_active(cb, op.app, slot)) break;
        float* st = ptr<float>(cb.vec_state) + static_cast<int64_t>(slot) * cb.vec_state_width +
                    op.state_base;
        if (sel && (flags & TF_PROMPT)) {
          for (int32_t i = 0; i < d; ++i) st[i] += row.x(i);
          st[d] += 1.f;
        }
        if ((flags & TF_PROMPT) && (flags & TF_LAST) && st[d] > 0.f) {
          v = cosine_of_mean(st, st[d], op, d);
        }
        break;
      }
      default:
        break;
    }
    if (t < cb.max_tokens) results[static_cast<int64_t>(t) * cb.n_channels + op.channel] = v;
    if (v == v && slot >= 0) note_read(cb, op.channel, slot, flags, v);
  }
}

}  // namespace xmix
