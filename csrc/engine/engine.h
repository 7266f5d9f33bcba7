// The deadline engine: tokens with absolute deadlines, one timer thread, one action thread.
//
// A Token is created with a deadline and an optional action. It ends in exactly one of three
// ways: complete() (the guarded work finished), cancel(), or expiry (the timer thread found its
// deadline passed). Expiry wakes every waiter and hands the action to the executor thread; the
// action never runs on the timer thread, because an action may block (an abort can hang) and must
// not delay other deadlines.
//
// The timer thread sleeps until the earliest deadline and is woken only when a new entry becomes
// the earliest: an idle engine makes no wake-ups at all. Dropping the last reference to a pending
// token removes its heap entry; its action does not run.
//
// Nothing here knows about Python; the bindings convert arguments and release the GIL around the
// blocking calls. Lock order, everywhere (fork preparation included): the GIL (held by callers
// from Python), then the engine mutex, then the executor mutex. No code waits for the GIL while
// holding either mutex: actions (which may be Python callables, whose call and destruction take
// the GIL) are run and destroyed with no engine or executor lock held.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>

#include "clock.h"
#include "deadline_heap.h"
#include "executor.h"

namespace fastdist {

enum class State : int { kPending = 0, kCompleted = 1, kExpired = 2, kCancelled = 3 };

class Engine;

class Token {
 public:
  Token(std::shared_ptr<Engine> engine, Nanos deadline, Action on_expire);
  ~Token();
  Token(const Token&) = delete;
  Token& operator=(const Token&) = delete;

  State state() const { return static_cast<State>(state_.load(std::memory_order_acquire)); }
  Engine& engine() const { return *engine_; }

  // Each returns true if this call ended the token (it was pending).
  bool complete();
  bool cancel();

  // For a done-callback of the guarded work: completes the token if still pending and records
  // that the work ended, even when the token had already expired.
  void work_done();
  bool is_work_done() const { return work_done_.load(std::memory_order_acquire); }

  // Blocks until the token is no longer pending or `max_wait` (real time) passed; returns the
  // state, which is kPending only if `max_wait` ran out.
  State wait(Nanos max_wait);

  // Heap bookkeeping, guarded by the engine mutex.
  const Nanos deadline;
  std::uint64_t seq = 0;
  std::size_t heap_index = kNotInHeap;

 private:
  friend class Engine;
  bool finish(State to);

  std::shared_ptr<Engine> engine_;
  std::atomic<int> state_{static_cast<int>(State::kPending)};
  std::atomic<bool> work_done_{false};
  Action on_expire_;  // guarded by the engine mutex
};

struct EngineStats {
  std::uint64_t registered = 0;
  std::uint64_t expired = 0;
  std::uint64_t timer_wakeups = 0;
  std::uint64_t actions_run = 0;
  std::size_t pending = 0;
};

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  static std::shared_ptr<Engine> create(bool fake_clock);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  Nanos now() const { return clock_.now(); }
  bool fake_clock() const { return clock_.fake(); }

  // A token that expires at `deadline` (engine clock) unless completed or cancelled first.
  // kNever gives a token that only ends by complete() or cancel().
  std::shared_ptr<Token> add(Nanos deadline, Action on_expire);

  // Fake clock only: moves time forward and returns once the timer thread has expired every
  // token due by the new time and queued their actions.
  void advance(Nanos delta);

  // Waits until the action of every token expired so far has run; false if `max_wait` passed
  // first. (An action is in transit from the timer thread to the executor for a moment after its
  // token is marked expired: a waiter that saw the expiry and then flushes waits for it too.)
  bool flush(Nanos max_wait);

  // Stops both threads. Pending tokens stay pending and never expire; tokens still work as
  // plain completion flags. Used at interpreter exit.
  void shutdown(Nanos max_wait);

  EngineStats stats() const;

 private:
  friend class Token;
  explicit Engine(bool fake_clock);

  void ensure_started_locked();
  void timer_loop();
  void remove_locked(Token* token);

  // fork() support: see engine.cpp.
  static void prepare_fork();
  static void parent_after_fork();
  static void child_after_fork();

  Clock clock_;
  mutable std::mutex mu_;
  std::condition_variable timer_cv_;    // wakes the timer thread
  std::condition_variable waiters_cv_;  // wakes token waiters and advance()
  DeadlineHeap<Token> heap_;
  std::uint64_t next_seq_ = 0;
  Nanos processed_until_ = -kNever;  // the time up to which the timer thread has expired tokens
  // When the timer thread will next wake up by itself (kNever: only when notified). A new token
  // notifies it only if its deadline is earlier than this.
  Nanos timer_wakes_at_ = kNever;
  bool started_ = false;
  bool stopping_ = false;
  bool in_transit_ = false;  // the timer thread is handing expired tokens' actions to the executor
  bool timer_waiting_ = false;  // the timer thread is in its wait (under mu_: add() knows)
  std::thread timer_;
  Executor executor_;
  EngineStats stats_;
};

// The process-wide engine on the steady clock. Created on first call, never destroyed (so that
// interpreter exit never waits on it); starts no thread until the first token is added.
std::shared_ptr<Engine> default_engine();

}  // namespace fastdist
