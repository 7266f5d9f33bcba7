// The Python module of the tests' doubles (built by tests/support/fake_nccl.py with torch's
// cpp_extension, against the torch installed; never part of the fastdist wheel).
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <limits>

#include "nccl_double.h"

namespace py = pybind11;
using fastdist::testing::NcclDouble;

namespace {

// fastdist's interface for an NCCL-like backend that is not ProcessGroupNCCL (StreamMarkerFn,
// csrc/watched/watched.h): the work that stands for an event on the caller's current stream.
c10d::Work* stream_marker(c10d::Backend& backend) {
  auto* d = dynamic_cast<NcclDouble*>(&backend);
  TORCH_CHECK(d, "the stream marker of the NCCL double was asked of another backend");
  return d->current_stream_marker().release();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<NcclDouble, c10d::Backend, c10::intrusive_ptr<NcclDouble>> cls(m, "NcclDouble", py::dynamic_attr());
  cls.attr("NAME") = NcclDouble::kName;
  cls.attr("_fastdist_stream_marker") = py::capsule(reinterpret_cast<void*>(&stream_marker), "fastdist.stream_marker");
  cls.def(py::init([](const c10::intrusive_ptr<c10d::Backend>& transport, double timeout, double group_timeout) {
            if (std::isnan(timeout) || timeout <= 0) throw py::value_error("timeout must be > 0 (inf: none)");
            if (std::isnan(group_timeout) || group_timeout <= 0) throw py::value_error("group_timeout must be > 0");
            return c10::make_intrusive<NcclDouble>(transport, timeout, group_timeout);
          }),
          py::arg("transport"), py::arg("timeout") = std::numeric_limits<double>::infinity(),
          py::arg("group_timeout") = std::numeric_limits<double>::infinity())
      .def_static(
          "configure",
          [](double delay, bool abort_hangs, double dump_sleep) {
            if (std::isnan(delay) || delay < 0) throw py::value_error("delay must be >= 0 (inf: never)");
            if (!std::isfinite(dump_sleep) || dump_sleep < 0) throw py::value_error("dump_sleep must be >= 0");
            NcclDouble::delay().store(delay);
            NcclDouble::abort_hangs().store(abort_hangs);
            NcclDouble::dump_sleep().store(dump_sleep);
          },
          py::arg("delay") = 0.0, py::arg("abort_hangs") = false, py::arg("dump_sleep") = 60.0)
      .def_static("aborts", [] { return NcclDouble::aborts().load(); })
      .def("get_error", [](NcclDouble& d) { return static_cast<int>(d.getError()); })
      .def("comm_error", &NcclDouble::comm_error)
      .def_property_readonly("timeout", &NcclDouble::timeout);
  // Whether a work holds an error: Work.exception() has no Python conversion in torch 2.11.
  m.def("has_error", [](const c10::intrusive_ptr<c10d::Work>& w) { return static_cast<bool>(w->exception()); });
}
