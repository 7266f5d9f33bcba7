// Signals: Ctrl-C ends the ops of every watched group, and a waiter on the main thread runs
// Python's signal handlers every slice.
#include "internal.h"

#include <Python.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>

#include <cerrno>
#include <mutex>
#include <thread>

namespace fastdist::watched {

namespace {

std::atomic<unsigned long> g_main_thread{0};
struct sigaction g_prev_sigint;
sem_t g_sigint_sem;
// A Ctrl-C that found no op in flight: the main thread may be in C++ (an autograd backward) and
// about to issue one that torch's C++ then waits on, where Python's handler never runs. The next
// op issued on the main thread checks Python's signals first (take_unclaimed_sigint).
std::atomic<bool> g_sigint_unclaimed{false};

void on_sigint(int sig, siginfo_t* info, void* context) {
  const int saved = errno;
  // Python's handler first: it only marks the signal pending. The loop woken below ends the ops
  // in flight, and a main thread that then finds its op ended asks Python whether a signal is
  // pending (to raise the KeyboardInterrupt, not the group's error): it must be already. (Posted
  // first, a handler preempted on another thread let the main thread raise the group's error.)
  if (g_prev_sigint.sa_flags & SA_SIGINFO) {
    if (g_prev_sigint.sa_sigaction != nullptr) g_prev_sigint.sa_sigaction(sig, info, context);
  } else if (g_prev_sigint.sa_handler != SIG_DFL && g_prev_sigint.sa_handler != SIG_IGN) {
    g_prev_sigint.sa_handler(sig);
  }
  sem_post(&g_sigint_sem);  // async-signal-safe
  errno = saved;
}

void interrupt_loop() {
  for (;;) {
    while (sem_wait(&g_sigint_sem) != 0) {
    }
    // Before the scan: an op issued during it is checked at its issue (harmless when Python's
    // handler has run by then: nothing is pending).
    g_sigint_unclaimed.store(true);
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
      fi.kind = FaultKind::kInterrupted;
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

void set_main_thread(unsigned long ident) { g_main_thread.store(ident); }

std::exception_ptr take_unclaimed_sigint() {
  if (!g_sigint_unclaimed.load(std::memory_order_relaxed)) return nullptr;
  if (g_main_thread.load(std::memory_order_relaxed) != static_cast<unsigned long>(pthread_self())) return nullptr;
  g_sigint_unclaimed.store(false);
  return check_signals();  // (nullptr when Python has run its handler already)
}

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

}  // namespace fastdist::watched
