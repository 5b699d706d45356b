// xmix._C.read_hits: the host half of draining one read of an unstaged CPU engine's step
// (xmix/runtime/control/drain.py: collect). Which tokens hold a result in the read's channel,
// their positions and rows, and where each request's run of tokens starts, in one pass over the
// step's maps instead of a dozen numpy calls: the drain runs after every forward of a step with
// a read, and on this path each numpy call costs more in cold caches than the work it does.
// numpy_hits in drain.py is the twin it is tested against.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace {

template <typename T>
const T* at(uint64_t addr) {
  return reinterpret_cast<const T*>(static_cast<uintptr_t>(addr));
}

// (idx int64[n], values float32[n], positions int32[n], positions as a list, the row of each
// request's first hit as a list, bounds: a list of n_requests + 1 offsets into idx, or None
// when every request has one hit (request j is [j, j + 1))).
py::tuple read_hits(uint64_t results, uint64_t valid, uint64_t tok_pos, uint64_t tok_row,
                    int32_t n_tok, int32_t n_channels, int32_t ch) {
  if (n_tok < 0 || n_channels <= 0 || ch < 0 || ch >= n_channels) {
    throw std::out_of_range("xmix: read_hits: channel " + std::to_string(ch) + " of " +
                            std::to_string(n_channels) + ", " + std::to_string(n_tok) + " tokens");
  }
  const auto* res = at<float>(results);
  const auto* ok = at<uint8_t>(valid);
  const auto* pos = at<int32_t>(tok_pos);
  const auto* row = at<int32_t>(tok_row);
  int32_t n = 0;
  for (int32_t t = 0; t < n_tok; ++t) n += ok[static_cast<int64_t>(t) * n_channels + ch] != 0;
  py::array_t<int64_t> idx(n);
  py::array_t<float> vals(n);
  py::array_t<int32_t> p(n);
  py::list pl(n);
  py::list firsts;
  py::list bounds;
  auto* pi = idx.mutable_data();
  auto* pv = vals.mutable_data();
  auto* pp = p.mutable_data();
  int32_t k = 0;
  int32_t last = -1;
  bool single = true;
  for (int32_t t = 0; t < n_tok; ++t) {
    const int64_t c = static_cast<int64_t>(t) * n_channels + ch;
    if (!ok[c]) continue;
    pi[k] = t;
    pv[k] = res[c];
    pp[k] = pos[t];
    PyList_SET_ITEM(pl.ptr(), k, PyLong_FromLong(pos[t]));
    if (k == 0 || row[t] != last) {
      last = row[t];
      firsts.append(last);
      bounds.append(k);
    } else {
      single = false;
    }
    ++k;
  }
  bounds.append(n);
  return py::make_tuple(idx, vals, p, pl, firsts, single ? py::object(py::none()) : bounds);
}

}  // namespace

void register_drain_bindings(py::module_& m) {
  m.def("read_hits", &read_hits, py::arg("results"), py::arg("valid"), py::arg("tok_pos"),
        py::arg("tok_row"), py::arg("n_tok"), py::arg("n_channels"), py::arg("channel"),
        "A read's hits in an unstaged CPU step, from the buffers' addresses: (token indices, "
        "channel values, positions, positions as a list, each request's first row, bounds or "
        "None when each request has one hit)");
}
