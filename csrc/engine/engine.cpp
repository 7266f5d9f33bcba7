#include "engine.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <new>
#include <set>
#include <stdexcept>
#include <utility>
#include <vector>

namespace fastdist {

namespace {

// Every live engine, so that fork() can take and rebuild their locks. Leaked on purpose: it must
// outlive any engine destroyed during interpreter or static teardown.
std::mutex& registry_mutex() {
  static auto* mu = new std::mutex();
  return *mu;
}

std::set<Engine*>& registry() {
  static auto* engines = new std::set<Engine*>();
  return *engines;
}

void join_or_detach(std::thread& t) {
  if (!t.joinable()) return;
  if (t.get_id() == std::this_thread::get_id()) {
    t.detach();
  } else {
    t.join();
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Token

Token::Token(std::shared_ptr<Engine> engine, Nanos deadline_ns, Action on_expire)
    : deadline(deadline_ns), engine_(std::move(engine)), on_expire_(std::move(on_expire)) {}

Token::~Token() {
  {
    std::lock_guard<std::mutex> lk(engine_->mu_);
    engine_->heap_.erase(this);
  }
  // on_expire_ is destroyed after the lock is released, as the members go.
}

bool Token::finish(State to) {
  if (state() != State::kPending) return false;
  Action doomed;
  {
    std::lock_guard<std::mutex> lk(engine_->mu_);
    if (state() != State::kPending) return false;
    state_.store(static_cast<int>(to), std::memory_order_release);
    engine_->heap_.erase(this);
    doomed = std::move(on_expire_);
    on_expire_ = nullptr;
  }
  engine_->waiters_cv_.notify_all();
  return true;  // `doomed` (and what it captured) is destroyed here, outside the lock
}

bool Token::complete() { return finish(State::kCompleted); }

bool Token::cancel() { return finish(State::kCancelled); }

void Token::work_done() {
  {
    std::lock_guard<std::mutex> lk(engine_->mu_);
    work_done_.store(true, std::memory_order_release);
  }
  // complete() wakes the waiters when it ends the token; otherwise wake them here.
  if (!complete()) engine_->waiters_cv_.notify_all();
}

State Token::wait(Nanos max_wait) {
  auto done = [this] { return state() != State::kPending; };
  if (done()) return state();
  std::unique_lock<std::mutex> lk(engine_->mu_);
  engine_->ensure_started_locked();
  if (max_wait == kNever) {
    engine_->waiters_cv_.wait(lk, done);
  } else {
    engine_->waiters_cv_.wait_for(lk, std::chrono::nanoseconds(max_wait), done);
  }
  return state();
}

// ---------------------------------------------------------------------------------------------
// Engine

std::shared_ptr<Engine> Engine::create(bool fake_clock) {
  static std::once_flag atfork_once;
  std::call_once(atfork_once, [] {
    pthread_atfork(&Engine::prepare_fork, &Engine::parent_after_fork, &Engine::child_after_fork);
  });
  // The constructor is private, so make_shared cannot be used.
  std::shared_ptr<Engine> engine(new Engine(fake_clock));
  std::lock_guard<std::mutex> lk(registry_mutex());
  registry().insert(engine.get());
  return engine;
}

Engine::Engine(bool fake_clock) : clock_(fake_clock) {}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lk(registry_mutex());
    registry().erase(this);
  }
  shutdown(100'000'000);
}

std::shared_ptr<Token> Engine::add(Nanos deadline, Action on_expire) {
  auto token = std::make_shared<Token>(shared_from_this(), deadline, std::move(on_expire));
  if (deadline == kNever) return token;
  bool earliest = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.registered;
    if (stopping_) return token;
    ensure_started_locked();
    token->seq = next_seq_++;
    heap_.push(token.get());
    // A timer thread not waiting (not started yet, or handing actions over) reads the heap
    // before it next waits: only a waiting one needs waking, and a notify then would be a
    // wake-up for nothing (counted in the stats; an idle engine makes none).
    earliest = timer_waiting_ && deadline < timer_wakes_at_;
    if (earliest) timer_wakes_at_ = deadline;
  }
  // Only a deadline earlier than the timer thread's next wake-up changes when it must wake up.
  if (earliest) timer_cv_.notify_one();
  return token;
}

void Engine::ensure_started_locked() {
  if (started_ || stopping_) return;
  started_ = true;
  timer_ = std::thread(&Engine::timer_loop, this);
  executor_.post({});  // restarts the executor after fork() if actions were queued
}

void Engine::timer_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  std::vector<Action> due;
  while (!stopping_) {
    const Nanos now = clock_.now();
    bool any = false;
    while (!heap_.empty() && heap_.top_deadline() <= now) {
      Token* token = heap_.pop();
      token->state_.store(static_cast<int>(State::kExpired), std::memory_order_release);
      if (token->on_expire_) due.push_back(std::move(token->on_expire_));
      token->on_expire_ = nullptr;
      ++stats_.expired;
      any = true;
    }
    if (any) {
      heap_.shrink_if_sparse();
      waiters_cv_.notify_all();
    }
    if (!due.empty()) {
      // Actions run on the executor thread, never here: one that blocks must not delay others.
      in_transit_ = true;
      lk.unlock();
      executor_.post(std::move(due));
      due.clear();
      lk.lock();
      in_transit_ = false;
      waiters_cv_.notify_all();  // flush() waits for this
      continue;  // time moved on while the lock was released
    }
    processed_until_ = now;
    if (clock_.fake()) waiters_cv_.notify_all();  // advance() waits for this
    const Nanos next = heap_.top_deadline();
    timer_wakes_at_ = clock_.fake() ? kNever : next;
    timer_waiting_ = true;
    if (clock_.fake() || next == kNever) {
      timer_cv_.wait(lk);
    } else {
      timer_cv_.wait_until(lk, std::chrono::steady_clock::time_point(std::chrono::nanoseconds(next)));
    }
    timer_waiting_ = false;
    ++stats_.timer_wakeups;
  }
}

void Engine::advance(Nanos delta) {
  if (!clock_.fake()) throw std::logic_error("advance() needs an engine made with fake_clock=True");
  if (delta < 0) throw std::invalid_argument("advance() cannot move the clock backwards");
  std::unique_lock<std::mutex> lk(mu_);
  if (stopping_) {
    clock_.advance(delta);
    return;
  }
  ensure_started_locked();
  const Nanos target = clock_.advance(delta);
  timer_cv_.notify_one();
  waiters_cv_.wait(lk, [&] { return processed_until_ >= target || stopping_; });
}

void Engine::shutdown(Nanos max_wait) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  timer_cv_.notify_all();
  waiters_cv_.notify_all();
  join_or_detach(timer_);
  executor_.stop(max_wait);
}

bool Engine::flush(Nanos max_wait) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(max_wait);
  {
    std::unique_lock<std::mutex> lk(mu_);
    auto handed_over = [this] { return !in_transit_ || stopping_; };
    if (max_wait == kNever) {
      waiters_cv_.wait(lk, handed_over);
    } else if (!waiters_cv_.wait_until(lk, until, handed_over)) {
      return false;
    }
  }
  if (max_wait == kNever) return executor_.flush(kNever);
  const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(until - std::chrono::steady_clock::now());
  return executor_.flush(std::max<Nanos>(0, static_cast<Nanos>(left.count())));
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  EngineStats s = stats_;
  s.pending = heap_.size();
  s.actions_run = executor_.actions_run();
  return s;
}

// fork(): the child gets a copy of memory but only the forking thread. Take every engine's locks
// before fork() so that no lock is copied while held by a thread that will not exist, then in the
// child forget the threads and rebuild the condition variables (their waiter counts may name
// threads that are gone). Threads restart on the next use; pending tokens keep their deadlines.

void Engine::prepare_fork() {
  registry_mutex().lock();
  for (Engine* e : registry()) {
    e->mu_.lock();
    e->executor_.lock_for_fork();
  }
}

void Engine::parent_after_fork() {
  for (Engine* e : registry()) {
    e->executor_.unlock_after_fork_parent();
    e->mu_.unlock();
  }
  registry_mutex().unlock();
}

void Engine::child_after_fork() {
  for (Engine* e : registry()) {
    e->executor_.reset_after_fork_child();
    new (&e->timer_) std::thread();
    e->started_ = false;
    e->in_transit_ = false;  // the timer thread that was handing actions over is gone
    e->timer_waiting_ = false;
    new (&e->timer_cv_) std::condition_variable();
    new (&e->waiters_cv_) std::condition_variable();
    e->mu_.unlock();
  }
  registry_mutex().unlock();
}

std::shared_ptr<Engine> default_engine() {
  static auto* engine = new std::shared_ptr<Engine>(Engine::create(false));
  return *engine;
}

}  // namespace fastdist
