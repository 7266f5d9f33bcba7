// fastdist._core: one register_* call per area, nothing else.
#include <pybind11/pybind11.h>

namespace fastdist {
void register_engine(pybind11::module_& m);
}

PYBIND11_MODULE(_core, m) {
  m.doc() = "fastdist's native deadline engine (no libtorch: pure C++ and pybind11).";
  fastdist::register_engine(m);
}
