// xmix._C: the small Python surface of the compiled half. Raw pointers and sizes in, no
// libtorch: the torch glue lives in python/xmix/runtime/ops.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>

#include "xmix/control.h"
#include "xmix/custom.h"
#include "xmix/site.h"
#include "xmix/smem.h"

#if defined(XMIX_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace py = pybind11;
using namespace xmix;

void register_graph_bindings(py::module_& m);  // csrc/graph/graph_bindings.cpp
void register_step_bindings(py::module_& m);   // csrc/step_bindings.cpp
void register_drain_bindings(py::module_& m);  // csrc/drain_bindings.cpp

namespace {

const ControlBlock& cb_at(uint64_t p) { return *ptr<const ControlBlock>(p); }

const OpDesc& op_at(const ControlBlock& cb, int32_t site, int32_t op_index) {
  if (site < 0 || site >= cb.n_sites) throw std::out_of_range("xmix: site id out of range");
  const int32_t count = ptr<const int32_t>(cb.site_count)[site];
  if (op_index < 0 || op_index >= count) throw std::out_of_range("xmix: op index out of range");
  return ptr<const OpDesc>(cb.ops)[ptr<const int32_t>(cb.site_first)[site] + op_index];
}

bool cuda_available() {
#if defined(XMIX_WITH_CUDA)
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return false;
  }
  return n > 0;
#else
  return false;
#endif
}

// Loads every xmix kernel on the current device (no module loads lazily during a capture);
// the number loaded. Throws when a GPU is there but a kernel cannot be loaded (a module built
// for another architecture); 0 without a GPU.
int load_kernels_now() {
#if defined(XMIX_WITH_CUDA)
  if (!cuda_available()) return 0;
  int n = 0;
  const int e = xmix::preload_kernels(&n);
  if (e != 0) {
    throw std::runtime_error("xmix: loading the xmix kernels failed after " + std::to_string(n) +
                             " of them: " + cudaGetErrorString(static_cast<cudaError_t>(e)));
  }
  return n;
#else
  return 0;
#endif
}

std::string cuda_status() {
#if defined(XMIX_WITH_CUDA)
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string("built with CUDA; no usable GPU: ") + cudaGetErrorString(e);
  }
  if (n == 0) return "built with CUDA; 0 GPU(s)";
  int loaded = 0;
  e = static_cast<cudaError_t>(xmix::preload_kernels(&loaded));
  if (e != cudaSuccess) {
    return "built with CUDA; " + std::to_string(n) +
           " GPU(s); loading the xmix kernels failed: " + cudaGetErrorString(e);
  }
  return "built with CUDA; " + std::to_string(n) + " GPU(s); " + std::to_string(loaded) +
         " xmix kernels loaded";
#else
  return "built without CUDA (no toolkit at build time)";
#endif
}

#if defined(XMIX_WITH_CUDA)
void check(int err, const char* what) {
  if (err != 0) {
    throw std::runtime_error(std::string("xmix: ") + what +
                             " failed: " + cudaGetErrorString(static_cast<cudaError_t>(err)));
  }
}
#endif

#define FIELD(T, f) d[#f] = offsetof(T, f)

py::dict control_layout() {
  py::dict d;
  FIELD(ControlBlock, max_tokens);
  FIELD(ControlBlock, max_slots);
  FIELD(ControlBlock, max_apps);
  FIELD(ControlBlock, n_params);
  FIELD(ControlBlock, n_channels);
  FIELD(ControlBlock, n_sites);
  FIELD(ControlBlock, vec_state_width);
  FIELD(ControlBlock, vocab_words);
  FIELD(ControlBlock, n_tokens);
  FIELD(ControlBlock, n_rows);
  FIELD(ControlBlock, tok_slot);
  FIELD(ControlBlock, tok_pos);
  FIELD(ControlBlock, tok_flags);
  FIELD(ControlBlock, tok_row);
  FIELD(ControlBlock, row_slot);
  FIELD(ControlBlock, row_tok_start);
  FIELD(ControlBlock, row_n_tok);
  FIELD(ControlBlock, row_reset);
  FIELD(ControlBlock, row_n_prompt);
  FIELD(ControlBlock, row_done);
  FIELD(ControlBlock, slot_apps);
  FIELD(ControlBlock, slot_params);
  FIELD(ControlBlock, slot_span);
  FIELD(ControlBlock, read_state);
  FIELD(ControlBlock, vec_state);
  FIELD(ControlBlock, counters);
  FIELD(ControlBlock, app_nonfinite);
  FIELD(ControlBlock, app_mode);
  FIELD(ControlBlock, site_first);
  FIELD(ControlBlock, site_count);
  FIELD(ControlBlock, ops);
  FIELD(ControlBlock, cond_code);
  FIELD(ControlBlock, tokset_bits);
  FIELD(ControlBlock, span_def);
  FIELD(ControlBlock, n_spans);
  FIELD(ControlBlock, n_token_sets);
  FIELD(ControlBlock, results);
  FIELD(ControlBlock, capture);
  FIELD(ControlBlock, capture_size);
  FIELD(ControlBlock, result_valid);
  FIELD(ControlBlock, slot_sticky);
  FIELD(ControlBlock, slot_floor);
  FIELD(ControlBlock, row_stop);
  FIELD(ControlBlock, row_switched);
  d["__size__"] = sizeof(ControlBlock);
  return d;
}

py::dict op_layout() {
  py::dict d;
  FIELD(OpDesc, kind);
  FIELD(OpDesc, app);
  FIELD(OpDesc, cond_begin);
  FIELD(OpDesc, cond_len);
  FIELD(OpDesc, param_base);
  FIELD(OpDesc, channel);
  FIELD(OpDesc, state_base);
  FIELD(OpDesc, n);
  FIELD(OpDesc, m);
  FIELD(OpDesc, flags);
  FIELD(OpDesc, a0);
  FIELD(OpDesc, a1);
  FIELD(OpDesc, a2);
  FIELD(OpDesc, fn);
  FIELD(OpDesc, capture_offset);
  FIELD(OpDesc, a3);
  d["__size__"] = sizeof(OpDesc);
  return d;
}
#undef FIELD

// sizeof of every field, for tests/test_abi.py to hold Python's declared field types to.
#define SIZE(T, f) d[#f] = sizeof(std::declval<T>().f)
py::dict control_field_sizes() {
  py::dict d;
  SIZE(ControlBlock, max_tokens);
  SIZE(ControlBlock, max_slots);
  SIZE(ControlBlock, max_apps);
  SIZE(ControlBlock, n_params);
  SIZE(ControlBlock, n_channels);
  SIZE(ControlBlock, n_sites);
  SIZE(ControlBlock, vec_state_width);
  SIZE(ControlBlock, vocab_words);
  SIZE(ControlBlock, n_tokens);
  SIZE(ControlBlock, n_rows);
  SIZE(ControlBlock, tok_slot);
  SIZE(ControlBlock, tok_pos);
  SIZE(ControlBlock, tok_flags);
  SIZE(ControlBlock, tok_row);
  SIZE(ControlBlock, row_slot);
  SIZE(ControlBlock, row_tok_start);
  SIZE(ControlBlock, row_n_tok);
  SIZE(ControlBlock, row_reset);
  SIZE(ControlBlock, row_n_prompt);
  SIZE(ControlBlock, row_done);
  SIZE(ControlBlock, slot_apps);
  SIZE(ControlBlock, slot_params);
  SIZE(ControlBlock, slot_span);
  SIZE(ControlBlock, read_state);
  SIZE(ControlBlock, vec_state);
  SIZE(ControlBlock, counters);
  SIZE(ControlBlock, app_nonfinite);
  SIZE(ControlBlock, app_mode);
  SIZE(ControlBlock, site_first);
  SIZE(ControlBlock, site_count);
  SIZE(ControlBlock, ops);
  SIZE(ControlBlock, cond_code);
  SIZE(ControlBlock, tokset_bits);
  SIZE(ControlBlock, span_def);
  SIZE(ControlBlock, n_spans);
  SIZE(ControlBlock, n_token_sets);
  SIZE(ControlBlock, results);
  SIZE(ControlBlock, capture);
  SIZE(ControlBlock, capture_size);
  SIZE(ControlBlock, result_valid);
  SIZE(ControlBlock, slot_sticky);
  SIZE(ControlBlock, slot_floor);
  SIZE(ControlBlock, row_stop);
  SIZE(ControlBlock, row_switched);
  return d;
}

py::dict op_field_sizes() {
  py::dict d;
  SIZE(OpDesc, kind);
  SIZE(OpDesc, app);
  SIZE(OpDesc, cond_begin);
  SIZE(OpDesc, cond_len);
  SIZE(OpDesc, param_base);
  SIZE(OpDesc, channel);
  SIZE(OpDesc, state_base);
  SIZE(OpDesc, n);
  SIZE(OpDesc, m);
  SIZE(OpDesc, flags);
  SIZE(OpDesc, a0);
  SIZE(OpDesc, a1);
  SIZE(OpDesc, a2);
  SIZE(OpDesc, fn);
  SIZE(OpDesc, capture_offset);
  SIZE(OpDesc, a3);
  return d;
}
#undef SIZE

py::dict constants() {
  py::dict d;
  d["DT_F32"] = int(DT_F32);
  d["DT_BF16"] = int(DT_BF16);
  d["DT_F16"] = int(DT_F16);
  d["SITES_PER_LAYER"] = kSitesPerLayer;
  d["SITE_RESIDUAL_PRE"] = int(SITE_RESIDUAL_PRE);
  d["SITE_ATTENTION_POST"] = int(SITE_ATTENTION_POST);
  d["SITE_RESIDUAL_MID"] = int(SITE_RESIDUAL_MID);
  d["SITE_ROUTER_LOGITS"] = int(SITE_ROUTER_LOGITS);
  d["SITE_MLP_POST"] = int(SITE_MLP_POST);
  d["SITE_RESIDUAL_POST"] = int(SITE_RESIDUAL_POST);
  d["OP_PROBE"] = int(OP_PROBE);
  d["OP_CAPTURE"] = int(OP_CAPTURE);
  d["OP_COSINE"] = int(OP_COSINE);
  d["OP_DISTANCE"] = int(OP_DISTANCE);
  d["OP_ADD"] = int(OP_ADD);
  d["OP_ABLATE"] = int(OP_ABLATE);
  d["OP_AFFINE"] = int(OP_AFFINE);
  d["OP_CLAMP"] = int(OP_CLAMP);
  d["OP_ROUTER"] = int(OP_ROUTER);
  d["OP_CUSTOM"] = int(OP_CUSTOM);
  d["OP_SAE_READ"] = int(OP_SAE_READ);
  d["OP_SAE_CLAMP"] = int(OP_SAE_CLAMP);
  d["OP_STOP"] = int(OP_STOP);
  d["OP_SINCE"] = int(OP_SINCE);
  d["C_SINCE"] = int(C_SINCE);
  d["MAX_STICKY"] = kMaxSticky;
  d["NO_POSITION"] = kNoPosition;
  d["STOP_POSITION_BITS"] = kStopPositionBits;
  d["TF_VALID"] = int(TF_VALID);
  d["TF_PROMPT"] = int(TF_PROMPT);
  d["TF_GENERATED"] = int(TF_GENERATED);
  d["TF_LAST"] = int(TF_LAST);
  d["TOKEN_SET_BIT0"] = kTokenSetBit0;
  d["MAX_TOKEN_SETS"] = kMaxTokenSets;
  d["SPAN_BIT0"] = kSpanBit0;
  d["MAX_SPANS"] = kMaxSpans;
  d["C_TRUE"] = int(C_TRUE);
  d["C_FLAG"] = int(C_FLAG);
  d["C_GATE"] = int(C_GATE);
  d["C_LATCH"] = int(C_LATCH);
  d["C_AND"] = int(C_AND);
  d["C_OR"] = int(C_OR);
  d["C_NOT"] = int(C_NOT);
  d["CMP_GE"] = int(CMP_GE);
  d["CMP_GT"] = int(CMP_GT);
  d["CMP_LE"] = int(CMP_LE);
  d["CMP_LT"] = int(CMP_LT);
  d["CMP_EQ"] = int(CMP_EQ);
  d["CMP_NE"] = int(CMP_NE);
  d["RED_MEAN"] = int(RED_MEAN);
  d["RED_LAST"] = int(RED_LAST);
  d["LATCH_FROM_GENERATED"] = int(kLatchFromGenerated);
  d["MAX_COND_STACK"] = kMaxCondStack;
  d["READ_STATE_WIDTH"] = kReadStateWidth;
  d["SAE_RELU"] = int(SAE_RELU);
  d["SAE_JUMPRELU"] = int(SAE_JUMPRELU);
  d["SAE_TOPK"] = int(SAE_TOPK);
  d["SAE_NORM_NONE"] = int(SAE_NORM_NONE);
  d["SAE_NORM_RESCALE"] = int(SAE_NORM_RESCALE);
  d["SAE_NORM_LAYER"] = int(SAE_NORM_LAYER);
  d["SAE_ARCH_MASK"] = int(SAE_ARCH_MASK);
  d["SAE_NORM_SHIFT"] = int(SAE_NORM_SHIFT);
  d["SAE_B_DEC_IN"] = int(SAE_B_DEC_IN);
  d["SAE_FEATURES"] = int(SAE_FEATURES);
  d["SAE_MAX_TOP_K"] = kSaeMaxTopK;
  d["SAE_MAX_FEATURES"] = kSaeMaxFeatures;
  d["SAE_LN_EPS"] = kSaeLnEps;
  d["MODE_OFF"] = int(MODE_OFF);
  d["MODE_REQUEST"] = int(MODE_REQUEST);
  d["MODE_ALL"] = int(MODE_ALL);
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "xmix compiled kernels: CPU twins always, CUDA twins when built with a toolkit";
  m.def("cuda_available", &cuda_available, "True when built with CUDA and a GPU is usable");
  m.def("built_with_cuda", []() {
#if defined(XMIX_WITH_CUDA)
    return true;
#else
    return false;
#endif
  });
  m.def("cuda_status", &cuda_status,
        "What CUDA xmix._C can use; with a GPU it also loads every xmix kernel once");
  m.def("preload_kernels", &load_kernels_now,
        "Load every xmix kernel on the current device now; returns how many (0 without a GPU)");
  m.def(
      "smem_plan",
      [](size_t static_bytes, int32_t d, size_t optin_limit) {
        const SmemPlan p = plan_smem(static_bytes, site_dynamic_smem(d), optin_limit);
        py::dict out;
        out["static"] = p.static_bytes;
        out["dynamic"] = p.dynamic_bytes;
        out["opt_in"] = p.opt_in;
        out["fits"] = p.fits;
        out["refusal"] = smem_refusal(d, p, optin_limit);
        return out;
      },
      "The site kernels' shared memory at hidden size d with static_bytes of static shared "
      "memory on a device whose opt-in limit is optin_limit (xmix/smem.h)");
  m.def(
      "site_smem_check",
      [](int32_t d) -> std::string {
#if defined(XMIX_WITH_CUDA)
        std::string why;
        check(site_smem_check(d, &why), "reading the site kernels' shared memory");
        return why;
#else
        (void)d;
        return "";
#endif
      },
      "Empty when the site kernels can launch at hidden size d on this GPU, else why not");
  m.def("control_layout", &control_layout);
  m.def("op_layout", &op_layout);
  m.def("constants", &constants);
  m.def("control_field_sizes", &control_field_sizes);
  m.def("op_field_sizes", &op_field_sizes);
  register_graph_bindings(m);
  register_step_bindings(m);
  register_drain_bindings(m);

  using G = py::call_guard<py::gil_scoped_release>;
  // None, or [(app index, message)] of the ops that failed (the rest of the site ran).
  m.def("run_site_cpu",
        [](uint64_t cb, int32_t site, uint64_t h, uint64_t r, int32_t n_rows, int32_t d, int64_t sh,
           int64_t sr, int32_t dtype) -> py::object {
          std::vector<SiteFailure> failed;
          {
            py::gil_scoped_release release;
            failed =
                run_site_cpu(cb_at(cb), site, ptr<void>(h), ptr<void>(r), n_rows, d, sh, sr, dtype);
          }
          if (failed.empty()) return py::none();
          py::list out;
          for (const auto& f : failed) out.append(py::make_tuple(f.app, py::bytes(f.what)));
          return out;
        });
  m.def("run_op_cpu", [](uint64_t cb, int32_t site, int32_t op_index, uint64_t h, uint64_t r,
                         int32_t n_rows, int32_t d, int64_t sh, int64_t sr, int32_t dtype) {
    run_op_cpu(cb_at(cb), op_at(cb_at(cb), site, op_index), ptr<void>(h), ptr<void>(r), n_rows, d,
               sh, sr, dtype);
  });
  m.def(
      "run_prologue_cpu",
      [](uint64_t cb, uint64_t ids, int32_t ids_dtype) {
        run_prologue_cpu(cb_at(cb), ptr<void>(ids), ids_dtype);
      },
      G());
  m.def("op_any_selected_cpu", [](uint64_t cb, int32_t site, int32_t op_index) {
    return op_any_selected_cpu(cb_at(cb), op_at(cb_at(cb), site, op_index));
  });
  m.def(
      "fill_step_maps",
      [](int32_t n_req, uint64_t slots, uint64_t n_tok, uint64_t start, uint64_t plen,
         int32_t padded, py::dict out) {
        StepRows in{n_req,
                    ptr<const int32_t>(slots),
                    ptr<const int64_t>(n_tok),
                    ptr<const int64_t>(start),
                    ptr<const int64_t>(plen),
                    padded};
        auto p = [&](const char* k) { return ptr<int32_t>(out[k].cast<uint64_t>()); };
        StepMaps o{p("tok_slot"),     p("tok_pos"),       p("tok_flags"), p("tok_row"),
                   p("row_slot"),     p("row_tok_start"), p("row_n_tok"), p("row_reset"),
                   p("row_n_prompt"), p("row_done")};
        return fill_step_maps(in, o);
      },
      "Per-token flags and maps of one step into the given host arrays (by pointer)");
  m.def("load_custom_cpu", [](const std::string& lib, const std::string& sym) {
    std::string err;
    uint64_t fn = load_custom_cpu(lib, sym, &err);
    if (!fn) throw std::runtime_error(err);
    return fn;
  });

#if defined(XMIX_WITH_CUDA)
  m.def("launch_site_anchor",
        [](uint64_t cb, int32_t site, uint64_t h, uint64_t r, int32_t n_rows, int32_t d, int64_t sh,
           int64_t sr, int32_t dtype, uint64_t stream) {
          check(launch_site_anchor(ptr<const ControlBlock>(cb), site, ptr<void>(h), ptr<void>(r),
                                   n_rows, d, sh, sr, dtype, ptr<void>(stream)),
                "site anchor launch");
        });
  m.def("launch_op",
        [](uint64_t cb, int32_t site, int32_t op_index, uint64_t h, uint64_t r, int32_t n_rows,
           int32_t d, int64_t sh, int64_t sr, int32_t dtype, uint64_t stream) {
          check(launch_op(ptr<const ControlBlock>(cb), site, op_index, ptr<void>(h), ptr<void>(r),
                          n_rows, d, sh, sr, dtype, ptr<void>(stream)),
                "op launch");
        });
  m.def("launch_prologue",
        [](uint64_t cb, uint64_t ids, int32_t ids_dtype, int32_t max_rows, uint64_t stream) {
          check(launch_prologue(ptr<const ControlBlock>(cb), ptr<void>(ids), ids_dtype, max_rows,
                                ptr<void>(stream)),
                "prologue launch");
        });
  m.def("launch_gate", [](uint64_t cb, int32_t site, int32_t op_index, int32_t n_rows,
                          uint64_t handle, uint64_t stream) {
    check(
        launch_gate(ptr<const ControlBlock>(cb), site, op_index, n_rows, handle, ptr<void>(stream)),
        "gate launch");
  });
  m.def("launch_custom",
        [](uint64_t cb, int32_t site, int32_t op_index, uint64_t kernel, uint64_t h, uint64_t r,
           int64_t sh, int64_t sr, int32_t n_rows, int32_t d, int32_t dtype, int32_t n_params,
           uint64_t tok_slot, uint64_t tok_pos, uint64_t slot_params, int32_t param_base,
           uint64_t artifact, int32_t artifact_numel, uint64_t select, uint64_t out,
           uint64_t stream) {
          xmix_custom_args a{};
          a.h = ptr<void>(h);
          a.r = ptr<void>(r);
          a.stride_h = sh;
          a.stride_r = sr;
          a.n_rows = n_rows;
          a.d = d;
          a.dtype = dtype;
          a.n_params = n_params;
          a.tok_slot = ptr<const int32_t>(tok_slot);
          a.tok_pos = ptr<const int32_t>(tok_pos);
          a.slot_params = ptr<const float>(slot_params);
          a.param_base = param_base;
          a.artifact = ptr<const float>(artifact);
          a.artifact_numel = artifact_numel;
          check(launch_custom(ptr<const ControlBlock>(cb), site, op_index, kernel, &a,
                              ptr<uint8_t>(select), ptr<float>(out), ptr<void>(stream)),
                "custom kernel launch");
        });
  m.def("load_custom_cuda", [](py::bytes image, const std::string& name) {
    std::string img = image;
    uint64_t k = 0;
    check(load_custom_cuda(img.data(), name.c_str(), &k), "loading custom CUDA kernel");
    return k;
  });
  m.def("anchor_kernel_symbol", []() { return addr(anchor_kernel_symbol()); });
  m.def("op_kernel_symbol", []() { return addr(op_kernel_symbol()); });
  m.def("gate_kernel_symbol", []() { return addr(gate_kernel_symbol()); });
#endif
}
