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

// The host's per-step path of an unstaged CPU engine, in one call (HostStep below): the
// restart check, which apps run, the step maps, the header, which sites are active, the
// monitors' extents and the prologue. Its buffers are fixed for the engine's life (numpy and
// torch own them; Python binds their addresses once).
struct HostStepBuffers {
  uint8_t* block = nullptr;             // the ControlBlock the site kernels read
  uint8_t* block_host = nullptr;        // its host image (Python writes the header there)
  int64_t block_size = 0;               // bytes of both
  int32_t max_tokens = 0, max_slots = 0;
  const int64_t* slot_apps = nullptr;   // [S] app bits per slot
  const uint64_t* site_app_mask = nullptr;  // [n_sites] apps with an op at each site
  uint8_t* site_active = nullptr;       // [n_sites] out: an app of this step has an op there
  int32_t n_sites = 0;
  uint8_t* started = nullptr;           // [S] the slot's request ran a step since admission
  int64_t* extent = nullptr;            // [S] one past the last position a step ran on
  int64_t* floor = nullptr;             // [S] what slot_floor holds (host copy)
  int32_t* slot_floor = nullptr;        // [S] the block's slot_floor
  StepMaps maps{};
};
// The step's apps by kind (BlockMemory's masks; they change only between steps).
struct HostStepMasks {
  uint64_t all = 0, on = 0, span = 0, monitor = 0, read = 0;
};
struct HostStepResult {
  int32_t status = 0;      // 0: done; 1: over capacity (nothing written after the restarts)
  bool ran = false;        // false: no app runs this step (site_active cleared, no maps)
  uint64_t active = 0;     // bitmask of the apps that run
  int64_t n_tok = 0;       // real tokens of the step
  int32_t restarted = 0;   // requests that started again at position 0 in the slot they hold
};
// rows.slots must hold distinct slots. restart: do the restart check (the worker's path);
// input_ids: run the prologue when the step runs apps (nullptr: the caller runs it).
HostStepResult begin_host_step(const HostStepBuffers& b, const HostStepMasks& m,
                               const StepRows& rows, bool restart, const void* input_ids,
                               int32_t ids_dtype);
// After the forward: the empty step (header n_tokens = n_rows = 0 when `header`), no site active.
void end_host_step(const HostStepBuffers& b, bool header);

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
