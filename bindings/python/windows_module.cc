// shoal._core's window functions (win_enqueue, win_poll/win_wait, win_release,
// win_versions, win_associated_p, win_names) over the C ABI's shoal_win_* (shoal/_win.py
// holds their semantics).
#include <optional>
#include <string>
#include <vector>

#include "module.h"

namespace shoal_py {
namespace {

int64_t WinEnqueue(int op, const std::string& name, py::handle data, int dtype,
                   const std::vector<int64_t>& shape, const std::vector<int32_t>& ranks,
                   const std::vector<double>& weights, const std::vector<int32_t>& send_ranks,
                   double self_weight, bool uniform, bool zero_init, bool require_mutex, bool reset,
                   bool with_p, bool for_self, bool clone, const std::optional<std::string>& refused,
                   bool refused_type) {
  shoal_win_desc d{};
  d.op = op;
  d.name = name.c_str();
  d.tensor = MakeTensor(data, dtype, shape, false);  // writability is checked in shoal/_win.py
  d.n = static_cast<int32_t>(ranks.size());
  d.ranks = ranks.data();
  d.weights = weights.empty() ? nullptr : weights.data();
  d.n_send = static_cast<int32_t>(send_ranks.size());
  d.send_ranks = send_ranks.data();
  d.self_weight = self_weight;
  d.uniform = uniform;
  d.zero_init = zero_init;
  d.require_mutex = require_mutex;
  d.reset = reset;
  d.with_p = with_p;
  d.for_self = for_self;
  d.clone = clone;
  d.refused = refused ? refused->c_str() : nullptr;
  d.refused_code = refused_type ? SHOAL_INVALID_TYPE : SHOAL_INVALID_ARGUMENT;
  int64_t handle = 0;
  char err[kErrLen];
  Check(shoal_win_enqueue(&d, &handle, err, kErrLen), err);
  return handle;
}

}  // namespace

void DefineWindows(py::module_& m) {
  m.def("win_enqueue", &WinEnqueue, py::arg("op"), py::arg("name"), py::arg("data") = py::int_(0),
        py::arg("dtype") = int(SHOAL_FLOAT32), py::arg("shape") = std::vector<int64_t>{},
        py::arg("ranks") = std::vector<int32_t>{}, py::arg("weights") = std::vector<double>{},
        py::arg("send_ranks") = std::vector<int32_t>{}, py::arg("self_weight") = 1.0,
        py::arg("uniform") = false, py::arg("zero_init") = false, py::arg("require_mutex") = false,
        py::arg("reset") = false, py::arg("with_p") = false, py::arg("for_self") = false, py::arg("clone") = false,
        py::arg("refused") = py::none(), py::arg("refused_type") = false);
  DefinePollWait(m, "win_poll", "win_wait", "window handle", &shoal_win_poll, &shoal_win_wait_for);
  m.def("win_release", [](int64_t h) { shoal_win_release(h); });
  m.def("win_versions", [](const std::string& name) {
    char err[kErrLen];
    std::vector<int32_t> ranks(shoal_size() > 0 ? shoal_size() : 1);
    std::vector<int64_t> v(ranks.size());
    int32_t n = 0;
    int rc;
    {
      py::gil_scoped_release nogil;
      rc = shoal_win_versions(name.c_str(), ranks.data(), v.data(), static_cast<int32_t>(ranks.size()), &n, err, kErrLen);
    }
    Check(rc, err);
    py::dict d;
    for (int32_t i = 0; i < n; ++i) d[py::int_(ranks[i])] = v[i];
    return d;
  });
  m.def("win_associated_p", [](const std::string& name) {
    char err[kErrLen];
    double p = 0;
    int rc;
    {
      py::gil_scoped_release nogil;
      rc = shoal_win_associated_p(name.c_str(), &p, err, kErrLen);
    }
    Check(rc, err);
    return p;
  });
  m.def("win_names", [] {
    std::vector<char> buf(4096);
    int rc;
    for (;;) {
      {
        py::gil_scoped_release nogil;
        rc = shoal_win_names(buf.data(), buf.size());
      }
      if (rc < 0) Raise(-rc, buf.data());
      if (static_cast<size_t>(rc) <= buf.size()) break;
      buf.resize(rc);
    }
    std::vector<std::string> names;
    std::string s(buf.data()), cur;
    for (char c : s) {
      if (c == '\n') { names.push_back(cur); cur.clear(); } else cur += c;
    }
    return names;
  });
}

}  // namespace shoal_py
