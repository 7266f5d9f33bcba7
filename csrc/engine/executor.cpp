#include "executor.h"

#include <cxxabi.h>

#include <cstdio>
#include <exception>
#include <new>

namespace fastdist {

Executor::Executor() : st_(std::make_shared<State>()) {}

Executor::~Executor() { stop(100'000'000); }

void Executor::post(std::vector<Action>&& actions) {
  {
    std::lock_guard<std::mutex> lk(st_->mu);
    if (st_->stop) return;
    for (auto& a : actions) st_->queue.push_back(std::move(a));
    if (st_->queue.empty()) return;
    if (!started_) {
      thread_ = std::thread(&Executor::loop, st_);
      started_ = true;
    }
  }
  st_->cv.notify_one();
}

void Executor::loop(std::shared_ptr<State> st) {
  std::unique_lock<std::mutex> lk(st->mu);
  for (;;) {
    st->cv.wait(lk, [&] { return st->stop || !st->queue.empty(); });
    if (st->stop) break;
    Action action = std::move(st->queue.front());
    st->queue.pop_front();
    st->busy = true;
    lk.unlock();
    try {
      action();
    } catch (abi::__forced_unwind&) {
      // The thread is being ended (pthread_exit: Python ends a thread that wants the GIL once the
      // interpreter is finalizing). That must unwind through here, or the process aborts.
      throw;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fastdist: a deadline action failed: %s\n", e.what());
    } catch (...) {
      std::fprintf(stderr, "fastdist: a deadline action failed\n");
    }
    // Destroy the action (and whatever it captured) before taking the lock again.
    action = nullptr;
    lk.lock();
    st->busy = false;
    ++st->run;
    if (st->queue.empty()) st->idle_cv.notify_all();
  }
  st->exited = true;
  st->idle_cv.notify_all();
}

bool Executor::flush(Nanos max_wait) {
  std::unique_lock<std::mutex> lk(st_->mu);
  auto drained = [&] { return st_->exited || (st_->queue.empty() && !st_->busy); };
  if (max_wait == kNever) {
    st_->idle_cv.wait(lk, drained);
    return true;
  }
  return st_->idle_cv.wait_for(lk, std::chrono::nanoseconds(max_wait), drained);
}

void Executor::stop(Nanos max_wait) {
  std::unique_lock<std::mutex> lk(st_->mu);
  st_->stop = true;
  // Actions that never ran are destroyed outside the lock: destroying a Python action takes the
  // GIL, and a thread holding the GIL may be waiting for this lock (stats(), post()).
  std::deque<Action> dropped;
  dropped.swap(st_->queue);
  st_->cv.notify_all();
  lk.unlock();
  dropped.clear();
  lk.lock();
  if (!started_ || !thread_.joinable()) return;
  if (thread_.get_id() == std::this_thread::get_id()) {
    // The last reference to the engine was dropped by an action: the thread cannot join itself.
    thread_.detach();
    return;
  }
  bool exited = st_->idle_cv.wait_for(lk, std::chrono::nanoseconds(max_wait), [&] { return st_->exited; });
  lk.unlock();
  if (exited) {
    thread_.join();
  } else {
    std::fprintf(stderr, "fastdist: a deadline action is still running at shutdown; leaving it\n");
    thread_.detach();
  }
}

std::uint64_t Executor::actions_run() const {
  std::lock_guard<std::mutex> lk(st_->mu);
  return st_->run;
}

void Executor::lock_for_fork() { st_->mu.lock(); }

void Executor::unlock_after_fork_parent() { st_->mu.unlock(); }

void Executor::reset_after_fork_child() {
  // The thread does not exist in the child. Forget its handle without touching it (joining or
  // destroying a joinable std::thread would be fatal), then rebuild the synchronisation
  // primitives, whose internal waiter counts may name threads that are gone.
  new (&thread_) std::thread();
  started_ = false;
  st_->mu.unlock();
  new (&st_->cv) std::condition_variable();
  new (&st_->idle_cv) std::condition_variable();
  st_->busy = false;
  st_->exited = false;
}

}  // namespace fastdist
