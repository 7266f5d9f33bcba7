#include "watched.h"

#include <Python.h>
#include <pthread.h>
#include <semaphore.h>
#include <cerrno>
#include <signal.h>
#include <torch/csrc/Exceptions.h>
#include <torch/version.h>

#include <algorithm>
#include <set>
#include <thread>

namespace fastdist::watched {

namespace {

// ---------------------------------------------------------------------------------------------
// Scopes

thread_local std::vector<Nanos> t_scopes;  // effective deadlines, innermost last
thread_local Nanos t_next = kNever;
thread_local bool t_has_next = false;

std::mutex& open_mu() {
  static auto* mu = new std::mutex();
  return *mu;
}
std::multiset<Nanos>& open_scopes() {
  static auto* s = new std::multiset<Nanos>();
  return *s;
}
std::atomic<int> g_open{0};
std::atomic<std::int64_t> g_abandoned{0};

FaultBuilder& builder() {
  static auto* b = new FaultBuilder();
  return *b;
}

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

void push_scope(Nanos deadline) {
  const Nanos eff = t_scopes.empty() ? deadline : std::min(deadline, t_scopes.back());
  t_scopes.push_back(eff);
  std::lock_guard<std::mutex> lk(open_mu());
  open_scopes().insert(eff);
  g_open.fetch_add(1, std::memory_order_release);
}

void pop_scope() {
  if (t_scopes.empty()) return;
  const Nanos eff = t_scopes.back();
  t_scopes.pop_back();
  std::lock_guard<std::mutex> lk(open_mu());
  auto it = open_scopes().find(eff);
  if (it != open_scopes().end()) open_scopes().erase(it);
  g_open.fetch_sub(1, std::memory_order_release);
}

void set_next_deadline(Nanos deadline) {
  t_next = deadline;
  t_has_next = true;
}

void clear_next_deadline() { t_has_next = false; }

Nanos scope_deadline() {
  if (!t_scopes.empty()) return t_scopes.back();
  if (g_open.load(std::memory_order_acquire) == 0) return kNever;
  // A thread that never ran Python (autograd's device threads, which run DDP's and FSDP's hooks
  // for GPU tensors) issues ops on behalf of code blocked elsewhere: the soonest scope open in
  // the process bounds them. A Python thread outside any scope is not bound by others' scopes.
  if (PyGILState_GetThisThreadState() != nullptr) return kNever;
  std::lock_guard<std::mutex> lk(open_mu());
  return open_scopes().empty() ? kNever : *open_scopes().begin();
}

std::int64_t abandoned_inflight() { return g_abandoned.load(); }

void set_fault_builder(FaultBuilder b) { builder() = std::move(b); }

// ---------------------------------------------------------------------------------------------
// GroupCtl

namespace {
std::atomic<bool> g_history{true};
}  // namespace

void set_history_enabled(bool on) { g_history.store(on, std::memory_order_relaxed); }

std::uint64_t GroupCtl::begin(const char* op, Nanos start, c10::ArrayRef<at::Tensor> ins) {
  OpRecord rec;
  rec.op = op;
  const bool details = g_history.load(std::memory_order_relaxed);
  if (details) {
    rec.thread = static_cast<unsigned long>(pthread_self());
    rec.start = start;
    rec.tensors = static_cast<std::uint32_t>(ins.size());
  }
  if (details && !ins.empty() && ins[0].defined()) {
    rec.dtype = static_cast<std::int8_t>(ins[0].scalar_type());
    rec.ndim = static_cast<std::uint8_t>(std::min<std::int64_t>(ins[0].dim(), OpRecord::kDims));
    for (std::uint8_t d = 0; d < rec.ndim; ++d) rec.shape[d] = ins[0].size(d);
  }
  std::lock_guard<std::mutex> lk(mu_);
  const std::uint64_t s = ++seq_;
  rec.seq = s;
  ring_[s % kRing] = rec;
  return s;
}

void GroupCtl::end(std::uint64_t seq, Outcome outcome) {
  if (!g_history.load(std::memory_order_relaxed)) return;
  const Nanos now = steady_now();
  std::lock_guard<std::mutex> lk(mu_);
  OpRecord& rec = ring_[seq % kRing];
  if (rec.seq == seq && rec.outcome == Outcome::kPending) {
    rec.end = now;
    rec.outcome = outcome;
  }
}

std::vector<OpRecord> GroupCtl::history() {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<OpRecord> out;
  const std::uint64_t first = seq_ >= kRing ? seq_ - kRing + 1 : 1;
  for (std::uint64_t s = first; s <= seq_; ++s) {
    if (ring_[s % kRing].seq == s) out.push_back(ring_[s % kRing]);
  }
  return out;
}

std::string GroupCtl::prev_of(std::uint64_t seq) {
  std::lock_guard<std::mutex> lk(mu_);
  const std::uint64_t prev = seq - 1;
  if (seq < 2 || prev + kRing <= seq_ || ring_[prev % kRing].seq != prev) return "";
  return std::string(ring_[prev % kRing].op) + " #" + std::to_string(prev);
}

void GroupCtl::rollback(std::uint64_t seq) {
  std::lock_guard<std::mutex> lk(mu_);
  if (seq_ == seq) {
    ring_[seq % kRing] = OpRecord{};
    --seq_;
  }
}

std::uint64_t GroupCtl::seq() {
  std::lock_guard<std::mutex> lk(mu_);
  return seq_;
}

bool GroupCtl::dead() {
  std::lock_guard<std::mutex> lk(mu_);
  return dead_;
}

std::string GroupCtl::dead_reason() {
  std::lock_guard<std::mutex> lk(mu_);
  return dead_reason_;
}

bool GroupCtl::mark_dead(const std::string& reason) {
  std::lock_guard<std::mutex> lk(mu_);
  if (dead_) return false;
  dead_ = true;
  dead_reason_ = reason;
  return true;
}

void GroupCtl::revive() {
  std::exception_ptr old;
  {
    std::lock_guard<std::mutex> lk(mu_);
    dead_ = false;
    dead_reason_.clear();
    // Every member starts the new generation at op 1, in step again.
    seq_ = 0;
    std::fill(std::begin(ring_), std::end(ring_), OpRecord{});
    fault_state_ = 0;
    old = std::move(fault_error_);
    fault_error_ = nullptr;
    inflight_.clear();
  }
}

std::exception_ptr GroupCtl::fault(const FaultInfo& info) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!dead_) {
    dead_ = true;
    dead_reason_ = info.op + " #" + std::to_string(info.seq) + " " +
                   (info.kind == "timeout"       ? "timed out"
                    : info.kind == "interrupted" ? "was interrupted"
                    : info.kind == "remote"      ? "ended by a peer's fault"
                                                 : "failed") +
                   " on rank " + std::to_string(rank);
  }
  if (fault_state_ == 2) return fault_error_;
  if (fault_state_ == 1) {
    cv_.wait(lk, [&] { return fault_state_ == 2; });
    return fault_error_;
  }
  fault_state_ = 1;
  lk.unlock();
  std::exception_ptr err;
  if (builder()) err = builder()(id(), info);
  if (!err) err = plain_error(info.op + " #" + std::to_string(info.seq) + " on group '" + name + "' " + info.kind);
  lk.lock();
  fault_error_ = err;
  fault_state_ = 2;
  lk.unlock();
  cv_.notify_all();
  for (auto& w : inflight()) w->fail(err);
  return err;
}

std::exception_ptr GroupCtl::refusal(const char* op) {
  FaultInfo info;
  info.kind = "refused";
  info.op = op;
  info.detail = dead_reason();
  if (builder()) {
    auto err = builder()(id(), info);
    if (err) return err;
  }
  return plain_error(std::string(op) + " on group '" + name + "': the group is aborted (" + info.detail + ")");
}

void GroupCtl::track(const c10::intrusive_ptr<WatchedWork>& w) {
  std::lock_guard<std::mutex> lk(mu_);
  inflight_.emplace(w.get(), c10::weak_intrusive_ptr<WatchedWork>(w));
}

void GroupCtl::untrack(WatchedWork* w) {
  std::lock_guard<std::mutex> lk(mu_);
  inflight_.erase(w);
}

std::vector<c10::intrusive_ptr<WatchedWork>> GroupCtl::inflight() {
  std::vector<c10::intrusive_ptr<WatchedWork>> out;
  std::lock_guard<std::mutex> lk(mu_);
  out.reserve(inflight_.size());
  for (auto& entry : inflight_) {
    auto strong = entry.second.lock();  // null for a work whose last reference is being dropped
    if (strong) out.push_back(std::move(strong));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Poller (NCCL-like groups): completes the works nobody waits on, off any Python thread.

namespace {

struct Poller {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<c10::intrusive_ptr<WatchedWork>> works;
  bool started = false;

  void add(const c10::intrusive_ptr<WatchedWork>& w) {
    {
      std::lock_guard<std::mutex> lk(mu);
      works.push_back(w);
      if (!started) {
        started = true;
        std::thread([this] { loop(); }).detach();
      }
    }
    cv.notify_one();
  }

  void loop() {
    auto interval = std::chrono::microseconds(1000);
    for (;;) {
      std::vector<c10::intrusive_ptr<WatchedWork>> batch;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return !works.empty(); });
        batch.swap(works);
      }
      std::vector<c10::intrusive_ptr<WatchedWork>> left;
      bool progress = false;
      for (auto& w : batch) {
        if (w->poll_inner()) {
          progress = true;
        } else {
          left.push_back(std::move(w));
        }
      }
      batch.clear();  // drops finished works here, outside the lock
      if (!left.empty()) {
        std::lock_guard<std::mutex> lk(mu);
        works.insert(works.end(), std::make_move_iterator(left.begin()), std::make_move_iterator(left.end()));
      }
      interval = progress ? std::chrono::microseconds(1000) : std::min(interval * 2, std::chrono::microseconds(10000));
      if (!left.empty()) std::this_thread::sleep_for(interval);
    }
  }
};

Poller& poller() {
  static auto* p = new Poller();  // leaked: its thread outlives static destruction
  return *p;
}

}  // namespace

void poll_register(const c10::intrusive_ptr<WatchedWork>& work) { poller().add(work); }

// ---------------------------------------------------------------------------------------------
// Signals: a waiter on the main thread checks Python's signal handlers every slice.

namespace {

constexpr Nanos kSlice = 100'000'000;  // 100 ms

std::atomic<unsigned long> g_main_thread{0};

// Runs Python's signal handlers when on the main thread; returns the exception one raised.
std::exception_ptr check_signals() {
  if (g_main_thread.load(std::memory_order_relaxed) != static_cast<unsigned long>(pthread_self())) return nullptr;
  if (python_finalizing()) return nullptr;
  PyGILState_STATE gil = PyGILState_Ensure();
  std::exception_ptr out;
  if (PyErr_CheckSignals() != 0) out = fetch_python_error();
  PyGILState_Release(gil);
  return out;
}

}  // namespace

void set_main_thread(unsigned long ident) { g_main_thread.store(ident); }

// ---------------------------------------------------------------------------------------------
// WatchedWork

WatchedWork::WatchedWork(c10::intrusive_ptr<c10d::Work> inner, std::shared_ptr<GroupCtl> ctl, const char* op,
                         std::uint64_t seq, Nanos start, Nanos deadline, c10d::OpType type)
    : c10d::Work(ctl->rank, type), inner_(std::move(inner)), ctl_(std::move(ctl)), op_(op), seq_(seq), start_(start),
      deadline_(deadline), thread_(static_cast<unsigned long>(pthread_self())) {
  try {
    inner_fut_ = inner_->getFuture();
  } catch (const std::exception&) {
    inner_fut_.reset();  // gloo send/recv: "getFuture not implemented"
  }
  if (inner_fut_) {
    fut_ = c10::make_intrusive<c10::ivalue::Future>(inner_fut_->elementType(), inner_fut_->devices());
  } else {
    fut_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
  }
}

WatchedWork::~WatchedWork() = default;

void WatchedWork::release_resources() {
  ctl_->untrack(this);
  if (token_) token_->cancel();
  // Nobody can end this op any more: a future that torch's code still waits on must not hang.
  bool done;
  {
    std::lock_guard<std::mutex> lk(wmu_);
    done = done_;
  }
  if (!done) fut_->setErrorIfNeeded(plain_error(std::string(op_) + " #" + std::to_string(seq_) + " was abandoned"));
}

void WatchedWork::arm() {
  auto self = c10::intrusive_ptr<WatchedWork>::reclaim_copy(this);
  c10::weak_intrusive_ptr<WatchedWork> weak(self);
  ctl_->track(self);
  token_ = ctl_->engine->add(deadline_, [weak]() mutable {
    if (auto w = weak.lock()) w->expired();
  });
  if (ctl_->polled) {
    // The future says when the op was enqueued: mirror it for torch's consumers (they order
    // their streams on it); completion on the device is polled.
    if (inner_fut_) {
      auto fut = fut_;
      inner_fut_->addCallback([fut](c10::ivalue::Future& f) {
        if (fut->completed()) return;
        if (f.hasError()) {
          fut->setErrorIfNeeded(f.exception_ptr());
        } else {
          fut->markCompleted(f.value(), f.storages());
        }
      });
    }
    poll_register(self);
  } else if (!inner_fut_) {
    // A posted op (gloo send/recv) has no future, and gloo's wait() is the only way to learn
    // that it ended: one wait, on a thread of its own, for the whole budget plus a grace. (Never
    // in slices: a gloo send/recv whose wait times out closes the pair, and the op with it.)
    const Nanos now = steady_now();
    std::chrono::milliseconds budget = kNoTimeout;
    if (deadline_ != kNever) {
      const double left = nanos_to_seconds(std::max<Nanos>(deadline_ - now, 0));
      const double grace = std::min(1.0, std::max(0.1, 0.1 * left));
      budget = std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil((left + grace) * 1000.0)));
    }
    auto inner = inner_;
    std::thread([self, inner, budget]() mutable {
      std::exception_ptr err;
      bool ok = false;
      try {
        ok = inner->wait(budget);
      } catch (...) {
        err = std::current_exception();
      }
      if (!err && !(ok && inner->isSuccess())) {
        // gloo can mark a receive that timed out completed but not successful.
        err = inner->exception() ? inner->exception() : plain_error("the point-to-point op did not succeed");
      }
      self->inner_done(err);
      self.reset();
    }).detach();
  } else {
    // Holds the work until the op ends: torch's callers (DDP's reducer) keep only the future.
    inner_fut_->addCallback([self](c10::ivalue::Future& f) mutable {
      self->inner_done(f.hasError() ? f.exception_ptr() : nullptr);
      self.reset();
    });
  }
}

bool WatchedWork::ended() const {
  std::lock_guard<std::mutex> lk(wmu_);
  return done_;
}

std::exception_ptr WatchedWork::fail_remote(const std::string& detail) {
  return ctl_->fault(info("remote", detail, false));
}

FaultInfo WatchedWork::info(const std::string& kind, const std::string& detail, bool waiter) const {
  FaultInfo fi;
  fi.kind = kind;
  fi.op = op_;
  fi.seq = seq_;
  fi.start = nanos_to_seconds(start_);
  fi.deadline = nanos_to_seconds(deadline_);
  fi.detail = detail;
  fi.prev = ctl_->prev_of(seq_);
  fi.waiter = waiter;
  return fi;
}

void WatchedWork::finish_locked(std::exception_ptr error, std::unique_lock<std::mutex>& lk) {
  done_ = true;
  error_ = error;
  ctl_->end(seq_, !error                                              ? Outcome::kOk
                  : token_ && token_->state() == State::kExpired ? Outcome::kTimedOut
                                                                 : Outcome::kFailed);
  if (error && !inner_ended_ && !ctl_->polled && !abandoned_) {
    abandoned_ = true;
    g_abandoned.fetch_add(1);
  }
  auto token = token_;
  lk.unlock();
  wcv_.notify_all();
  if (token) token->complete();
  ctl_->untrack(this);
  if (error) {
    fut_->setErrorIfNeeded(error);
  } else if (!ctl_->polled && !fut_->completed()) {
    if (inner_fut_ && inner_fut_->completed() && !inner_fut_->hasError()) {
      fut_->markCompleted(inner_fut_->value(), inner_fut_->storages());
    } else {
      try {
        fut_->markCompleted(c10::IValue(inner_->result()));
      } catch (const std::exception&) {
        fut_->markCompleted(c10::IValue(std::vector<at::Tensor>()));
      }
    }
  }
  lk.lock();
}

void WatchedWork::fail(std::exception_ptr error) {
  std::unique_lock<std::mutex> lk(wmu_);
  if (done_) return;
  finish_locked(error, lk);
}

void WatchedWork::inner_done(std::exception_ptr error) {
  std::unique_lock<std::mutex> lk(wmu_);
  inner_ended_ = true;
  if (abandoned_) {
    abandoned_ = false;
    g_abandoned.fetch_sub(1);
  }
  if (done_) {
    // Failed earlier (deadline, or the group's fault), and now the backend let go of the op:
    // drop it, and with it the backend's connections it references (a dead group's), now.
    if (error_) {
      auto doomed = std::move(inner_);
      lk.unlock();
    }
    return;
  }
  if (!error) {
    finish_locked(nullptr, lk);
    return;
  }
  inner_error_ = error;
  if (waiters_ > 0) {
    lk.unlock();
    wcv_.notify_all();  // the waiter builds the fault on its own thread
    return;
  }
  lk.unlock();
  // A backend thread (gloo's worker runs this callback) must not wait for the report.
  trigger_fault_async(info("backend", what_of(error), false));
}

void WatchedWork::expired() {
  std::unique_lock<std::mutex> lk(wmu_);
  if (done_) return;
  if (waiters_ > 0) {
    lk.unlock();
    wcv_.notify_all();
    return;
  }
  lk.unlock();
  trigger_fault_async(info("timeout", "", false));
}

void WatchedWork::trigger_fault_async(FaultInfo fi) {
  // Holds this work until the fault is delivered to it: torch's callers may hold only its future
  // (DDP's reducer), and the backend's callback that brought the error drops its reference when
  // it returns. (Called only from a context that holds a reference: a callback or the expiry.)
  auto self = c10::intrusive_ptr<WatchedWork>::reclaim_copy(this);
  auto ctl = ctl_;
  std::thread([ctl, fi, self]() mutable {
    auto err = ctl->fault(fi);
    self->fail(err);
    self.reset();
  }).detach();
}

bool WatchedWork::poll_inner() {
  c10::intrusive_ptr<c10d::Work> inner;
  {
    std::lock_guard<std::mutex> lk(wmu_);
    if (done_) return true;
    inner = inner_;
  }
  bool completed = false;
  std::exception_ptr err;
  try {
    completed = inner->isCompleted();
    if (completed && !inner->isSuccess()) err = inner->exception();
  } catch (...) {
    completed = true;
    err = std::current_exception();
  }
  if (!completed) return false;
  inner_done(err);
  return true;
}

bool WatchedWork::wake_waiter() {
  {
    std::lock_guard<std::mutex> lk(wmu_);
    if (waiters_ == 0) return false;
  }
  wcv_.notify_all();
  return true;
}

bool WatchedWork::isCompleted() {
  std::lock_guard<std::mutex> lk(wmu_);
  return done_;
}

bool WatchedWork::isSuccess() const {
  std::lock_guard<std::mutex> lk(wmu_);
  return done_ && !error_;
}

std::exception_ptr WatchedWork::exception() const {
  std::lock_guard<std::mutex> lk(wmu_);
  return error_;
}

int WatchedWork::sourceRank() const {
  std::lock_guard<std::mutex> lk(wmu_);
  return inner_ ? inner_->sourceRank() : -1;
}

std::vector<at::Tensor> WatchedWork::result() {
  std::lock_guard<std::mutex> lk(wmu_);
  return inner_ ? inner_->result() : std::vector<at::Tensor>();
}

void WatchedWork::synchronize() {
  c10::intrusive_ptr<c10d::Work> inner;
  {
    std::lock_guard<std::mutex> lk(wmu_);
    inner = inner_;
  }
  if (inner) inner->synchronize();
}

void WatchedWork::abort() {
  c10::intrusive_ptr<c10d::Work> inner;
  {
    std::lock_guard<std::mutex> lk(wmu_);
    inner = inner_;
  }
  if (inner) inner->abort();
}

c10::intrusive_ptr<c10::ivalue::Future> WatchedWork::getFuture() { return fut_; }

bool WatchedWork::wait(std::chrono::milliseconds timeout) {
  // torch's own timeout, when given, bounds this wait softly (as torch's wait does); the op's
  // deadline is fastdist's.
  const Nanos soft_end = timeout == kNoTimeout ? kNever : steady_now() + timeout.count() * 1'000'000;
  std::unique_lock<std::mutex> lk(wmu_);
  ++waiters_;
  struct Leave {
    std::atomic<int>& n;
    ~Leave() { n.fetch_sub(1); }
  } leave{waiters_};
  Nanos interval = 20'000;  // polled: 20 us, backing off to 1 ms
  for (;;) {
    if (done_) {
      if (!error_) return true;
      auto error = error_;
      lk.unlock();
      // A Ctrl-C that ended the group's ops: raise Python's KeyboardInterrupt (its handler runs
      // here, once), not the group's error.
      if (auto interrupt = check_signals()) std::rethrow_exception(interrupt);
      std::rethrow_exception(error);
    }
    const Nanos now = steady_now();
    std::string kind;
    std::string detail;
    if (inner_ended_ && inner_error_) {
      kind = "backend";
      detail = what_of(inner_error_);
    } else if (now >= deadline_) {
      kind = "timeout";
    }
    if (!kind.empty()) {
      lk.unlock();
      auto err = ctl_->fault(info(kind, detail, true));
      lk.lock();
      if (!done_) finish_locked(err, lk);
      std::rethrow_exception(error_);
    }
    if (now >= soft_end) {
      TORCH_CHECK(false, "Operation timed out!");
    }
    const Nanos slice = std::min({kSlice, deadline_ - now, soft_end - now});
    if (ctl_->polled) {
      lk.unlock();
      bool finished = poll_inner();
      lk.lock();
      if (!finished && !done_) {
        wcv_.wait_for(lk, std::chrono::nanoseconds(std::min(interval, slice)));
        interval = std::min<Nanos>(interval * 2, 1'000'000);
      }
    } else {
      wcv_.wait_for(lk, std::chrono::nanoseconds(slice));
    }
    if (done_) continue;
    lk.unlock();
    auto interrupt = check_signals();
    lk.lock();
    if (interrupt) {
      // Ctrl-C: this rank leaves the op, so the group is out of step and dead. Others waiting on
      // it are told so; this thread raises the KeyboardInterrupt.
      lk.unlock();
      if (ctl_->mark_dead(std::string(op_) + " #" + std::to_string(seq_) + " was interrupted on rank " +
                          std::to_string(ctl_->rank))) {
        auto fi = info("interrupted", "", false);
        auto ctl = ctl_;
        std::thread([ctl, fi]() { ctl->fault(fi); }).detach();
      }
      lk.lock();
      if (!done_) finish_locked(interrupt, lk);
      std::rethrow_exception(interrupt);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Every watched backend (weakly), for Ctrl-C and exit.

namespace {

std::mutex& backends_mu() {
  static auto* mu = new std::mutex();
  return *mu;
}
std::vector<c10::weak_intrusive_ptr<WatchedBackend>>& backends() {
  static auto* v = new std::vector<c10::weak_intrusive_ptr<WatchedBackend>>();
  return *v;
}

std::vector<c10::intrusive_ptr<WatchedBackend>> live_backends() {
  std::vector<c10::intrusive_ptr<WatchedBackend>> out;
  std::lock_guard<std::mutex> lk(backends_mu());
  auto& v = backends();
  v.erase(std::remove_if(v.begin(), v.end(), [&](auto& w) {
            auto strong = w.lock();
            if (!strong) return true;
            out.push_back(std::move(strong));
            return false;
          }),
          v.end());
  return out;
}

struct sigaction g_prev_sigint;
sem_t g_sigint_sem;

void on_sigint(int sig, siginfo_t* info, void* context) {
  const int saved = errno;
  sem_post(&g_sigint_sem);  // async-signal-safe
  errno = saved;
  if (g_prev_sigint.sa_flags & SA_SIGINFO) {
    if (g_prev_sigint.sa_sigaction != nullptr) g_prev_sigint.sa_sigaction(sig, info, context);
  } else if (g_prev_sigint.sa_handler != SIG_DFL && g_prev_sigint.sa_handler != SIG_IGN) {
    g_prev_sigint.sa_handler(sig);
  }
}

void interrupt_loop() {
  for (;;) {
    while (sem_wait(&g_sigint_sem) != 0) {
    }
    for (auto& b : live_backends()) {
      auto ctl = b->ctl();
      std::vector<c10::intrusive_ptr<WatchedWork>> unwaited;
      for (auto& w : ctl->inflight()) {
        if (!w->wake_waiter()) unwaited.push_back(w);
      }
      if (unwaited.empty()) continue;
      // Ops that torch's C++ waits on (DDP's buckets): end them, so the main thread gets back to
      // Python, where Python's own handler raises the KeyboardInterrupt.
      FaultInfo fi;
      fi.kind = "interrupted";
      fi.op = "op";
      fi.seq = ctl->seq();
      fi.detail = "interrupted (SIGINT)";
      ctl->mark_dead("an op was interrupted (Ctrl-C) on rank " + std::to_string(ctl->rank));
      auto err = ctl->fault(fi);
      for (auto& w : unwaited) w->fail(err);
    }
  }
}

}  // namespace

void install_sigint_hook() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current;
    if (sigaction(SIGINT, nullptr, &current) != 0) return;
    const bool plain = !(current.sa_flags & SA_SIGINFO);
    if (plain && (current.sa_handler == SIG_DFL || current.sa_handler == SIG_IGN)) return;
    g_prev_sigint = current;
    sem_init(&g_sigint_sem, 0, 0);
    std::thread(interrupt_loop).detach();
    struct sigaction sa {};
    sa.sa_sigaction = &on_sigint;
    sa.sa_flags = SA_SIGINFO | (current.sa_flags & SA_RESTART) | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);
  });
}

void keep_dead_backends() {
  static auto* kept = new std::vector<c10::intrusive_ptr<c10d::Backend>>();  // never freed
  for (auto& b : live_backends()) {
    if (b->ctl()->dead()) kept->push_back(b->inner());
  }
}

// ---------------------------------------------------------------------------------------------
// WatchedBackend

WatchedBackend::WatchedBackend(c10::intrusive_ptr<c10d::Backend> inner, std::shared_ptr<GroupCtl> ctl)
    : c10d::Backend(inner->getRank(), inner->getSize()), inner_(std::move(inner)), ctl_(std::move(ctl)) {
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 3
  setBoundDeviceId(inner_->getBoundDeviceId());
#endif
}

void register_backend(const c10::intrusive_ptr<WatchedBackend>& b) {
  std::lock_guard<std::mutex> lk(backends_mu());
  backends().emplace_back(b);
}

c10::intrusive_ptr<c10d::Backend> WatchedBackend::inner() {
  std::lock_guard<std::mutex> lk(inner_mu_);
  return inner_;
}

void WatchedBackend::swap_inner(c10::intrusive_ptr<c10d::Backend> fresh) {
  TORCH_CHECK(fresh->getRank() == getRank() && fresh->getSize() == getSize(),
              "fastdist: a group rebuilt in place keeps its rank and size");
  {
    std::lock_guard<std::mutex> lk(inner_mu_);
    inner_.swap(fresh);
  }
  ctl_->revive();
  // `fresh` now holds the old backend; it is dropped here, outside the lock.
}

Nanos WatchedBackend::deadline_for(Nanos now) {
  if (t_has_next) {
    t_has_next = false;
    return t_next;
  }
  Nanos d = scope_deadline();
  const Nanos dflt = ctl_->default_timeout.load(std::memory_order_relaxed);
  if (dflt != kNever && dflt < kNever - now) d = std::min(d, now + dflt);
  return d;
}

void WatchedBackend::refuse_if_dead(const char* op) {
  if (ctl_->dead()) {
    t_has_next = false;
    std::rethrow_exception(ctl_->refusal(op));
  }
}

c10::intrusive_ptr<c10d::Work> WatchedBackend::watch(const char* op, c10d::OpType type, std::uint64_t seq, Nanos start,
                                                     Nanos deadline, c10::intrusive_ptr<c10d::Work> inner) {
  auto w = c10::make_intrusive<WatchedWork>(std::move(inner), ctl_, op, seq, start, deadline, type);
  w->arm();
  return w;
}

template <typename Opts, typename Issue>
c10::intrusive_ptr<c10d::Work> WatchedBackend::run(const char* op, c10d::OpType type, const Opts& opts, Issue&& issue,
                                                   c10::ArrayRef<at::Tensor> ins) {
  refuse_if_dead(op);
  const Nanos now = steady_now();
  const Nanos deadline = deadline_for(now);
  if (deadline <= now) {
    // The deadline passed before the op was issued: this rank skips it, so the group is out of
    // step. Say so, as for a timeout.
    const std::uint64_t seq = ctl_->begin(op, now, ins);
    FaultInfo fi;
    fi.kind = "timeout";
    fi.op = op;
    fi.seq = seq;
    fi.start = nanos_to_seconds(now);
    fi.deadline = nanos_to_seconds(deadline);
    fi.detail = "the deadline had passed before the call";
    fi.prev = ctl_->prev_of(seq);
    fi.waiter = true;
    std::rethrow_exception(ctl_->fault(fi));
  }
  Opts o = opts;
  if (!ctl_->polled && deadline != kNever) {
    // gloo gives up `grace` after fastdist's deadline, freeing its worker thread: 10% of the
    // budget, between 0.1 and 1 s (the skew between ranks' deadlines is absorbed by it).
    const double budget = nanos_to_seconds(deadline - now);
    const double grace = std::min(1.0, std::max(0.1, 0.1 * budget));
    const double ms = std::ceil((budget + grace) * 1000.0);
    if (ms < 1e12) {
      auto t = std::chrono::milliseconds(static_cast<std::int64_t>(ms));
      if (o.timeout == c10d::kUnsetTimeout || t < o.timeout) o.timeout = t;
    }
  }
  const std::uint64_t seq = ctl_->begin(op, now, ins);
  auto inner = this->inner();
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = issue(*inner, o);
  } catch (...) {
    ctl_->rollback(seq);  // refused by the backend (bad arguments): nothing was sent
    throw;
  }
  return watch(op, type, seq, now, deadline, std::move(work));
}

template <typename Issue>
c10::intrusive_ptr<c10d::Work> WatchedBackend::run_plain(const char* op, c10d::OpType type, Issue&& issue,
                                                         c10::ArrayRef<at::Tensor> ins) {
  struct NoOpts {
    std::chrono::milliseconds timeout = c10d::kUnsetTimeout;
  } none;
  return run(op, type, none, [&](c10d::Backend& b, NoOpts&) { return issue(b); }, ins);
}

const std::string WatchedBackend::getBackendName() const {
  return const_cast<WatchedBackend*>(this)->inner()->getBackendName();
}
bool WatchedBackend::supportsSplitting() const { return const_cast<WatchedBackend*>(this)->inner()->supportsSplitting(); }
bool WatchedBackend::supportsCoalescing() const {
  return const_cast<WatchedBackend*>(this)->inner()->supportsCoalescing();
}
void WatchedBackend::setTimeout(std::chrono::milliseconds timeout) {
  inner()->setTimeout(timeout);
  ctl_->default_timeout.store(static_cast<Nanos>(timeout.count()) * 1'000'000);
}
void WatchedBackend::startCoalescing() { inner()->startCoalescing(); }
c10::intrusive_ptr<c10d::Work> WatchedBackend::endCoalescing() {
  return run_plain("coalesced", c10d::OpType::COALESCED, [](c10d::Backend& b) { return b.endCoalescing(); });
}
c10::intrusive_ptr<c10d::Backend::Options> WatchedBackend::getBackendOptions() { return inner()->getBackendOptions(); }

c10::intrusive_ptr<c10d::Work> WatchedBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                         const c10d::BroadcastOptions& opts) {
  return run("broadcast", c10d::OpType::BROADCAST, opts,
             [&](c10d::Backend& b, c10d::BroadcastOptions& o) { return b.broadcast(tensors, o); }, tensors);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                         const c10d::AllreduceOptions& opts) {
  return run("all_reduce", c10d::OpType::ALLREDUCE, opts,
             [&](c10d::Backend& b, c10d::AllreduceOptions& o) { return b.allreduce(tensors, o); }, tensors);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                                const c10d::AllreduceOptions& opts) {
  return run("all_reduce_sparse", c10d::OpType::ALLREDUCE, opts,
             [&](c10d::Backend& b, c10d::AllreduceOptions& o) { return b.allreduce_sparse(tensors, o); }, tensors);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                   const c10d::AllreduceCoalescedOptions& opts) {
  return run("all_reduce_coalesced", c10d::OpType::ALLREDUCE_COALESCED, opts,
             [&](c10d::Backend& b, c10d::AllreduceCoalescedOptions& o) { return b.allreduce_coalesced(tensors, o); }, tensors);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  return run("reduce", c10d::OpType::REDUCE, opts,
             [&](c10d::Backend& b, c10d::ReduceOptions& o) { return b.reduce(tensors, o); }, tensors);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllgatherOptions& opts) {
  return run("all_gather", c10d::OpType::ALLGATHER, opts,
             [&](c10d::Backend& b, c10d::AllgatherOptions& o) { return b.allgather(outputs, inputs, o); }, inputs);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                               const c10d::AllgatherOptions& opts) {
  return run("all_gather_into_tensor", c10d::OpType::_ALLGATHER_BASE, opts,
             [&](c10d::Backend& b, c10d::AllgatherOptions& o) { return b._allgather_base(output, input, o); }, input);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                   std::vector<at::Tensor>& inputs,
                                                                   const c10d::AllgatherOptions& opts) {
  return run("all_gather_coalesced", c10d::OpType::ALLGATHER_COALESCED, opts,
             [&](c10d::Backend& b, c10d::AllgatherOptions& o) { return b.allgather_coalesced(outputs, inputs, o); }, inputs);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                               std::vector<at::Tensor>& inputs,
                                                                               const c10d::AllgatherOptions& opts) {
  return run("all_gather_into_tensor_coalesced", c10d::OpType::COALESCED, opts,
             [&](c10d::Backend& b, c10d::AllgatherOptions& o) {
               return b.allgather_into_tensor_coalesced(outputs, inputs, o);
             }, inputs);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  return run("gather", c10d::OpType::GATHER, opts,
             [&](c10d::Backend& b, c10d::GatherOptions& o) { return b.gather(outputs, inputs, o); }, inputs);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::scatter(std::vector<at::Tensor>& outputs,
                                                       std::vector<std::vector<at::Tensor>>& inputs,
                                                       const c10d::ScatterOptions& opts) {
  return run("scatter", c10d::OpType::SCATTER, opts,
             [&](c10d::Backend& b, c10d::ScatterOptions& o) { return b.scatter(outputs, inputs, o); });
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                              std::vector<std::vector<at::Tensor>>& inputs,
                                                              const c10d::ReduceScatterOptions& opts) {
  return run("reduce_scatter", c10d::OpType::REDUCE_SCATTER, opts,
             [&](c10d::Backend& b, c10d::ReduceScatterOptions& o) { return b.reduce_scatter(outputs, inputs, o); });
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                    const c10d::ReduceScatterOptions& opts) {
  return run("reduce_scatter_tensor", c10d::OpType::_REDUCE_SCATTER_BASE, opts,
             [&](c10d::Backend& b, c10d::ReduceScatterOptions& o) { return b._reduce_scatter_base(output, input, o); }, input);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                               std::vector<at::Tensor>& inputs,
                                                                               const c10d::ReduceScatterOptions& opts) {
  return run("reduce_scatter_tensor_coalesced", c10d::OpType::COALESCED, opts,
             [&](c10d::Backend& b, c10d::ReduceScatterOptions& o) {
               return b.reduce_scatter_tensor_coalesced(outputs, inputs, o);
             }, inputs);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                             std::vector<int64_t>& outputSplitSizes,
                                                             std::vector<int64_t>& inputSplitSizes,
                                                             const c10d::AllToAllOptions& opts) {
  return run("all_to_all_single", c10d::OpType::ALLTOALL_BASE, opts, [&](c10d::Backend& b, c10d::AllToAllOptions& o) {
    return b.alltoall_base(output, input, outputSplitSizes, inputSplitSizes, o);
  }, input);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::AllToAllOptions& opts) {
  return run("all_to_all", c10d::OpType::ALLTOALL, opts,
             [&](c10d::Backend& b, c10d::AllToAllOptions& o) { return b.alltoall(outputs, inputs, o); }, inputs);
}
void WatchedBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  inner()->monitoredBarrier(opts, waitAllRanks);
}
void WatchedBackend::setSequenceNumberForGroup() { inner()->setSequenceNumberForGroup(); }
uint64_t WatchedBackend::getSequenceNumberForGroup() { return inner()->getSequenceNumberForGroup(); }
c10::intrusive_ptr<c10d::Work> WatchedBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  return run_plain("send", c10d::OpType::SEND, [&](c10d::Backend& b) { return b.send(tensors, dstRank, tag); }, tensors);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  return run_plain("recv", c10d::OpType::RECV, [&](c10d::Backend& b) { return b.recv(tensors, srcRank, tag); }, tensors);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return run_plain("recv", c10d::OpType::RECVANYSOURCE, [&](c10d::Backend& b) { return b.recvAnysource(tensors, tag); }, tensors);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::barrier(const c10d::BarrierOptions& opts) {
  return run("barrier", c10d::OpType::BARRIER, opts,
             [&](c10d::Backend& b, c10d::BarrierOptions& o) { return b.barrier(o); });
}
void WatchedBackend::waitForPendingWorks() { inner()->waitForPendingWorks(); }
void WatchedBackend::setGroupUid(const std::string& pg_uid) {
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 5
  c10d::Backend::setGroupUid(pg_uid);
  inner()->setGroupUid(pg_uid);
#else
  (void)pg_uid;
#endif
}
void WatchedBackend::eagerConnectSingleDevice(at::Device device) { inner()->eagerConnectSingleDevice(device); }
void WatchedBackend::abort() { inner()->abort(); }
void WatchedBackend::shutdown() { inner()->shutdown(); }

}  // namespace fastdist::watched
