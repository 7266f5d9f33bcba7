// A multi-thread stress test of the deadline engine, built with ThreadSanitizer and with
// AddressSanitizer + UndefinedBehaviorSanitizer by scripts/sanitize (run by `make check`).
//
// Threads add tokens with near deadlines and actions, then cancel, complete, wait on or drop
// them at random, while others read stats(), flush the executor and wait; one thread forks a child
// that uses the engine it inherited; at the end the engine is shut down with tokens pending.
// Every token must end exactly once, every action of an expired token must run exactly once (and
// none of a token that did not expire), and the counts must add up.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "../engine/engine.h"

using fastdist::Engine;
using fastdist::Nanos;
using fastdist::State;
using fastdist::Token;

namespace {

constexpr Nanos kMs = 1'000'000;

int g_failures = 0;

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "stress: FAILED: %s\n", what);
    ++g_failures;
  }
}

struct Counts {
  std::atomic<long> added{0}, completed{0}, cancelled{0}, expired{0}, actions{0}, dropped{0};
};

void worker(const std::shared_ptr<Engine>& engine, Counts& c, unsigned seed, int rounds) {
  std::mt19937 rng(seed);
  std::vector<std::pair<std::shared_ptr<Token>, std::shared_ptr<std::atomic<int>>>> live;
  for (int i = 0; i < rounds; ++i) {
    auto ran = std::make_shared<std::atomic<int>>(0);
    const Nanos deadline = engine->now() + static_cast<Nanos>(rng() % 3) * kMs;
    live.emplace_back(engine->add(deadline, [ran, &c] {
      ran->fetch_add(1);
      c.actions.fetch_add(1);
    }), ran);
    c.added.fetch_add(1);
    if (live.size() < 16) continue;
    auto [token, action_ran] = live.back();
    live.pop_back();
    switch (rng() % 5) {
      case 0:
        if (token->complete()) c.completed.fetch_add(1);
        break;
      case 1:
        if (token->cancel()) c.cancelled.fetch_add(1);
        break;
      case 2:
        token->wait(5 * kMs);
        break;
      case 3:
        token->work_done();  // a done-callback: completes it if still pending
        break;
      default:
        c.dropped.fetch_add(1);  // dropped while pending: its action must not run
        break;
    }
    const State s = token->state();
    if (s == State::kCompleted || s == State::kCancelled) {
      check(action_ran->load() == 0, "an action ran for a token that did not expire");
    }
  }
  for (auto& [token, action_ran] : live) token->wait(50 * kMs);
  for (auto& [token, action_ran] : live) {
    check(token->state() == State::kExpired, "a token with a deadline a few ms away never expired");
  }
}

int run_child(const std::shared_ptr<Engine>& engine) {
  // The child inherited the engine with its threads gone: it must work again at once.
  auto ran = std::make_shared<std::atomic<int>>(0);
  auto token = engine->add(engine->now() + 2 * kMs, [ran] { ran->fetch_add(1); });
  const State s = token->wait(2000 * kMs);
  engine->flush(2000 * kMs);
  if (s != State::kExpired) return 3;
  return ran->load() == 1 ? 0 : 4;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 8;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 3000;
  auto engine = Engine::create(false);
  Counts c;
  std::atomic<bool> done{false};

  std::thread reader([&] {  // stats, flushes and waits, all the time
    while (!done.load()) {
      const auto st = engine->stats();
      check(st.expired <= st.registered, "more tokens expired than were registered");
      engine->flush(1 * kMs);
      std::this_thread::yield();
    }
  });
  std::atomic<int> forks{0};
  std::thread forker([&] {
    for (int i = 0; i < 3 && !done.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      const pid_t pid = fork();
      if (pid == 0) _exit(run_child(engine));
      int status = 0;
      waitpid(pid, &status, 0);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        std::fprintf(stderr, "stress: child status %d (exit %d, signal %d)\n", status,
                     WIFEXITED(status) ? WEXITSTATUS(status) : -1, WIFSIGNALED(status) ? WTERMSIG(status) : -1);
      }
      check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the forked child could not use the engine");
      forks.fetch_add(1);
    }
  });

  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back(worker, std::cref(engine), std::ref(c), 1234u + static_cast<unsigned>(t), rounds);
  }
  for (auto& w : workers) w.join();
  done.store(true);
  reader.join();
  forker.join();

  check(forks.load() > 0, "no fork happened while the workers ran (give them more rounds)");
  check(engine->flush(2000 * kMs), "the executor did not drain");
  const auto st = engine->stats();
  check(st.registered == static_cast<std::uint64_t>(c.added.load()), "registered != added");
  check(st.expired == static_cast<std::uint64_t>(c.actions.load()), "actions run != tokens expired");
  check(st.pending == 0, "tokens left in the heap");

  // Shut down with tokens pending: they stay pending, their actions never run, nothing hangs.
  auto late = engine->add(engine->now() + 60'000 * kMs, [] { std::abort(); });
  engine->shutdown(1000 * kMs);
  check(late->state() == State::kPending, "a pending token changed state at shutdown");
  check(late->complete(), "a token could not be completed after shutdown");

  std::printf("stress: %d threads x %d rounds: %ld added, %ld completed, %ld cancelled, %ld dropped, "
              "%llu expired, %d forks; %d failures\n",
              threads, rounds, c.added.load(), c.completed.load(), c.cancelled.load(), c.dropped.load(),
              static_cast<unsigned long long>(st.expired), forks.load(), g_failures);
  return g_failures == 0 ? 0 : 1;
}
