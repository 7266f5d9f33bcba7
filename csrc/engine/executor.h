// A single worker thread that runs deadline actions, so that an action that blocks (an NCCL
// abort can hang) never delays the timer thread and the deadlines behind it.
//
// The thread starts on first use. Its state is shared with the thread itself, so that when a
// running action will not finish (it waits for a lock held by the thread that is shutting the
// engine down, for example the GIL during interpreter exit) the thread can be detached safely.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "clock.h"

namespace fastdist {

using Action = std::function<void()>;

class Executor {
 public:
  Executor();
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Queues actions; they run in order on the executor thread. Posting nothing restarts the
  // thread after fork() if actions are waiting.
  void post(std::vector<Action>&& actions);

  // Waits until every queued action has run; false if `max_wait` passed first.
  bool flush(Nanos max_wait);

  // Stops the thread: queued actions that have not started are dropped. Waits up to `max_wait`
  // for a running action to return, then detaches the thread.
  void stop(Nanos max_wait);

  std::uint64_t actions_run() const;

  // fork() support, called by the engine's pthread_atfork handlers.
  void lock_for_fork();
  void unlock_after_fork_parent();
  void reset_after_fork_child();

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;        // work arrived, or stop requested
    std::condition_variable idle_cv;   // queue drained, or thread exited
    std::deque<Action> queue;
    bool busy = false;
    bool stop = false;
    bool exited = false;
    std::uint64_t run = 0;
  };

  static void loop(std::shared_ptr<State> st);

  std::shared_ptr<State> st_;
  std::thread thread_;
  bool started_ = false;  // guarded by st_->mu
};

}  // namespace fastdist
