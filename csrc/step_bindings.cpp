// xmix._C.HostStep: the per-step host path of an unstaged CPU engine in one call per step
// (xmix/runtime/control/step.py holds one). Before the forward: the step's request ids to slots,
// the restart check, which apps run, the step maps, the header, which sites are active, the
// monitors' extents and the prologue (begin_host_step, csrc/site/step_cpu.cpp); after it, the
// empty step. The buffers are bound once, by address; per step only the step's rows cross.
#include <Python.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "xmix/control.h"
#include "xmix/site.h"

namespace py = pybind11;
using namespace xmix;

namespace {

// n integers of a 1-D sequence (numpy array of any integer dtype read in place, or anything
// numpy converts, cast as np.ascontiguousarray(x, dtype=int64) casts) into out[0, n).
template <typename T>
void read_ints(py::handle h, int32_t n, T* out, const char* what) {
  py::array a;
  if (py::isinstance<py::array>(h)) {
    a = py::reinterpret_borrow<py::array>(h);
  } else {
    a = py::array_t<int64_t, py::array::forcecast>::ensure(h);
    if (!a) throw py::error_already_set();
  }
  if (a.ndim() != 1 || a.shape(0) < n) {
    throw py::value_error(std::string("xmix: ") + what + " must be a 1-D sequence of at least " +
                          std::to_string(n) + " integers (one per request of the step)");
  }
  const auto kind = a.dtype().kind();
  const auto size = a.itemsize();
  const char* base = static_cast<const char*>(a.data());
  const py::ssize_t stride = a.strides(0);
  if ((kind == 'i' || kind == 'u') && (size == 8 || size == 4)) {
    for (int32_t i = 0; i < n; ++i) {
      const char* p = base + i * stride;
      if (size == 8) {
        out[i] = static_cast<T>(*reinterpret_cast<const int64_t*>(p));
      } else if (kind == 'i') {
        out[i] = static_cast<T>(*reinterpret_cast<const int32_t*>(p));
      } else {
        out[i] = static_cast<T>(*reinterpret_cast<const uint32_t*>(p));
      }
    }
    return;
  }
  auto c = py::array_t<int64_t, py::array::forcecast | py::array::c_style>::ensure(a);
  if (!c) throw py::error_already_set();
  const int64_t* v = c.data();
  for (int32_t i = 0; i < n; ++i) out[i] = static_cast<T>(v[i]);
}

class HostStep {
 public:
  // addrs: every buffer's address by name (BlockMemory's host arrays, the step's own)
  HostStep(const py::dict& addrs, int64_t block_size, int32_t max_tokens, int32_t max_slots,
           int32_t n_sites)
      : n_tok_(max_slots), start_(max_slots), plen_(max_slots) {
    auto a = [&](const char* k) { return addrs[k].cast<uint64_t>(); };
    b_.block = ptr<uint8_t>(a("block"));
    b_.block_host = ptr<uint8_t>(a("block_host"));
    b_.block_size = block_size;
    b_.max_tokens = max_tokens;
    b_.max_slots = max_slots;
    b_.slot_apps = ptr<const int64_t>(a("slot_apps"));
    b_.site_app_mask = ptr<const uint64_t>(a("site_app_mask"));
    b_.site_active = ptr<uint8_t>(a("site_active"));
    b_.n_sites = n_sites;
    b_.started = ptr<uint8_t>(a("started"));
    b_.extent = ptr<int64_t>(a("extent"));
    b_.floor = ptr<int64_t>(a("floor"));
    b_.slot_floor = ptr<int32_t>(a("slot_floor"));
    auto m = [&](const char* k) { return ptr<int32_t>(a(k)); };
    b_.maps = StepMaps{m("tok_slot"),     m("tok_pos"),       m("tok_flags"), m("tok_row"),
                       m("row_slot"),     m("row_tok_start"), m("row_n_tok"), m("row_reset"),
                       m("row_n_prompt"), m("row_done")};
    row_slots_ = ptr<int32_t>(a("row_slots"));  // [S]: the step's slots, batch order
  }

  // The step of rows whose slots are given (any integer sequence).
  py::tuple begin(py::handle slots, py::handle n_tok, py::handle start, py::handle plen,
                  int32_t padded, const HostStepMasks& m, uint64_t ids, int32_t ids_dtype,
                  bool restart) {
    const py::ssize_t n = py::len(slots);
    if (n > b_.max_slots) over_capacity(-1, static_cast<int32_t>(n), padded);
    read_ints(slots, static_cast<int32_t>(n), row_slots_, "row slots");
    return run(static_cast<int32_t>(n), n_tok, start, plen, padded, m, ids, ids_dtype, restart);
  }

  // The worker's step: request ids to slots through slot_of ({req id: slot}). None, with
  // nothing done, when a request has no slot (preempted or never admitted: the caller admits
  // it and calls begin) or the step has more requests than slots. n_tok may be vLLM's
  // {req id: scheduled tokens} (a KeyError, nothing done, for a request it lacks).
  py::object begin_ids(py::handle req_ids, const py::dict& slot_of, py::handle n_tok,
                       py::handle start, py::handle plen, int32_t padded, const HostStepMasks& m,
                       uint64_t ids, int32_t ids_dtype) {
    auto seq = py::reinterpret_steal<py::object>(PySequence_Fast(req_ids.ptr(), "req_ids"));
    if (!seq) throw py::error_already_set();
    const py::ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
    if (n > b_.max_slots) return py::none();
    PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
    for (py::ssize_t i = 0; i < n; ++i) {
      PyObject* s = PyDict_GetItemWithError(slot_of.ptr(), items[i]);
      if (s == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        return py::none();
      }
      const long v = PyLong_AsLong(s);
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      if (v < 0 || v >= b_.max_slots) throw py::value_error("xmix: a slot out of range");
      row_slots_[i] = static_cast<int32_t>(v);
    }
    const bool by_id = PyDict_Check(n_tok.ptr());
    for (py::ssize_t i = 0; by_id && i < n; ++i) {
      PyObject* c = PyDict_GetItemWithError(n_tok.ptr(), items[i]);
      if (c == nullptr) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, items[i]);
        throw py::error_already_set();
      }
      const long long v = PyLong_AsLongLong(c);
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      n_tok_[i] = static_cast<int64_t>(v);
    }
    return run(static_cast<int32_t>(n), by_id ? py::handle() : n_tok, start, plen, padded, m, ids,
               ids_dtype, true);
  }

  void end(bool header) { end_host_step(b_, header); }

 private:
  py::tuple run(int32_t n, py::handle n_tok, py::handle start, py::handle plen, int32_t padded,
                const HostStepMasks& m, uint64_t ids, int32_t ids_dtype, bool restart) {
    for (int32_t i = 0; i < n; ++i) {
      if (row_slots_[i] < 0 || row_slots_[i] >= b_.max_slots) {
        throw py::value_error("xmix: a row slot out of range");
      }
    }
    if (n_tok) read_ints(n_tok, n, n_tok_.data(), "token counts");  // else already read
    read_ints(start, n, start_.data(), "start positions");
    read_ints(plen, n, plen_.data(), "prompt lengths");
    const StepRows rows{n, row_slots_, n_tok_.data(), start_.data(), plen_.data(), padded};
    const HostStepResult r = begin_host_step(b_, m, rows, restart, ptr<const void>(ids), ids_dtype);
    if (r.status != 0) over_capacity(r.n_tok, n, padded);
    return py::make_tuple(r.ran, r.n_tok, r.active, r.restarted);
  }

  [[noreturn]] void over_capacity(int64_t n_tok, int32_t n_req, int32_t padded) const {
    const int64_t rows = n_tok > padded ? n_tok : padded;
    throw std::runtime_error("xmix: step of " + std::to_string(rows) + " rows / " +
                             std::to_string(n_req) + " requests exceeds capacity (" +
                             std::to_string(b_.max_tokens) + " / " + std::to_string(b_.max_slots) +
                             ")");
  }

  HostStepBuffers b_;
  int32_t* row_slots_ = nullptr;
  std::vector<int64_t> n_tok_, start_, plen_;
};

}  // namespace

void register_step_bindings(py::module_& m) {
  py::class_<HostStepMasks>(m, "HostStepMasks")
      .def(py::init([](uint64_t all, uint64_t on, uint64_t span, uint64_t monitor, uint64_t read) {
             return HostStepMasks{all, on, span, monitor, read};
           }),
           py::arg("all"), py::arg("on"), py::arg("span"), py::arg("monitor"), py::arg("read"));
  py::class_<HostStep>(m, "HostStep")
      .def(py::init<const py::dict&, int64_t, int32_t, int32_t, int32_t>())
      .def("begin", &HostStep::begin,
           "(ran, tokens, active apps, restarts) of the step of rows with the given slots")
      .def("begin_ids", &HostStep::begin_ids,
           "(ran, tokens, active apps, restarts) of the worker's step, or None when a request "
           "has no slot")
      .def("end", &HostStep::end, "After the forward: the empty step");
}
