// A Python callable wrapped as an engine Action.
//
// Actions run on the engine's executor thread, which holds no GIL; the wrapper takes it for the
// call and for the callable's destruction. During interpreter finalization a thread must not take
// the GIL, so the call is skipped and the callable is leaked instead.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

namespace fastdist {

namespace py = pybind11;

inline bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

class PyAction {
 public:
  explicit PyAction(py::object fn) : fn_(new py::object(std::move(fn)), &release) {}

  // Plain C API with no RAII on purpose: if the interpreter starts finalizing while the action
  // runs, Python ends this thread from inside the call by unwinding it (pthread_exit). Nothing
  // on the way out may touch Python then, as pybind11's guards and handles would.
  void operator()() const {
    if (python_finalizing()) return;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject* result = PyObject_CallObject(fn_->ptr(), nullptr);
    if (result == nullptr) {
      // An action has no caller to raise to: report it like an exception in a __del__.
      PyErr_WriteUnraisable(fn_->ptr());
    } else {
      Py_DECREF(result);
    }
    PyGILState_Release(gil);
  }

 private:
  static void release(py::object* fn) {
    if (python_finalizing()) return;  // leak rather than touch a dying interpreter
    py::gil_scoped_acquire gil;
    delete fn;
  }

  std::shared_ptr<py::object> fn_;
};

}  // namespace fastdist
