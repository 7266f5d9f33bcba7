// Errors: fastdist's own made in C++, and Python's carried through C++.
#include "internal.h"

#include <Python.h>
#include <torch/csrc/Exceptions.h>

#include <stdexcept>

namespace fastdist::watched {

std::exception_ptr plain_error(const std::string& what) {
  return std::make_exception_ptr(std::runtime_error("fastdist: " + what));
}

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& err) {
    return err.what_without_backtrace();
  } catch (const std::exception& err) {
    return err.what();
  } catch (...) {
    return "unknown error";
  }
}

namespace {

// A Python exception carried through C++ (torch restores a python_error as the original
// exception when it reaches Python: through autograd, a work's wait, a future's value). Unlike a
// plain python_error it never takes the GIL in its destructor once the interpreter is
// finalizing (a backend thread dropping the last reference then would be killed by Python, and
// the process abort): the references are leaked instead.
struct FaultError : python_error {
  explicit FaultError(python_error&& e) : python_error(std::move(e)) {}
  FaultError(const FaultError& other) = default;
  ~FaultError() override {
    if (python_finalizing()) {
      type = nullptr;
      value = nullptr;
      traceback = nullptr;
    }
  }
};


}  // namespace

bool python_finalizing() {
  if (Py_IsInitialized() == 0) return true;
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

std::exception_ptr fetch_python_error() {
  python_error e;
  e.persist();
  return std::make_exception_ptr(FaultError(std::move(e)));
}

}  // namespace fastdist::watched
