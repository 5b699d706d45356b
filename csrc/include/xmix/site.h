// Host entry points of the site program: the CPU twin and the CUDA launchers.
#pragma once
#include <cstdint>

#include <string>
#include <vector>

#include "xmix/control.h"
#include "xmix/custom.h"

namespace xmix {

// The scheduled requests of one step (batch order; each request's tokens are contiguous).
struct StepRows {
  int32_t n_req;
  const int32_t* slots;
  const int64_t* n_tok;
  const int64_t* start_pos;   // position of the request's first token in this step
  const int64_t* prompt_len;
  int32_t padded;             // rows of the forward (>= tokens; CUDA-graph padding)
};
// Where fill_step_maps writes (host arrays of the control block layout).
struct StepMaps {
  int32_t *tok_slot, *tok_pos, *tok_flags, *tok_row;
  int32_t *row_slot, *row_tok_start, *row_n_tok, *row_reset, *row_n_prompt, *row_done;
};
// Per-token flags and maps of one step; returns the number of real tokens.
int32_t fill_step_maps(const StepRows& in, StepMaps& out);

// An op that failed inside a site program (a user kernel that threw, an allocation): the
// other ops of the site still ran; the host fails the requests that used the app this step.
struct SiteFailure {
  int32_t app;
  std::string what;
};

// One hook site on the CPU: every op of the site, in order, on rows [0, n_rows) of h (+ r).
// Returns the ops that failed (empty: none).
std::vector<SiteFailure> run_site_cpu(const ControlBlock& cb, int32_t site, void* h, const void* r,
                                      int32_t n_rows, int32_t d, int64_t stride_h, int64_t stride_r,
                                      int32_t dtype);

// One op on the CPU (what a spliced op node does on the GPU).
void run_op_cpu(const ControlBlock& cb, const OpDesc& op, void* h, const void* r, int32_t n_rows,
                int32_t d, int64_t stride_h, int64_t stride_r, int32_t dtype);

// Per step, before the forward: per-slot resets, token-set bits and span bits from the ids.
// ids_dtype: 4 = int32, 8 = int64.
void run_prologue_cpu(const ControlBlock& cb, const void* input_ids, int32_t ids_dtype);

// Whether any token of this step is selected by op (the value an IF node's gate sets).
bool op_any_selected_cpu(const ControlBlock& cb, const OpDesc& op);

// Loads a CPU custom kernel (xmix_custom_args ABI) from a shared library; 0 and `error` on
// failure.
uint64_t load_custom_cpu(const std::string& library, const std::string& symbol, std::string* error);

#if defined(XMIX_WITH_CUDA)
// CUDA launchers. cb is a device pointer. Return cudaError_t as int (0 = success).
int launch_site_anchor(const ControlBlock* cb, int32_t site, void* h, const void* r, int32_t n_rows,
                       int32_t d, int64_t stride_h, int64_t stride_r, int32_t dtype, void* stream);
int launch_op(const ControlBlock* cb, int32_t site, int32_t op_index, void* h, const void* r,
              int32_t n_rows, int32_t d, int64_t stride_h, int64_t stride_r, int32_t dtype,
              void* stream);
int launch_prologue(const ControlBlock* cb, const void* input_ids, int32_t ids_dtype,
                    int32_t n_rows, void* stream);
// Sets an IF conditional handle to whether any token is selected by the op (graph only).
int launch_gate(const ControlBlock* cb, int32_t site, int32_t op_index, int32_t n_rows,
                uint64_t cond_handle, void* stream);
// A user CUDA kernel: select kernel, the user's kernel (one block per row), finish kernel.
int launch_custom(const ControlBlock* cb, int32_t site, int32_t op_index, uint64_t kernel,
                  const xmix_custom_args* host_args, uint8_t* select_scratch, float* out_scratch,
                  void* stream);
// Loads a fatbin/cubin image and returns the kernel handle in *kernel (cudaKernel_t).
int load_custom_cuda(const void* image, const char* name, uint64_t* kernel);
const void* anchor_kernel_symbol();
const void* op_kernel_symbol();
const void* gate_kernel_symbol();
// cudaFuncGetAttributes on every xmix kernel (loads their module); *count = kernels loaded.
int preload_kernels(int* count);
// Whether the site kernels can launch at hidden size d on this device (smem.h): *refusal is
// empty when they can, else the reason, naming d. Returns a CUDA error (0 = the query ran).
int site_smem_check(int32_t d, std::string* refusal);
// The op kernel's shared-memory opt-in for rows of d (what a launch does before it; the
// graph applier calls it before adding op nodes, whose launches the graph makes).
int prepare_op_kernel_smem(int32_t d);
#endif

}  // namespace xmix
