// A timeout's report made in C++ when Python cannot run at the deadline (see NativeReport), and
// its ring, made here as soon as Python can.
#include "internal.h"

#include <chrono>
#include <cstdio>
#include <thread>

namespace fastdist::watched {

bool GilProbe::enter() {
  std::lock_guard<std::mutex> lk(mu_);
  entered_ = true;
  cv_.notify_all();
  return native_;
}

bool GilProbe::expire(Nanos wait) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_for(lk, std::chrono::nanoseconds(wait), [&] { return entered_; });
  if (entered_) return false;
  native_ = true;
  return true;
}

void GroupCtl::set_native_report(std::shared_ptr<const NativeReport> report) {
  std::lock_guard<std::mutex> lk(mu_);
  native_ = std::move(report);
}

bool GroupCtl::native_posted(std::int64_t generation) {
  std::lock_guard<std::mutex> lk(mu_);
  return native_ && native_->generation == generation && native_->posted.load();
}

namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

// fastdist.store.board's status record and ring's fault record; "gil": true when made
// because Python could not run.
struct Records {
  std::string status, ring;
};

Records records(const NativeReport& r, const FaultInfo& info, bool gil) {
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  char t[32];
  std::snprintf(t, sizeof t, "%.6f", now);
  const std::string what = "\"op\": " + json_string(info.op) + ", \"seq\": " + std::to_string(info.seq) +
                           ", \"state\": \"timed_out\", \"t\": " + t + (gil ? ", \"gil\": true" : "");
  return {sealed(r.secret, "{\"rank\": " + std::to_string(r.rank) + ", " + what + ", \"waits\": []}"),
          sealed(r.secret, "{\"kind\": \"fault\", \"group\": " + json_string(r.group) +
                               ", \"gen\": " + std::to_string(r.generation) + ", \"root\": " + std::to_string(r.rank) +
                               ", \"rank\": " + std::to_string(r.global_rank) + ", " + what + "}")};
}

// Claims the group's fault for this rank; the first claim rings this rank's children (as
// board.report does).
void claim_and_ring(const NativeReport& r, const Records& rec) {
  auto& store = *r.store;
  if (store.compareSet(r.fault_key, {}, bytes_of(rec.status)) == bytes_of(rec.status)) {
    for (const auto& inbox : r.inboxes) store.queuePush(inbox, bytes_of(rec.ring));
  }
}

void report(const NativeReport& r, const FaultInfo& info) {
  const Records rec = records(r, info, true);
  auto& store = *r.store;
  try {
    claim_and_ring(r, rec);
    r.posted.store(true);
    store.append(r.status_key, bytes_of(rec.status + "\n"));
    store.add(r.count_key, 1);
  } catch (const std::exception& e) {
    // The store is gone or cut off: the others find out at their own deadlines (Python says why
    // once it runs).
    std::fprintf(stderr, "fastdist: rank %d could not report %s #%llu from C++: %s\n", r.global_rank,
                 info.op.c_str(), static_cast<unsigned long long>(info.seq), e.what());
  }
}

// Python got the GIL and builds the error (the group marked dead, the report's record): the ring
// goes out now, from here, rather than after those steps and a hand-over to the report's store
// thread (about 1.2 ms of a 5 ms propagation on a 2-core machine, bench/test_propagation.py).
// board.report finds the claim its own and does not ring again.
void ring_early(const NativeReport& r, const FaultInfo& info) {
  try {
    claim_and_ring(r, records(r, info, false));
  } catch (const std::exception&) {
    // The store failed: Python's report claims and rings itself, and says why if it fails too.
  }
}

}  // namespace

std::shared_ptr<GilProbe> GroupCtl::probe_gil(const FaultInfo& info) {
  std::shared_ptr<const NativeReport> r;
  {
    std::lock_guard<std::mutex> lk(mu_);
    r = native_;
  }
  if (!r || r->posted.load()) return nullptr;
  auto probe = std::make_shared<GilProbe>();
  std::thread([probe, r, info]() {
    if (probe->expire(kGilWait)) {
      report(*r, info);
    } else {
      ring_early(*r, info);
    }
  }).detach();
  return probe;
}

}  // namespace fastdist::watched
