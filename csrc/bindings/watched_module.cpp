// fastdist._watched: the torch-linked module (watched groups). Built against the torch it is
// installed with, using torch's own pybind11, so that its classes share torch's Backend type.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "../watched/internal.h"
#include "../watched/solo.h"
#include "../watched/watched.h"

namespace py = pybind11;

namespace fastdist::watched {
namespace {

py::object& py_builder() {
  static auto* b = new py::object();  // leaked: never destroyed after the interpreter
  return *b;
}

std::shared_ptr<Engine>& shared_engine() {
  static auto* e = new std::shared_ptr<Engine>();
  return *e;
}

// An NCCL-like backend's stream marker (StreamMarkerFn, watched.h): a capsule of that name, or None.
StreamMarkerFn marker_arg(const py::object& capsule) {
  if (capsule.is_none()) return nullptr;
  if (!py::isinstance<py::capsule>(capsule)) throw py::type_error("stream_marker must be a capsule or None");
  auto cap = py::reinterpret_borrow<py::capsule>(capsule);
  if (std::string(cap.name() ? cap.name() : "") != kStreamMarkerCapsule) {
    throw py::type_error(std::string("stream_marker must be a capsule named ") + kStreamMarkerCapsule);
  }
  return reinterpret_cast<StreamMarkerFn>(cap.get_pointer());
}

Nanos seconds_arg(double seconds, const char* name) {
  if (std::isnan(seconds)) throw py::value_error(std::string(name) + " must not be NaN");
  return seconds_to_nanos(seconds);
}

// Calls fastdist._watch's builder with the fault; the exception it returns (or raises) is what
// every waiter of the group raises.
std::exception_ptr build_fault(std::uintptr_t ctl, const FaultInfo& info) {
  if (python_finalizing() || py_builder().ptr() == nullptr) return nullptr;
  py::gil_scoped_acquire gil;
  // (first: whether C++ reported this timeout because the GIL did not come in time)
  const bool native = info.probe && info.probe->enter();
  try {
    py::dict d;
    d["native"] = native;
    d["thread"] = info.thread;
    d["kind"] = info.kind;
    d["op"] = info.op;
    d["seq"] = info.seq;
    d["start"] = info.start;
    d["deadline"] = info.deadline;
    d["detail"] = info.detail;
    d["prev"] = info.prev;
    d["waiter"] = info.waiter;
    py::object err = py_builder()(ctl, d);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err.ptr())), err.ptr());
    return fetch_python_error();
  } catch (py::error_already_set& e) {
    // The builder raised (a timeout handler's sys.exit() among others): that is the error.
    e.restore();
    return fetch_python_error();
  }
}

py::object& py_check() {
  static auto* c = new py::object();  // leaked: never destroyed after the interpreter
  return *c;
}

// Calls fastdist's check (fastdist.ops.watching) for an op torch issues; a mismatch raises there.
bool run_check(std::uintptr_t ctl, const char* op, const std::string& signature, double deadline) {
  if (python_finalizing() || py_check().ptr() == nullptr) return true;
  py::gil_scoped_acquire gil;
  try {
    return py_check()(ctl, op, signature, deadline).cast<bool>();
  } catch (py::error_already_set& e) {
    e.restore();
    std::rethrow_exception(fetch_python_error());
  }
}

// push_scope / pop_scope, on every fail_after's way in and out (every training step's): plain
// CPython functions, without pybind11's argument machinery (about 70 ns a call less).
PyObject* py_push_scope(PyObject*, PyObject* arg) {
  const double deadline = PyFloat_AsDouble(arg);
  if (deadline == -1.0 && PyErr_Occurred()) return nullptr;
  if (std::isnan(deadline)) {
    PyErr_SetString(PyExc_ValueError, "deadline must not be NaN");
    return nullptr;
  }
  push_scope(seconds_to_nanos(deadline));
  Py_RETURN_NONE;
}

PyObject* py_pop_scope(PyObject*, PyObject*) {
  pop_scope();
  Py_RETURN_NONE;
}

PyMethodDef g_scope_methods[] = {
    {"push_scope", py_push_scope, METH_O, "Opens a deadline scope on this thread (engine clock, seconds)."},
    {"pop_scope", py_pop_scope, METH_NOARGS, "Closes this thread's innermost deadline scope."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace
}  // namespace fastdist::watched

PYBIND11_MODULE(_watched, m) {
  using namespace fastdist;
  using namespace fastdist::watched;
  m.doc() = "fastdist's watched groups: a c10d Backend that bounds every op of the group it wraps.";
  py::module_::import("torch.distributed");

  set_fault_builder(&build_fault);
  py::enum_<FaultKind>(m, "FaultKind", "What kind of fault an op met (csrc/watched/watched.h).")
      .value("TIMEOUT", FaultKind::kTimeout)
      .value("BACKEND", FaultKind::kBackend)
      .value("INTERRUPTED", FaultKind::kInterrupted)
      .value("REFUSED", FaultKind::kRefused)
      .value("REMOTE", FaultKind::kRemote);

  m.def("set_engine", [](py::capsule cap) {
    auto* engine = static_cast<std::shared_ptr<Engine>*>(cap.get_pointer());
    shared_engine() = *engine;
  });
  m.def("set_fault_builder", [](py::object fn) { py_builder() = std::move(fn); });
  set_check_hook(&run_check);
  m.def("set_check_hook", [](py::object fn) { py_check() = std::move(fn); });
  m.def("set_checks_enabled", &set_checks_enabled, py::arg("on"));
  // The tag C++ puts on its store records (fastdist.store.seal's, made here: the test compares).
  m.def("seal_tag", &seal_tag, py::arg("key"), py::arg("body"));
  m.def("set_main_thread", [](unsigned long ident) { set_main_thread(ident); });
  for (PyMethodDef* def = g_scope_methods; def->ml_name != nullptr; ++def) {
    m.attr(def->ml_name) = py::reinterpret_steal<py::object>(PyCFunction_NewEx(def, nullptr, m.attr("__name__").ptr()));
  }
  m.def(
      "set_next_deadline",
      [](double deadline, double start) {
        set_next_deadline(seconds_arg(deadline, "deadline"), start > 0 ? seconds_arg(start, "start") : 0);
      },
      py::arg("deadline"), py::arg("start") = 0.0);
  // Reports an exception that has nowhere to go (a timeout handler's, on fastdist's own thread)
  // through sys.unraisablehook, as an exception in __del__ is.
  m.def("write_unraisable", [](const py::object& exc, const py::object& where) {
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    PyErr_WriteUnraisable(where.ptr());
  });
  m.def("abandoned_inflight", &abandoned_inflight);
  m.def("gloo_budget", &gloo_budget, py::arg("budget"));
  m.def("install_sigint_hook", &install_sigint_hook);
  m.def("keep_dead_backends", &keep_dead_backends);
  m.def("clear_next_deadline", &clear_next_deadline);
  m.def("set_history_enabled", &set_history_enabled, py::arg("on"));

  // dynamic_attr: torch's group creation sets options.group_name etc. on a gloo backend.
  py::class_<SoloBackend, c10d::Backend, c10::intrusive_ptr<SoloBackend>>(m, "SoloBackend", py::dynamic_attr())
      .def(py::init([](int rank, int size, const std::string& name) {
             if (size < 1 || rank < 0 || rank >= size) throw py::value_error("rank must be in [0, size)");
             return c10::make_intrusive<SoloBackend>(rank, size, name);
           }),
           py::arg("rank"), py::arg("size"), py::arg("name"))
      .def("_set_sequence_number_for_group", [](SoloBackend&) {});

  // One group's op numbers, history and dead state (watched.h): a watched backend's `ctl`, or
  // one made here for a group torch made, shared by the private WatchedBackends fastdist issues
  // its own ops on (`polled`: NCCL-like completion).
  py::class_<GroupCtl, std::shared_ptr<GroupCtl>>(m, "GroupCtl")
      .def(py::init([](const std::string& name, int rank, int size, bool polled) {
             if (size < 1 || rank < 0 || rank >= size) throw py::value_error("rank must be in [0, size)");
             return std::make_shared<GroupCtl>(name, rank, size, kNever, polled, shared_engine());
           }),
           py::arg("name"), py::arg("rank"), py::arg("size"), py::arg("polled") = false)
      .def_property_readonly("id", &GroupCtl::id)
      .def_property_readonly("seq", &GroupCtl::seq)
      .def(
          "begin", [](GroupCtl& ctl, const std::string& op) { return ctl.begin(intern(op), steady_now(), {}); },
          py::arg("op"))
      .def(
          "prev_of",
          [](GroupCtl& ctl, std::uint64_t seq) -> py::object {
            auto prev = ctl.prev_of(seq);
            return prev.empty() ? py::object(py::none()) : py::object(py::str(prev));
          },
          py::arg("seq"))
      .def_property_readonly("dead", &GroupCtl::dead)
      .def_property_readonly("dead_reason", &GroupCtl::dead_reason)
      .def_property_readonly("settled_reason",
                             [](GroupCtl& ctl) -> py::object {
                               auto r = ctl.settled_reason();
                               return r.empty() ? py::object(py::none()) : py::object(py::str(r));
                             })
      .def("settle_dead", &GroupCtl::settle_dead, py::arg("reason"), py::arg("replace") = false)
      .def("revive", &GroupCtl::revive)
      // The group's last 64 ops, oldest first (fastdist.history).
      .def("history",
           [](GroupCtl& ctl) {
             py::list out;
             static const char* outcomes[] = {"pending", "ok", "timed_out", "failed"};
             for (const auto& r : ctl.history()) {
               py::dict d;
               d["seq"] = r.seq;
               d["op"] = r.op;
               d["thread"] = r.thread;
               d["start"] = nanos_to_seconds(r.start);
               d["end"] = r.end ? py::object(py::float_(nanos_to_seconds(r.end))) : py::object(py::none());
               d["outcome"] = outcomes[static_cast<int>(r.outcome)];
               d["tensors"] = r.tensors;
               if (r.dtype >= 0) {
                 d["dtype"] = std::string(c10::toString(static_cast<c10::ScalarType>(r.dtype)));
                 py::list shape;
                 for (std::uint8_t i = 0; i < r.ndim; ++i) shape.append(r.shape[i]);
                 d["shape"] = shape;
               } else {
                 d["dtype"] = py::none();
                 d["shape"] = py::none();
               }
               out.append(d);
             }
             return out;
           });

  py::class_<WatchedBackend, c10d::Backend, c10::intrusive_ptr<WatchedBackend>>(m, "WatchedBackend")
      // `stream_marker`: the capsule of an NCCL-like backend that is not ProcessGroupNCCL
      // (StreamMarkerFn in watched.h), or None.
      .def(py::init([](const c10::intrusive_ptr<c10d::Backend>& inner, const std::string& name, double default_timeout,
                       bool polled, const py::object& stream_marker) {
             TORCH_CHECK(shared_engine(), "fastdist._watched.set_engine() was not called");
             const StreamMarkerFn marker = marker_arg(stream_marker);
             auto ctl = std::make_shared<GroupCtl>(name, inner->getRank(), inner->getSize(),
                                                   seconds_arg(default_timeout, "default_timeout"),
                                                   polled || marker != nullptr, shared_engine());
             auto b = c10::make_intrusive<WatchedBackend>(inner, std::move(ctl), marker);
             register_backend(b);
             return b;
           }),
           py::arg("inner"), py::arg("name"), py::arg("default_timeout"), py::arg("polled") = false,
           py::arg("stream_marker") = py::none())
      // A private wrapper of a group torch made (fastdist's own ops go through it), numbered,
      // bounded and reported by `ctl`, which its other devices' wrappers share.
      .def(py::init([](const c10::intrusive_ptr<c10d::Backend>& inner, const std::shared_ptr<GroupCtl>& ctl,
                       const py::object& stream_marker) {
             TORCH_CHECK(ctl->engine, "the GroupCtl was made before fastdist._watched.set_engine()");
             auto b = c10::make_intrusive<WatchedBackend>(inner, ctl, marker_arg(stream_marker));
             register_backend(b);
             return b;
           }),
           py::arg("inner"), py::arg("ctl"), py::arg("stream_marker") = py::none())
      .def_property_readonly("inner", &WatchedBackend::inner)
      .def("swap_inner", &WatchedBackend::swap_inner, py::arg("fresh"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("ctl_id", [](const WatchedBackend& b) { return b.ctl()->id(); })
      .def_property_readonly("polled", [](const WatchedBackend& b) { return b.ctl()->polled; })
      .def_property_readonly("ctl", [](const WatchedBackend& b) { return b.ctl(); })
      // The ops in flight on the group, oldest first: (op, seq, issuing thread, start).
      .def("inflight_ops",
           [](const WatchedBackend& b) {
             std::vector<std::tuple<std::string, std::uint64_t, unsigned long, double>> out;
             for (auto& w : b.ctl()->inflight()) {
               if (w->ended()) continue;
               out.emplace_back(w->op_name(), w->op_seq(), w->issuing_thread(), nanos_to_seconds(w->op_start()));
             }
             std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return std::get<1>(x) < std::get<1>(y); });
             return out;
           })
      // A peer reported a fault on the group (`detail`: its record): GroupCtl::fail_remote.
      .def(
          "fail_remote",
          [](const WatchedBackend& b, const std::string& detail, const std::string& reason) {
            return b.ctl()->fail_remote(detail, reason);
          },
          py::arg("detail"), py::arg("reason"), py::call_guard<py::gil_scoped_release>())
      // The report C++ makes at a deadline when Python cannot run (NativeReport); `store` must
      // be one that runs no Python (the caller checks).
      .def(
          "set_native_report",
          [](const WatchedBackend& b, c10d::Store& store, const std::string& group, std::int64_t generation, int rank,
             int global_rank, const std::string& fault_key, const std::string& status_key,
             const std::string& count_key, std::vector<std::string> inboxes, const std::string& secret) {
            auto r = std::make_shared<NativeReport>();
            r->store = c10::intrusive_ptr<c10d::Store>::reclaim_copy(&store);
            r->group = group;
            r->generation = generation;
            r->rank = rank;
            r->global_rank = global_rank;
            r->fault_key = fault_key;
            r->status_key = status_key;
            r->count_key = count_key;
            r->inboxes = std::move(inboxes);
            r->secret = secret;
            b.ctl()->set_native_report(std::move(r));
          },
          py::arg("store"), py::arg("group"), py::arg("generation"), py::arg("rank"), py::arg("global_rank"),
          py::arg("fault_key"), py::arg("status_key"), py::arg("count_key"), py::arg("inboxes"),
          py::arg("secret") = std::string())
      .def("clear_native_report", [](const WatchedBackend& b) { b.ctl()->set_native_report(nullptr); })
      .def(
          "native_posted", [](const WatchedBackend& b, std::int64_t generation) { return b.ctl()->native_posted(generation); },
          py::arg("generation"))
      .def_property(
          "default_timeout",
          [](const WatchedBackend& b) { return nanos_to_seconds(b.ctl()->default_timeout.load()); },
          [](const WatchedBackend& b, double s) { b.ctl()->default_timeout.store(seconds_arg(s, "default_timeout")); });
}
