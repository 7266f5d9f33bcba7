// GroupCtl: a watched group's state (op numbers, history, dead or alive, ops in flight), the fault
// builder and the cross-rank checks.
#include "internal.h"

#include <algorithm>
#include <unordered_set>

namespace fastdist::watched {

FaultBuilder& builder() {
  static auto* b = new FaultBuilder();
  return *b;
}

void set_fault_builder(FaultBuilder b) { builder() = std::move(b); }

namespace {
std::atomic<bool> g_checks{false};
}  // namespace

CheckHook& check_hook() {
  static auto* h = new CheckHook();
  return *h;
}

// "dtype[d0,d1,...]" of each input: what the ranks of one op must agree on.
std::string signature_of(c10::ArrayRef<at::Tensor> ins) {
  std::string sig;
  for (const auto& t : ins) {
    if (!sig.empty()) sig += ", ";
    if (!t.defined()) {
      sig += "undefined";
      continue;
    }
    sig += c10::toString(t.scalar_type());
    sig += "[";
    for (int64_t d = 0; d < t.dim(); ++d) {
      if (d > 0) sig += ",";
      sig += std::to_string(t.size(d));
    }
    sig += "]";
  }
  return sig;
}

void set_check_hook(CheckHook hook) { check_hook() = std::move(hook); }
void set_checks_enabled(bool on) { g_checks.store(on, std::memory_order_relaxed); }

bool checks_enabled() { return g_checks.load(std::memory_order_relaxed); }

namespace {
std::atomic<bool> g_history{true};
}  // namespace

void set_history_enabled(bool on) { g_history.store(on, std::memory_order_relaxed); }

std::uint64_t GroupCtl::begin(const char* op, Nanos start, c10::ArrayRef<at::Tensor> ins) {
  OpRecord rec;
  rec.op = op;
  const bool details = g_history.load(std::memory_order_relaxed);
  if (details) {
    rec.thread = static_cast<unsigned long>(pthread_self());
    rec.start = start;
    rec.tensors = static_cast<std::uint32_t>(ins.size());
  }
  if (details && !ins.empty() && ins[0].defined()) {
    rec.dtype = static_cast<std::int8_t>(ins[0].scalar_type());
    rec.ndim = static_cast<std::uint8_t>(std::min<std::int64_t>(ins[0].dim(), OpRecord::kDims));
    for (std::uint8_t d = 0; d < rec.ndim; ++d) rec.shape[d] = ins[0].size(d);
  }
  std::lock_guard<std::mutex> lk(mu_);
  const std::uint64_t s = ++seq_;
  rec.seq = s;
  ring_[s % kRing] = rec;
  return s;
}

void GroupCtl::end(std::uint64_t seq, Outcome outcome) {
  if (!g_history.load(std::memory_order_relaxed)) return;
  const Nanos now = steady_now();
  std::lock_guard<std::mutex> lk(mu_);
  OpRecord& rec = ring_[seq % kRing];
  if (rec.seq == seq && rec.outcome == Outcome::kPending) {
    rec.end = now;
    rec.outcome = outcome;
  }
}

std::vector<OpRecord> GroupCtl::history() {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<OpRecord> out;
  const std::uint64_t first = seq_ >= kRing ? seq_ - kRing + 1 : 1;
  for (std::uint64_t s = first; s <= seq_; ++s) {
    if (ring_[s % kRing].seq == s) out.push_back(ring_[s % kRing]);
  }
  return out;
}

std::string GroupCtl::prev_of(std::uint64_t seq) {
  std::lock_guard<std::mutex> lk(mu_);
  const std::uint64_t prev = seq - 1;
  if (seq < 2 || prev + kRing <= seq_ || ring_[prev % kRing].seq != prev) return "";
  return std::string(ring_[prev % kRing].op) + " #" + std::to_string(prev);
}

void GroupCtl::rollback(std::uint64_t seq) {
  std::lock_guard<std::mutex> lk(mu_);
  if (seq_ == seq) {
    ring_[seq % kRing] = OpRecord{};
    --seq_;
  }
}

std::uint64_t GroupCtl::seq() {
  std::lock_guard<std::mutex> lk(mu_);
  return seq_;
}

bool GroupCtl::dead() {
  std::lock_guard<std::mutex> lk(mu_);
  return dead_;
}

std::string GroupCtl::dead_reason() {
  std::lock_guard<std::mutex> lk(mu_);
  return dead_reason_;
}

bool GroupCtl::mark_dead(const std::string& reason) {
  std::lock_guard<std::mutex> lk(mu_);
  if (dead_) return false;
  dead_ = true;
  dead_reason_ = reason;
  return true;
}

bool GroupCtl::settle_dead(const std::string& reason, bool replace) {
  std::lock_guard<std::mutex> lk(mu_);
  const bool first = !settled_;
  if (first || replace) {
    dead_ = true;
    settled_ = true;
    dead_reason_ = reason;
  }
  return first;
}

std::string GroupCtl::settled_reason() {
  std::lock_guard<std::mutex> lk(mu_);
  return settled_ ? dead_reason_ : std::string();
}

const char* intern(const std::string& op) {
  static auto* mu = new std::mutex();
  static auto* names = new std::unordered_set<std::string>();  // leaked: used until exit
  std::lock_guard<std::mutex> lk(*mu);
  return names->insert(op).first->c_str();
}

void GroupCtl::revive() {
  std::exception_ptr old;
  {
    std::lock_guard<std::mutex> lk(mu_);
    dead_ = false;
    aborted_.store(false);
    settled_ = false;
    dead_reason_.clear();
    // Every member starts the new generation at op 1, in step again.
    seq_ = 0;
    std::fill(std::begin(ring_), std::end(ring_), OpRecord{});
    fault_state_ = 0;
    old = std::move(fault_error_);
    fault_error_ = nullptr;
    inflight_.clear();
  }
}

std::exception_ptr GroupCtl::fault(const FaultInfo& info) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!dead_) {
    dead_ = true;
    dead_reason_ = info.op + " #" + std::to_string(info.seq) + " " +
                   (info.kind == FaultKind::kTimeout       ? "timed out"
                    : info.kind == FaultKind::kInterrupted ? "was interrupted"
                    : info.kind == FaultKind::kRemote      ? "ended by a peer's fault"
                                                 : "failed") +
                   " on rank " + std::to_string(rank);
  }
  if (fault_state_ == 2) return fault_error_;
  if (fault_state_ == 1) {
    cv_.wait(lk, [&] { return fault_state_ == 2; });
    return fault_error_;
  }
  fault_state_ = 1;
  lk.unlock();
  std::exception_ptr err;
  if (info.kind == FaultKind::kTimeout && !info.probe) {
    FaultInfo probed = info;
    probed.probe = probe_gil(info);
    if (builder()) err = builder()(id(), probed);
  } else if (builder()) {
    err = builder()(id(), info);
  }
  if (!err) err = plain_error(info.op + " #" + std::to_string(info.seq) + " on group '" + name + "' " +
                         fault_kind_name(info.kind));
  lk.lock();
  fault_error_ = err;
  fault_state_ = 2;
  lk.unlock();
  cv_.notify_all();
  for (auto& w : inflight()) w->fail(err);
  return err;
}

std::exception_ptr GroupCtl::refusal(const char* op) {
  FaultInfo info;
  info.kind = FaultKind::kRefused;
  info.op = op;
  info.detail = dead_reason();
  if (builder()) {
    auto err = builder()(id(), info);
    if (err) return err;
  }
  return plain_error(std::string(op) + " on group '" + name + "': the group is aborted (" + info.detail + ")");
}

const char* fault_kind_name(FaultKind kind) {
  switch (kind) {
    case FaultKind::kTimeout:
      return "timeout";
    case FaultKind::kBackend:
      return "backend";
    case FaultKind::kInterrupted:
      return "interrupted";
    case FaultKind::kRefused:
      return "refused";
    case FaultKind::kRemote:
      return "remote";
  }
  return "?";
}

bool GroupCtl::fail_remote(const std::string& detail, const std::string& reason) {
  c10::intrusive_ptr<WatchedWork> oldest;
  for (auto& w : inflight()) {
    if (!w->ended() && (!oldest || w->op_seq() < oldest->op_seq())) oldest = w;
  }
  if (!oldest) {
    mark_dead(reason);
    return false;
  }
  oldest->fail_remote(detail);
  return true;
}

void GroupCtl::track(const c10::intrusive_ptr<WatchedWork>& w) {
  std::lock_guard<std::mutex> lk(mu_);
  inflight_.emplace(w.get(), c10::weak_intrusive_ptr<WatchedWork>(w));
}

void GroupCtl::untrack(WatchedWork* w) {
  std::lock_guard<std::mutex> lk(mu_);
  inflight_.erase(w);
}

std::vector<c10::intrusive_ptr<WatchedWork>> GroupCtl::inflight() {
  std::vector<c10::intrusive_ptr<WatchedWork>> out;
  std::lock_guard<std::mutex> lk(mu_);
  out.reserve(inflight_.size());
  for (auto& entry : inflight_) {
    auto strong = entry.second.lock();  // null for a work whose last reference is being dropped
    if (strong) out.push_back(std::move(strong));
  }
  return out;
}

}  // namespace fastdist::watched
