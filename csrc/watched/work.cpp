// WatchedWork: one op of a watched group, with its deadline.
#include "internal.h"

#include <Python.h>
#include <pthread.h>

#include <algorithm>
#include <optional>
#include <cmath>
#include <thread>

namespace fastdist::watched {

std::atomic<std::int64_t>& abandoned() {
  static std::atomic<std::int64_t> n{0};
  return n;
}

std::int64_t abandoned_inflight() { return abandoned().load(); }

// ---------------------------------------------------------------------------------------------
// WatchedWork

WatchedWork::WatchedWork(c10::intrusive_ptr<c10d::Work> inner, std::shared_ptr<GroupCtl> ctl, const char* op,
                         std::uint64_t seq, Nanos start, Nanos deadline, c10d::OpType type)
    : c10d::Work(ctl->rank, type), inner_(std::move(inner)), ctl_(std::move(ctl)),
      issuer_(c10::intrusive_ptr<c10d::Backend>()), op_(op), seq_(seq), start_(start),
      deadline_(deadline), thread_(static_cast<unsigned long>(pthread_self())) {
  try {
    inner_fut_ = inner_->getFuture();
  } catch (const std::exception&) {
    inner_fut_.reset();  // gloo send/recv, a stream marker: "getFuture not implemented"
  }
  // Our future is made when asked for (DDP's reducer, Python's get_future()), not for a plain
  // wait(): most ops never need one. A posted op's (no inner future) is made now.
  if (!inner_fut_ && !ctl_->polled) fut_ = make_future();
}

c10::intrusive_ptr<c10::ivalue::Future> WatchedWork::make_future() const {
  if (inner_fut_) return c10::make_intrusive<c10::ivalue::Future>(inner_fut_->elementType(), inner_fut_->devices());
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
}

void WatchedWork::complete_future(const c10::intrusive_ptr<c10::ivalue::Future>& fut, std::exception_ptr error) {
  if (error) {
    fut->setErrorIfNeeded(error);
    return;
  }
  if (fut->completed()) return;
  if (inner_fut_ && inner_fut_->completed() && !inner_fut_->hasError()) {
    fut->markCompleted(inner_fut_->value(), inner_fut_->storages());
    return;
  }
  try {
    fut->markCompleted(c10::IValue(inner_->result()));
  } catch (const std::exception&) {
    fut->markCompleted(c10::IValue(std::vector<at::Tensor>()));
  }
}

WatchedWork::~WatchedWork() = default;

void WatchedWork::set_issuer(const c10::intrusive_ptr<WatchedBackend>& backend, std::optional<c10::Device> device) {
  issuer_ = c10::weak_intrusive_ptr<c10d::Backend>(backend);
  device_ = device;
}

void WatchedWork::release_resources() {
  ctl_->untrack(this);
  if (token_) token_->cancel();
  // Nobody can end this op any more: a future that torch's code still waits on must not hang.
  bool done;
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  {
    std::lock_guard<std::mutex> lk(wmu_);
    done = done_;
    fut = fut_;
  }
  if (!done && fut) fut->setErrorIfNeeded(plain_error(std::string(op_) + " #" + std::to_string(seq_) + " was abandoned"));
}

void WatchedWork::arm() {
  auto self = c10::intrusive_ptr<WatchedWork>::reclaim_copy(this);
  c10::weak_intrusive_ptr<WatchedWork> weak(self);
  ctl_->track(self);
  token_ = ctl_->engine->add(deadline_, [weak]() mutable {
    if (auto w = weak.lock()) w->expired();
  });
  if (ctl_->polled) {
    // NCCL: the inner future completes when the op is enqueued (WorkNCCL::getFuture), so it says
    // nothing about the op having run; only the end event does (isCompleted(), polled here and
    // by a waiter). Our future completes then, so that torch's consumers (DDP's backward waits
    // on it) go on only once the op ran, and raise the group's fault when it did not. The inner
    // future is heard only for an error at enqueue.
    if (inner_fut_) {
      inner_fut_->addCallback([weak](c10::ivalue::Future& f) mutable {
        if (!f.hasError()) return;
        if (auto w = weak.lock()) w->inner_done(f.exception_ptr());
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
      budget = std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(gloo_budget(left) * 1000.0)));
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
  return ctl_->fault(info(FaultKind::kRemote, detail, false));
}

FaultInfo WatchedWork::info(FaultKind kind, const std::string& detail, bool waiter) const {
  FaultInfo fi;
  fi.kind = kind;
  fi.op = op_;
  fi.seq = seq_;
  fi.start = nanos_to_seconds(start_);
  fi.deadline = nanos_to_seconds(deadline_);
  fi.detail = detail;
  fi.prev = ctl_->prev_of(seq_);
  fi.waiter = waiter;
  fi.thread = thread_;
  return fi;
}

void WatchedWork::finish_and_unlock(std::exception_ptr error, std::unique_lock<std::mutex>& lk) {
  // Returns with `lk` released: taking it again here would meet the woken waiter on its way out
  // (one more sleep and wake-up on every op's critical path).
  done_ = true;
  error_ = error;
  ctl_->end(seq_, !error                                              ? Outcome::kOk
                  : token_ && token_->state() == State::kExpired ? Outcome::kTimedOut
                                                                 : Outcome::kFailed);
  if (error && !inner_ended_ && !ctl_->polled && !abandoned_) {
    abandoned_ = true;
    abandoned().fetch_add(1);
  }
  auto token = token_;
  auto fut = fut_;  // none yet: getFuture() completes the one it makes
  lk.unlock();
  wcv_.notify_all();
  if (token) token->complete();
  ctl_->untrack(this);
  if (fut) complete_future(fut, error);
}

void WatchedWork::fail(std::exception_ptr error) {
  std::unique_lock<std::mutex> lk(wmu_);
  if (done_) return;
  finish_and_unlock(error, lk);
}

void WatchedWork::inner_done(std::exception_ptr error) {
  std::unique_lock<std::mutex> lk(wmu_);
  inner_ended_ = true;
  if (abandoned_) {
    abandoned_ = false;
    abandoned().fetch_sub(1);
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
    finish_and_unlock(nullptr, lk);
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
  trigger_fault_async(info(FaultKind::kBackend, what_of(error), false));
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
  trigger_fault_async(info(FaultKind::kTimeout, "", false));
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
    // WorkNCCL: isCompleted() queries the end event (and stores an NCCL error it finds, then says
    // true); isSuccess() throws there, so the error is read from exception().
    completed = inner->isCompleted();
    if (completed) err = inner->exception();
    if (completed && !err) {
      // An aborted communicator's ops read as completed, with no error (WorkNCCL::isCompleted
      // skips its error check once the communicator is aborted), whoever aborted it: fastdist
      // (the group says so), or the backend itself. ProcessGroupNCCL's watchdog sets its error
      // on its own copy of the work (workEnqueue copies it), not on this one, then aborts; what
      // this work can still read is the backend's getError().
      std::string why;
      if (ctl_->aborted()) {
        why = "the group's communicators were aborted";
      } else if (auto issuer = issuer_.lock()) {
        static_cast<WatchedBackend*>(issuer.get())->inner_failed(why);
      }
      if (!why.empty()) err = plain_error(std::string(op_) + " #" + std::to_string(seq_) + " was cut short: " + why);
    }
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

c10::intrusive_ptr<c10::ivalue::Future> WatchedWork::getFuture() {
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lk(wmu_);
    if (fut_) return fut_;
    fut_ = make_future();
    if (!done_) return fut_;  // the op's end completes it
    fut = fut_;
    error = error_;
  }
  complete_future(fut, error);
  return fut;
}

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
    std::optional<FaultKind> kind;
    std::string detail;
    if (inner_ended_ && inner_error_) {
      kind = FaultKind::kBackend;
      detail = what_of(inner_error_);
    } else if (now >= deadline_) {
      kind = FaultKind::kTimeout;
    }
    if (kind) {
      lk.unlock();
      auto err = ctl_->fault(info(*kind, detail, true));
      lk.lock();
      if (!done_) finish_and_unlock(err, lk);  // (error_ is set once, before done_)
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
        auto fi = info(FaultKind::kInterrupted, "", false);
        auto ctl = ctl_;
        std::thread([ctl, fi]() { ctl->fault(fi); }).detach();
      }
      lk.lock();
      if (!done_) finish_and_unlock(interrupt, lk);
      std::rethrow_exception(interrupt);
    }
  }
}

}  // namespace fastdist::watched
