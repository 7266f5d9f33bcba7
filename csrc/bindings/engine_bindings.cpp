// Python bindings for the engine. Arguments are converted first; every call that can block
// releases the GIL, in an inner scope, and waits in short slices so that Ctrl-C still works.
#include <pybind11/pybind11.h>

#include <cmath>
#include <stdexcept>

#include "../engine/engine.h"
#include "py_action.h"

namespace fastdist {

namespace {

constexpr Nanos kSignalCheckInterval = 100'000'000;  // 100 ms

Nanos deadline_from_python(double seconds, const char* name) {
  if (std::isnan(seconds)) throw py::value_error(std::string(name) + " must not be NaN");
  return seconds_to_nanos(seconds);
}

Nanos wait_from_python(const py::object& timeout) {
  if (timeout.is_none()) return kNever;
  double seconds = timeout.cast<double>();
  if (std::isnan(seconds) || seconds < 0) throw py::value_error("timeout must be a non-negative number of seconds");
  return seconds_to_nanos(seconds);
}

// Waits in slices, re-taking the GIL between them only to let Python run signal handlers.
State wait_token(Token& token, Nanos max_wait) {
  const Nanos start = steady_now();
  for (;;) {
    Nanos slice = kSignalCheckInterval;
    if (max_wait != kNever) {
      const Nanos left = max_wait - (steady_now() - start);
      if (left <= 0) return token.state();
      if (left < slice) slice = left;
    }
    State s;
    {
      py::gil_scoped_release nogil;
      s = token.wait(slice);
    }
    if (s != State::kPending) return s;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

Action action_from_python(const py::object& fn) {
  if (fn.is_none()) return Action();
  if (!PyCallable_Check(fn.ptr())) throw py::type_error("on_expire must be callable or None");
  return PyAction(fn);
}

py::dict stats_to_dict(const EngineStats& s) {
  py::dict d;
  d["registered"] = s.registered;
  d["expired"] = s.expired;
  d["timer_wakeups"] = s.timer_wakeups;
  d["actions_run"] = s.actions_run;
  d["pending"] = s.pending;
  return d;
}

}  // namespace

struct Notifier {
  std::shared_ptr<Token> token;
};

void register_engine(py::module_& m) {
  m.attr("PENDING") = static_cast<int>(State::kPending);
  m.attr("COMPLETED") = static_cast<int>(State::kCompleted);
  m.attr("EXPIRED") = static_cast<int>(State::kExpired);
  m.attr("CANCELLED") = static_cast<int>(State::kCancelled);

  m.def("monotonic", [] { return nanos_to_seconds(steady_now()); },
        "Seconds on the steady clock that the default engine uses.");

  py::class_<Notifier>(m, "Notifier")
      .def("__call__", [](const Notifier& n, const py::handle&) {
        // Wake the waiter with the GIL released: otherwise it wakes only to block on the GIL
        // this backend thread still holds, a second context switch on the fast path.
        py::gil_scoped_release nogil;
        n.token->work_done();
      });

  py::class_<Token, std::shared_ptr<Token>>(m, "Token")
      .def_property_readonly("state", [](const Token& t) { return static_cast<int>(t.state()); })
      .def_property_readonly("deadline", [](const Token& t) { return nanos_to_seconds(t.deadline); })
      .def("remaining",
           [](const Token& t) {
             if (t.deadline == kNever) return nanos_to_seconds(kNever);
             const Nanos left = t.deadline - t.engine().now();
             return left > 0 ? nanos_to_seconds(left) : 0.0;
           })
      .def("complete", &Token::complete)
      .def("cancel", &Token::cancel)
      // The done-callback to give torch's Future.add_done_callback for this token: a separate
      // object that only torch holds, so that a weak reference to it tells when torch has let
      // go of the callback (see fastdist.ops.work, its exit hook).
      .def("notifier", [](const std::shared_ptr<Token>& t) { return Notifier{t}; })
      .def_property_readonly("work_done", &Token::is_work_done)
      .def("wait", [](Token& t, const py::object& timeout) { return static_cast<int>(wait_token(t, wait_from_python(timeout))); },
           py::arg("timeout") = py::none())
      .def("__repr__", [](const Token& t) {
        static const char* names[] = {"pending", "completed", "expired", "cancelled"};
        return std::string("<fastdist._core.Token ") + names[static_cast<int>(t.state())] + " deadline=" +
               std::to_string(nanos_to_seconds(t.deadline)) + ">";
      });

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
      .def(py::init([](bool fake_clock) { return Engine::create(fake_clock); }), py::arg("fake_clock") = false)
      .def_property_readonly("fake_clock", &Engine::fake_clock)
      .def("now", [](const Engine& e) { return nanos_to_seconds(e.now()); })
      .def("add",
           [](Engine& e, double deadline, const py::object& on_expire) {
             return e.add(deadline_from_python(deadline, "deadline"), action_from_python(on_expire));
           },
           py::arg("deadline"), py::arg("on_expire") = py::none())
      .def("advance",
           [](Engine& e, double seconds) {
             if (std::isnan(seconds) || seconds < 0) throw py::value_error("seconds must be a non-negative number");
             const Nanos delta = seconds_to_nanos(seconds);
             py::gil_scoped_release nogil;
             e.advance(delta);
           },
           py::arg("seconds"))
      .def("flush",
           [](Engine& e, const py::object& timeout) {
             const Nanos max_wait = wait_from_python(timeout);
             py::gil_scoped_release nogil;
             return e.flush(max_wait);
           },
           py::arg("timeout") = py::none())
      .def("shutdown",
           [](Engine& e, double timeout) {
             const Nanos max_wait = seconds_to_nanos(timeout);
             py::gil_scoped_release nogil;
             e.shutdown(max_wait);
           },
           py::arg("timeout") = 0.1)
      .def("stats", [](const Engine& e) { return stats_to_dict(e.stats()); });

  // The default engine for fastdist._watched (a separate module): one engine, one timer thread.
  m.def("_engine_capsule", [] {
    static auto* engine = new std::shared_ptr<Engine>(default_engine());
    return py::capsule(static_cast<void*>(engine), "fastdist.engine");
  });

  m.def("default_engine", &default_engine,
        "The process-wide engine on the steady clock; its threads start with the first deadline.");
}

}  // namespace fastdist
