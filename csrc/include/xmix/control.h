// The control block: the one data structure that the host, the CPU kernels and the CUDA
// kernels share. It lives in device memory at a fixed address for the engine's life, so a
// CUDA graph captured once stays valid while apps are deployed, switched and re-parameterised:
// all of that is a write into this memory between steps.
//
// Layout rules: plain old data only, 8-byte aligned, pointers stored as uint64 so the host
// (Python packs this struct from field offsets exported by _C) and the device agree.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define XMIX_HD __host__ __device__ __forceinline__
#else
#define XMIX_HD inline
#endif

namespace xmix {

enum DType : int32_t { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

// Hook surface. A site id is layer * kSitesPerLayer + kind; final.post is n_layers *
// kSitesPerLayer. Kinds are numbered in forward order inside a decoder layer.
enum SiteKind : int32_t {
  SITE_RESIDUAL_PRE = 0,
  SITE_ATTENTION_POST = 1,
  SITE_RESIDUAL_MID = 2,
  SITE_ROUTER_LOGITS = 3,
  SITE_MLP_POST = 4,
  SITE_RESIDUAL_POST = 5,
};
constexpr int32_t kSitesPerLayer = 6;

enum OpKind : int32_t {
  OP_NONE = 0,
  // reads: write one float per token into their result channel and its validity flag
  //   (set_result: no result = flag 0, value NaN)
  OP_PROBE = 1,     // sigmoid(w . x + b)
  OP_CAPTURE = 2,   // x[dim_begin:dim_begin+n] copied to the capture buffer; channel = 1
  OP_COSINE = 3,    // CAST: cos(m, tanh(P m)), m = mean of x over the request's prompt
  OP_DISTANCE = 4,  // min_k ||x - mu_k||
  OP_SAE_READ = 5,  // SAE encoder: top-K active features (ids, acts) to the capture buffer and
                    //   the largest activation to the channel; or (SAE_FEATURES) the
                    //   activations of n listed features to n consecutive channels
  // writes: change the stream (hidden + residual) by changing hidden only
  OP_ADD = 16,  // x += s * v
  OP_ABLATE = 17,  // x -= (x . r) r          (r unit norm, normalised at deploy)
  OP_AFFINE = 18,  // x <- A (x - mu_s) + mu_t
  OP_CLAMP = 19,  // p = x . u; x += (clamp(p, lo, hi) - p) u   (u unit norm)
  OP_ROUTER = 20,  // router logits: log-softmax, forced on = max + delta, off = min - delta
  OP_SAE_CLAMP = 21,  // x += sum_f (c - a_f(x)) * s(x) * W_dec[f] over n listed features
  OP_CUSTOM = 32,  // user kernel with the CustomArgs ABI (custom.h)
  // monitors: change neither the stream nor a result channel (see monitor_token)
  OP_STOP = 40,  // the earliest token of a request where the condition holds -> row_stop
  OP_SINCE = 41,  // the first position where a since(...) term's condition holds -> slot_sticky
};

XMIX_HD bool op_is_read(int32_t kind) { return kind >= OP_PROBE && kind <= OP_SAE_READ; }

// SAE ops (OP_SAE_READ, OP_SAE_CLAMP). OpDesc: a0 = encoder rows float[F*d] (W_enc
// transposed), a1 = W_dec float[F*d], a2 = float[2F + d + 1]: b_enc | threshold | b_dec | k,
// a3 = listed feature ids as float[n] (exact below 2^24), n = top-K or listed features,
// m = F, flags = architecture | normalisation << 4 | SAE_B_DEC_IN | SAE_FEATURES.
// Semantics: xmix.lang.reference.sae_encode (SAELens's conventions).
enum SaeFlag : int32_t {
  SAE_ARCH_MASK = 0xf,  // SAE_RELU, SAE_JUMPRELU, SAE_TOPK
  SAE_NORM_SHIFT = 4,  // SAE_NORM_* << 4
  SAE_B_DEC_IN = 1 << 8,  // subtract b_dec from the (normalised) input before encoding
  SAE_FEATURES = 1 << 9,  // OP_SAE_READ: listed features instead of top-K
};
enum SaeArch : int32_t { SAE_RELU = 0, SAE_JUMPRELU = 1, SAE_TOPK = 2 };
enum SaeNorm : int32_t { SAE_NORM_NONE = 0, SAE_NORM_RESCALE = 1, SAE_NORM_LAYER = 2 };
constexpr int32_t kSaeMaxTopK = 128;  // top-K of a read
constexpr int32_t kSaeMaxFeatures = 64;  // listed features of a read or clamp
constexpr float kSaeLnEps = 1e-5f;  // SAELens's layer_norm epsilon

// Feature activation from its pre-activation; TopK membership is decided by the caller.
XMIX_HD float sae_act(float pre, int32_t arch, float threshold) {
  float a = pre > 0.f ? pre : 0.f;
  if (arch == SAE_JUMPRELU && !(pre > threshold)) a = 0.f;
  return a;
}
// The total order of top-K selection: larger value first, then the lower feature id.
XMIX_HD bool sae_before(float va, int32_t ia, float vb, int32_t ib) {
  return va > vb || (va == vb && ia < ib);
}

// Per-token flags. The host writes the low byte every step; the prologue ORs in token-set
// and span bits computed from the input ids on the device.
enum TokenFlag : uint32_t {
  TF_VALID = 1u << 0,  // a real token (padding rows have no flags at all)
  TF_PROMPT = 1u << 1,  // position < prompt length
  TF_GENERATED = 1u << 2,  // a sampled token fed back in
  TF_LAST = 1u << 3,  // this token's logits are sampled this step ("last_token")
};
constexpr int32_t kTokenSetBit0 = 8;  // bits 8..23: token sets
constexpr int32_t kMaxTokenSets = 16;
constexpr int32_t kSpanBit0 = 24;  // bits 24..31: spans
constexpr int32_t kMaxSpans = 8;

// Condition programs: postfix code over a bool stack, 4 int32 words per instruction.
enum CondOp : int32_t {
  C_TRUE = 0,
  C_FLAG = 1,  // a = flag bit index                          push (flags >> a) & 1
  C_GATE = 2,  // a = result channel, b = cmp, c = param      push results[t][a] cmp p[c]
  C_LATCH = 3,  // a = result channel, b = cmp | reduce << 8 | kLatchFromGenerated?, c = param
                //   push reduce(prompt values of a) cmp p[c] once decided, false before:
                //   decided at the last prompt token, or with kLatchFromGenerated at the
                //   first generated token (an op at or before the read's site)
  C_AND = 4,
  C_OR = 5,
  C_NOT = 6,
  C_SINCE = 7,  // a = since index: push tok_pos[t] >= slot_sticky[slot][a] (decided at an
                //   earlier site, by its OP_SINCE)
};
enum Cmp : int32_t { CMP_GE = 0, CMP_GT = 1, CMP_LE = 2, CMP_LT = 3, CMP_EQ = 4, CMP_NE = 5 };
enum Reduce : int32_t { RED_MEAN = 0, RED_LAST = 1 };
// An op at the read's site or before it runs, in the forward of the last prompt token, before
// the read has seen that token, so its latch is decided one step later: at the first
// generated token. Set in C_LATCH's b word.
constexpr int32_t kLatchFromGenerated = 1 << 16;
constexpr int32_t kMaxCondStack = 16;

// Monitors. A since(...) term's state per slot is the first position where its condition
// held (kNoPosition while it never has); a stop's per-row record packs its position (26 bits),
// the app (6 bits) and the value of the read it reports (the fp32 bits), so that the smallest
// key is the earliest trigger, ties to the lower app index.
constexpr int32_t kMaxSticky = 32;  // since(...) terms deployed at once (bits of row_switched)
constexpr int32_t kNoPosition = 0x7fffffff;
constexpr uint64_t kNoStop = ~0ull;
constexpr int32_t kStopPositionBits = 26;  // positions below 2^26 (67M tokens)

// Read-state per (slot, channel): sum and count of the read over the request's prompt
// tokens, and its value at the last prompt token (NaN until then).
constexpr int32_t kReadStateWidth = 3;  // sum, count, last

// Modes of an app (deployment level).
enum AppMode : int32_t { MODE_OFF = 0, MODE_REQUEST = 1, MODE_ALL = 2 };

// One op at one site. Artifacts are fp32 device arrays owned by the host-side app record.
struct OpDesc {
  int32_t kind;
  int32_t app;  // app index: bit in slot_apps, entry in app_mode
  int32_t cond_begin;  // first instruction in cond_code, -1 = always
  int32_t cond_len;
  int32_t param_base;  // first of this op's scalars in each slot's param row
  int32_t channel;  // result channel for reads, -1 for writes
  int32_t state_base;  // offset into vec_state per slot (cosine), -1 if none
  int32_t n;  // per kind: see the accessors below
  int32_t m;  // per kind: see the accessors below
  int32_t flags;  // OP_SAE_*: SaeFlag bits; 0 for every other kind
  uint64_t a0;  // weight / vector / direction / A / mask / centroids
  uint64_t a1;  // mu_s
  uint64_t a2;  // mu_t
  uint64_t fn;  // OP_CUSTOM: CPU function pointer (host) or kernel handle (CUDA)
  uint64_t
      capture_offset;  // OP_CAPTURE, OP_SAE_READ: float offset of this op's block in capture buffer
  uint64_t a3;  // OP_SAE_*: listed feature ids (float[n])
};
static_assert(sizeof(OpDesc) % 8 == 0, "OpDesc must stay 8-byte aligned");

// OpDesc stays flat (the host packs it from offsets); n, m and flags mean different things per
// op kind, so kernels read them through these names.
XMIX_HD int32_t capture_width(const OpDesc& op) { return op.n; }  // OP_CAPTURE: floats per token
XMIX_HD int32_t capture_first_dim(const OpDesc& op) { return op.m; }  // OP_CAPTURE: first dim taken
XMIX_HD int32_t custom_artifact_numel(const OpDesc& op) { return op.m; }  // OP_CUSTOM
XMIX_HD int32_t sae_n_features(const OpDesc& op) { return op.m; }  // OP_SAE_*: F
XMIX_HD int32_t since_index(const OpDesc& op) { return op.n; }  // OP_SINCE: its since term
XMIX_HD int32_t stop_value_channel(const OpDesc& op) { return op.n; }  // OP_STOP: -1 = none
// OP_SAE_READ: top-K, or the listed features; OP_SAE_CLAMP: the listed features.
XMIX_HD int32_t sae_count(const OpDesc& op) { return op.n; }
XMIX_HD bool sae_listed(const OpDesc& op) {
  return op.kind == OP_SAE_CLAMP || (op.flags & SAE_FEATURES) != 0;
}
XMIX_HD int32_t sae_arch(const OpDesc& op) { return op.flags & SAE_ARCH_MASK; }
XMIX_HD int32_t sae_norm(const OpDesc& op) { return (op.flags >> SAE_NORM_SHIFT) & 0xf; }
XMIX_HD bool sae_b_dec_in(const OpDesc& op) { return (op.flags & SAE_B_DEC_IN) != 0; }
// Result channels an op owns: none without a channel (writes), one per feature for an SAE read
// of listed features, else one (built-in and custom reads).
XMIX_HD int32_t read_channels(const OpDesc& op) {
  if (op.channel < 0) return 0;
  return op.kind == OP_SAE_READ && sae_listed(op) ? sae_count(op) : 1;
}

// Scalar params of each op kind, at param_base + index in the slot's param row.
enum ParamIndex : int32_t {
  P_PROBE_BIAS = 0,
  P_ADD_SCALE = 0,
  P_CLAMP_LO = 0,
  P_CLAMP_HI = 1,
  P_ROUTER_DELTA = 0,
  P_SAE_CLAMP_VALUE = 0,  // cosine, affine, capture, distance, ablate, SAE reads: none
};

struct ControlBlock {
  // capacities (fixed for the engine's life)
  int32_t max_tokens;  // T: rows of the per-token arrays
  int32_t max_slots;  // S: concurrently running requests
  int32_t max_apps;  // <= 64 (slot_apps is a bitmask)
  int32_t n_params;  // P: floats per slot param row
  int32_t n_channels;  // R: scalar result channels
  int32_t n_sites;
  int32_t vec_state_width;  // floats per slot of vector state (cosine running sums)
  int32_t vocab_words;  // uint32 words per token-set bitmap
  // per step (host written before the forward)
  int32_t n_tokens;  // real tokens this step (rows >= n_tokens are padding)
  int32_t n_rows;  // scheduled requests this step
  uint64_t tok_slot;  // int32[T]   slot of each token, -1 = padding
  uint64_t tok_pos;  // int32[T]   position in its request
  uint64_t tok_flags;  // uint32[T]  TokenFlag | set bits | span bits
  uint64_t tok_row;  // int32[T]   scheduled-request row of each token, -1 = padding
  uint64_t row_slot;  // int32[S]   per scheduled request: slot,
  uint64_t row_tok_start;  // int32[S]   first token row,
  uint64_t row_n_tok;  // int32[S]   number of tokens,
  uint64_t row_reset;  // int32[S]   1 when the request starts at position 0 this step
  uint64_t row_n_prompt;  // int32[S]   prompt tokens of this request among its tokens here
  uint64_t row_done;  // int32[S]   1 when this step processes the last prompt token
  // per slot (host written at admission and on control changes)
  uint64_t slot_apps;  // uint64[S]  bit a = request uses app a
  uint64_t slot_params;  // float[S*P]
  uint64_t slot_span;  // uint32[S]  span state bits
  uint64_t read_state;  // float[S*R*kReadStateWidth]
  uint64_t vec_state;  // float[S*vec_state_width]
  uint64_t counters;  // int32[S*R]  per step arrival counters (CUDA last-block pattern)
  uint64_t app_nonfinite;  // int32[max_apps] elements a write of the app was refused (see
                           //   store_finite); read by the host on control-plane calls only
  // apps, programs, sets
  uint64_t app_mode;  // int32[max_apps]
  uint64_t site_first;  // int32[n_sites]
  uint64_t site_count;  // int32[n_sites]
  uint64_t ops;  // OpDesc[]
  uint64_t cond_code;  // int32[4 * n]
  uint64_t tokset_bits;  // uint32[kMaxTokenSets * vocab_words]
  uint64_t span_def;  // int32[kMaxSpans * 2]: open set, close set (-1 = unused)
  int32_t n_spans;
  int32_t n_token_sets;
  // outputs
  uint64_t results;  // float[T*R]
  uint64_t capture;  // float[capture_size]
  int64_t capture_size;
  uint64_t result_valid;  // uint8[T*R]  1 where results[t][c] is a read's output this step
  // monitors
  uint64_t slot_sticky;  // int32[S*kMaxSticky]  first position a since term held, kNoPosition
  uint64_t slot_floor;  // int32[S]  positions below it were decided before a recompute
                        //   (preemption): monitors do not decide them again
  uint64_t row_stop;  // uint64[S]  per scheduled request, this step: earliest stop key, kNoStop
  uint64_t row_switched;  // uint32[S]  per scheduled request, this step: since terms that
                          //   started to hold (bit = since index)
};
static_assert(sizeof(ControlBlock) % 8 == 0, "ControlBlock must stay 8-byte aligned");

// An address carried as a uint64 (a ControlBlock field, torch's data_ptr(), a CUDA graph,
// stream or kernel handle, a dlsym'd function passed through Python) and back: every such cast
// in csrc/ goes through these three. ptr<T>: a pointer to T; from_addr<P>: a pointer type P
// (an opaque handle such as cudaGraphExec_t or cudaStream_t, a function pointer); addr: the
// pointer as its uint64.
template <typename P>
XMIX_HD P from_addr(uint64_t p) {
  static_assert(std::is_pointer<P>::value, "xmix::from_addr<P>: P must be a pointer type");
  return reinterpret_cast<P>(static_cast<uintptr_t>(p));
}

template <typename T>
XMIX_HD T* ptr(uint64_t p) {
  return from_addr<T*>(p);
}

template <typename P>
XMIX_HD uint64_t addr(P p) {
  static_assert(std::is_pointer<P>::value, "xmix::addr(p): p must be a pointer");
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
}

// ---------------------------------------------------------------- scalar conversions
// Round-to-nearest-even, the same as torch's .to(bfloat16 / float16).
XMIX_HD float bits_to_float(uint32_t u) {
  union {
    uint32_t u;
    float f;
  } c;
  c.u = u;
  return c.f;
}
XMIX_HD uint32_t float_to_bits(float f) {
  union {
    uint32_t u;
    float f;
  } c;
  c.f = f;
  return c.u;
}
XMIX_HD float bf16_to_float(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }
XMIX_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
XMIX_HD float f16_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      u = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 112u) << 23 | man << 13;
  }
  return bits_to_float(u);
}
XMIX_HD uint16_t float_to_f16(float f) {
  uint32_t u = float_to_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (a < 0x38800000u) {  // result is subnormal or zero
    if (a < 0x33000000u) return static_cast<uint16_t>(sign);  // rounds to zero
    uint32_t e = a >> 23;
    uint32_t man = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e;  // 14 + (113 - e) - 1
    uint32_t half = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1u);
    uint32_t mid = 1u << (shift - 1u);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);  // round mantissa to 10 bits, nearest even
  return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));
}

XMIX_HD float load(const void* base, int64_t i, int32_t dtype) {
  if (dtype == DT_F32) return static_cast<const float*>(base)[i];
  uint16_t b = static_cast<const uint16_t*>(base)[i];
  return dtype == DT_BF16 ? bf16_to_float(b) : f16_to_float(b);
}
XMIX_HD void store(void* base, int64_t i, int32_t dtype, float v) {
  if (dtype == DT_F32) {
    static_cast<float*>(base)[i] = v;
    return;
  }
  static_cast<uint16_t*>(base)[i] = dtype == DT_BF16 ? float_to_bf16(v) : float_to_f16(v);
}
XMIX_HD int32_t dtype_size(int32_t dtype) { return dtype == DT_F32 ? 4 : 2; }

// Writes never make the stream non-finite: an Inf/NaN in the stream reaches the KV cache, and
// vLLM hands freed KV blocks to later requests without clearing them, so one request's
// overflow would change other requests' answers. A built-in write whose new value of an
// element is not finite in the model's dtype (an fp16 overflow too) leaves the element as it
// was; returns true when it did (the caller counts it in app_nonfinite).
XMIX_HD bool is_finite_f(float v) { return fabsf(v) <= 3.402823466e38f; }  // false for NaN
// The check is made on the rounded value in registers: storing first and reading the element
// back put a load behind every store of a row, a chain of memory round trips that made an
// ablation node about 20 us at B = 1 on an H200 (2026-12-04).
XMIX_HD bool store_finite(void* base, int64_t i, int32_t dtype, float v) {
  if (dtype == DT_F32) {
    if (!is_finite_f(v)) return true;
    static_cast<float*>(base)[i] = v;
    return false;
  }
  const bool bf = dtype == DT_BF16;
  const uint16_t b = bf ? float_to_bf16(v) : float_to_f16(v);
  if (!is_finite_f(bf ? bf16_to_float(b) : f16_to_float(b))) return true;
  static_cast<uint16_t*>(base)[i] = b;
  return false;
}

// ---------------------------------------------------------------- conditions
XMIX_HD bool compare(float v, int32_t cmp, float t) {
  switch (cmp) {
    case CMP_GE: return v >= t;
    case CMP_GT: return v > t;
    case CMP_LE: return v <= t;
    case CMP_LT: return v < t;
    case CMP_EQ: return v == t;
    default: return v != t && v == v;  // NaN (read did not run) is never "not equal"
  }
}

XMIX_HD bool app_active(const ControlBlock& cb, int32_t app, int32_t slot) {
  int32_t mode = ptr<const int32_t>(cb.app_mode)[app];
  if (mode == MODE_OFF) return false;
  const bool bit = (ptr<const uint64_t>(cb.slot_apps)[slot] >> app) & 1ull;
  // Mode all: the bit opts a request out (a server's per-key policy); mode request: in.
  return mode == MODE_ALL ? !bit : bit;
}

// A latch is decided once the request's last prompt token has been read: at that token
// (in later sites of the same forward pass) and at every generated token after it.
XMIX_HD bool latch_decided(uint32_t flags) {
  return (flags & TF_GENERATED) || ((flags & TF_PROMPT) && (flags & TF_LAST));
}

XMIX_HD bool eval_cond(const ControlBlock& cb, const OpDesc& op, int32_t t, int32_t slot) {
  if (op.cond_begin < 0 || op.cond_len == 0) return true;
  const int32_t* code = ptr<const int32_t>(cb.cond_code) + 4 * op.cond_begin;
  const uint32_t flags = ptr<const uint32_t>(cb.tok_flags)[t];
  const float* params = ptr<const float>(cb.slot_params) + static_cast<int64_t>(slot) * cb.n_params;
  bool st[kMaxCondStack];
  int32_t sp = 0;
  for (int32_t i = 0; i < op.cond_len; ++i) {
    const int32_t o = code[4 * i], a = code[4 * i + 1], b = code[4 * i + 2], c = code[4 * i + 3];
    switch (o) {
      case C_TRUE: st[sp++] = true; break;
      case C_FLAG: st[sp++] = (flags >> a) & 1u; break;
      case C_GATE: {
        float v = ptr<const float>(cb.results)[static_cast<int64_t>(t) * cb.n_channels + a];
        st[sp++] = compare(v, b, params[c]);
        break;
      }
      case C_LATCH: {
        bool v = false;
        const bool decided =
            (b & kLatchFromGenerated) ? (flags & TF_GENERATED) != 0 : latch_decided(flags);
        if (decided) {
          const float* s = ptr<const float>(cb.read_state) +
                           (static_cast<int64_t>(slot) * cb.n_channels + a) * kReadStateWidth;
          const int32_t reduce = (b >> 8) & 0xff;
          if (reduce == RED_LAST)
            v = compare(s[2], b & 0xff, params[c]);
          else if (s[1] > 0.f)
            v = compare(s[0] / s[1], b & 0xff, params[c]);
        }
        st[sp++] = v;
        break;
      }
      case C_AND: {
        bool y = st[--sp];
        st[sp - 1] = st[sp - 1] && y;
        break;
      }
      case C_OR: {
        bool y = st[--sp];
        st[sp - 1] = st[sp - 1] || y;
        break;
      }
      case C_NOT: st[sp - 1] = !st[sp - 1]; break;
      case C_SINCE:
        st[sp++] = ptr<const int32_t>(cb.tok_pos)[t] >=
                   ptr<const int32_t>(cb.slot_sticky)[static_cast<int64_t>(slot) * kMaxSticky + a];
        break;
      default: return false;
    }
  }
  return sp == 1 && st[0];
}

// Whether op applies to token t: a real token, its request uses the app, the condition holds.
XMIX_HD bool op_selects(const ControlBlock& cb, const OpDesc& op, int32_t t, int32_t* slot_out) {
  const int32_t slot = ptr<const int32_t>(cb.tok_slot)[t];
  *slot_out = slot;
  if (slot < 0 || t >= cb.n_tokens) return false;
  if (!app_active(cb, op.app, slot)) return false;
  return eval_cond(cb, op, t, slot);
}

// ---------------------------------------------------------------- monitors
// Both twins run monitor_token for every token an OP_STOP / OP_SINCE selects; the CPU twin in
// token order, the CUDA twin with one block per token, so every update is an atomic min (an
// or for the switched bits) and the result does not depend on the order.
XMIX_HD int32_t min_i32(int32_t* p, int32_t v) {
#if defined(__CUDA_ARCH__)
  return atomicMin(p, v);
#else
  const int32_t old = *p;
  if (v < old) *p = v;
  return old;
#endif
}
XMIX_HD void min_u64(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
  atomicMin(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
#else
  if (v < *p) *p = v;
#endif
}
XMIX_HD void or_u32(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
  atomicOr(reinterpret_cast<unsigned int*>(p), static_cast<unsigned int>(v));
#else
  *p |= v;
#endif
}

XMIX_HD uint64_t stop_key(int32_t pos, int32_t app, float value) {
  return static_cast<uint64_t>(pos) << (64 - kStopPositionBits) |
         static_cast<uint64_t>(app & 63) << 32 | float_to_bits(value);
}

// Token t (of request slot) is selected by a monitor op: a since term starts to hold at the
// earliest such position, a stop is recorded for the token's row. Positions below the slot's
// floor were decided before the request was preempted and are not decided again.
XMIX_HD void monitor_token(const ControlBlock& cb, const OpDesc& op, int32_t t, int32_t slot) {
  const int32_t pos = ptr<const int32_t>(cb.tok_pos)[t];
  if (pos < ptr<const int32_t>(cb.slot_floor)[slot]) return;
  const int32_t row = ptr<const int32_t>(cb.tok_row)[t];
  if (op.kind == OP_SINCE) {
    int32_t* start =
        ptr<int32_t>(cb.slot_sticky) + static_cast<int64_t>(slot) * kMaxSticky + since_index(op);
    if (min_i32(start, pos) == kNoPosition)
      or_u32(ptr<uint32_t>(cb.row_switched) + row, 1u << since_index(op));
    return;
  }
  const int32_t ch = stop_value_channel(op);
  const float v = ch >= 0
                      ? ptr<const float>(cb.results)[static_cast<int64_t>(t) * cb.n_channels + ch]
                      : bits_to_float(0x7fc00000u);
  min_u64(ptr<uint64_t>(cb.row_stop) + row, stop_key(pos, op.app, v));
}

XMIX_HD const float* slot_params_row(const ControlBlock& cb, int32_t slot) {
  return ptr<const float>(cb.slot_params) + static_cast<int64_t>(slot) * cb.n_params;
}

// expf (not __expf) on both sides: one semantics for the two twins.
XMIX_HD float sigmoid(float z) { return 1.f / (1.f + expf(-z)); }

// A read's output for token t in channel c. Whether there is one is the flag, never the value:
// a read of a stream driven to NaN reports NaN. Without one the channel holds NaN, which no
// gate comparison passes.
XMIX_HD void set_result(const ControlBlock& cb, int32_t t, int32_t c, float v, bool has) {
  const int64_t i = static_cast<int64_t>(t) * cb.n_channels + c;
  ptr<float>(cb.results)[i] = has ? v : bits_to_float(0x7fc00000u);
  ptr<uint8_t>(cb.result_valid)[i] = has ? 1 : 0;
}

// ---------------------------------------------------------------- per-step prologue
// The same code runs on the host (run_prologue_cpu) and on the device (the prologue kernels).

// A request that starts at position 0 this step starts with empty latch sums, spans and CAST
// means (since terms and the floor are the host's: a recompute keeps what was decided);
// every row starts the step without a stop or a switch. Lanes split the work (a CUDA block's
// threads; one lane on the CPU).
XMIX_HD void prologue_reset_row(const ControlBlock& cb, int32_t row, int32_t lane, int32_t lanes) {
  if (row >= cb.n_rows) return;
  if (lane == 0) {  // monitors report per step
    ptr<uint64_t>(cb.row_stop)[row] = kNoStop;
    ptr<uint32_t>(cb.row_switched)[row] = 0;
  }
  if (!ptr<const int32_t>(cb.row_reset)[row]) return;
  const int32_t slot = ptr<const int32_t>(cb.row_slot)[row];
  if (lane == 0) ptr<uint32_t>(cb.slot_span)[slot] = 0;
  float* rs =
      ptr<float>(cb.read_state) + static_cast<int64_t>(slot) * cb.n_channels * kReadStateWidth;
  for (int32_t c = lane; c < cb.n_channels; c += lanes) {
    rs[c * kReadStateWidth + 0] = 0.f;
    rs[c * kReadStateWidth + 1] = 0.f;
    rs[c * kReadStateWidth + 2] = bits_to_float(0x7fc00000u);  // NaN: no last value yet
  }
  float* vs = ptr<float>(cb.vec_state) + static_cast<int64_t>(slot) * cb.vec_state_width;
  for (int32_t i = lane; i < cb.vec_state_width; i += lanes) vs[i] = 0.f;
}

// Token-set and span bits of one scheduled request's tokens, in order (span state is
// sequential within a request). ids: int64 (ids_size 8) or int32.
XMIX_HD void prologue_row_tokens(const ControlBlock& cb, int32_t row, const void* ids,
                                 int32_t ids_size) {
  if (row >= cb.n_rows) return;
  const int32_t slot = ptr<const int32_t>(cb.row_slot)[row];
  const int32_t start = ptr<const int32_t>(cb.row_tok_start)[row];
  const int32_t n = ptr<const int32_t>(cb.row_n_tok)[row];
  uint32_t* flags = ptr<uint32_t>(cb.tok_flags);
  const uint32_t* sets = ptr<const uint32_t>(cb.tokset_bits);
  const int32_t* span_def = ptr<const int32_t>(cb.span_def);
  const int64_t vocab = static_cast<int64_t>(cb.vocab_words) * 32;
  uint32_t state = ptr<uint32_t>(cb.slot_span)[slot];
  for (int32_t t = start; t < start + n; ++t) {
    const int64_t id =
        ids_size == 8 ? static_cast<const int64_t*>(ids)[t] : static_cast<const int32_t*>(ids)[t];
    uint32_t f = flags[t];
    if (id >= 0 && id < vocab) {
      for (int32_t s = 0; s < cb.n_token_sets; ++s)
        if ((sets[static_cast<int64_t>(s) * cb.vocab_words + (id >> 5)] >> (id & 31)) & 1u)
          f |= 1u << (kTokenSetBit0 + s);
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
  ptr<uint32_t>(cb.slot_span)[slot] = state;
}

}  // namespace xmix
