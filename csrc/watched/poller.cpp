// Poller (NCCL-like groups): completes the works nobody waits on, off any Python thread.
#include "internal.h"

#include <c10/core/DeviceGuard.h>

#include <chrono>
#include <thread>

namespace fastdist::watched {

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
    relax_capture_mode();  // its event queries must not break a graph another thread captures
    // 20 us after a work finished or came, backing off to 500 us: a host that waits on a future
    // (DDP's backward) goes on within that of the op's end on the device.
    constexpr auto kMin = std::chrono::microseconds(20);
    constexpr auto kMax = std::chrono::microseconds(500);
    auto interval = kMin;
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
        // The op's device current while its event is queried, as torch's watchdog does (its
        // CUDAGuard): a query with no device set would open a context on GPU 0 in every process
        // of an 8-GPU node.
        c10::OptionalDeviceGuard guard(w->device());
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
      interval = progress ? kMin : std::min(interval * 2, kMax);
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

}  // namespace fastdist::watched
