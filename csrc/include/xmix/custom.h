// The fixed ABI of user-supplied kernels (OP_CUSTOM).
//
// CPU:  extern "C" void my_kernel(const xmix_custom_args* args);   exported from a shared
//       library, loaded with dlopen at deploy.
// CUDA: extern "C" __global__ void my_kernel(xmix_custom_args args); given as CUDA source
//       (compiled with nvcc at deploy) or as a fatbin/cubin file; launched with one block per
//       token row and 256 threads.
//
// A kernel sees the whole step: it must touch only rows whose select[t] is 1 (the app is
// used by that token's request and the op's condition holds); padding rows are never
// selected. The stream at the site is h + r (r may be null); a write changes h only.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct xmix_custom_args {
  void* h;                    // [n_rows, d] activations (dtype below), row stride stride_h
  const void* r;              // [n_rows, d] residual or NULL
  int64_t stride_h;           // elements between rows
  int64_t stride_r;
  int32_t n_rows;
  int32_t d;
  int32_t dtype;              // 0 fp32, 1 bf16, 2 fp16
  int32_t n_params;           // floats per slot row in slot_params
  const uint8_t* select;      // [n_rows] 1 = apply to this token
  const int32_t* tok_slot;    // [n_rows] request slot of each row (-1 padding)
  const int32_t* tok_pos;     // [n_rows] position of each row in its request
  const float* slot_params;   // [n_slots, n_params]; this op's scalars start at param_base
  int32_t param_base;
  int32_t artifact_numel;
  const float* artifact;      // the op's fp32 artifact (NULL if none)
  float* out;                 // [n_rows] value per row for reads (NaN = no value), else NULL
} xmix_custom_args;

typedef void (*xmix_custom_cpu_fn)(const xmix_custom_args* args);

#ifdef __cplusplus
}
#endif
