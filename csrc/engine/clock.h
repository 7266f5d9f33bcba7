// The engine's one clock: std::steady_clock in production, a fake clock in tests.
//
// Deadlines are absolute nanosecond counts on this clock. A fake clock only moves when a test
// advances it, so engine tests run in milliseconds and never depend on the scheduler.
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>

namespace fastdist {

using Nanos = std::int64_t;

// A deadline that never passes. Tokens with it are never put in the heap.
constexpr Nanos kNever = std::numeric_limits<Nanos>::max();

inline Nanos steady_now() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Seconds (as given from Python) to nanoseconds, clamped so that +inf and huge values become
// kNever instead of overflowing. NaN is refused at the API edge and never reaches here.
inline Nanos seconds_to_nanos(double seconds) {
  constexpr double kMax = static_cast<double>(kNever) / 1e9;
  if (!(seconds < kMax)) return kNever;
  if (seconds <= -kMax) return -kNever;
  return static_cast<Nanos>(std::llround(seconds * 1e9));
}

inline double nanos_to_seconds(Nanos n) {
  if (n == kNever) return std::numeric_limits<double>::infinity();
  return static_cast<double>(n) / 1e9;
}

class Clock {
 public:
  explicit Clock(bool fake) : fake_(fake) {}

  bool fake() const { return fake_; }

  Nanos now() const {
    return fake_ ? fake_now_.load(std::memory_order_acquire) : steady_now();
  }

  // Only meaningful for a fake clock; returns the new time.
  Nanos advance(Nanos delta) {
    return fake_now_.fetch_add(delta, std::memory_order_acq_rel) + delta;
  }

 private:
  const bool fake_;
  std::atomic<Nanos> fake_now_{0};
};

}  // namespace fastdist
