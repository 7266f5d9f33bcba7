// Deadline scopes: fail_after/fail_at scopes as C++ sees them, per thread and process-wide.
#include "internal.h"

#include <Python.h>

#include <mutex>
#include <set>

namespace fastdist::watched {

namespace {

thread_local std::vector<Nanos> t_scopes;  // effective deadlines, innermost last
thread_local Nanos t_next = kNever;
thread_local Nanos t_next_start = 0;  // when fastdist's call began (0: not given)
thread_local bool t_has_next = false;

std::mutex& open_mu() {
  static auto* mu = new std::mutex();
  return *mu;
}
std::multiset<Nanos>& open_scopes() {
  static auto* s = new std::multiset<Nanos>();
  return *s;
}
std::atomic<int> g_open{0};

}  // namespace

void push_scope(Nanos deadline) {
  const Nanos eff = t_scopes.empty() ? deadline : std::min(deadline, t_scopes.back());
  t_scopes.push_back(eff);
  std::lock_guard<std::mutex> lk(open_mu());
  open_scopes().insert(eff);
  g_open.fetch_add(1, std::memory_order_release);
}

void pop_scope() {
  if (t_scopes.empty()) return;
  const Nanos eff = t_scopes.back();
  t_scopes.pop_back();
  std::lock_guard<std::mutex> lk(open_mu());
  auto it = open_scopes().find(eff);
  if (it != open_scopes().end()) open_scopes().erase(it);
  g_open.fetch_sub(1, std::memory_order_release);
}

void set_next_deadline(Nanos deadline, Nanos start) {
  t_next = deadline;
  t_next_start = start;
  t_has_next = true;
}

Nanos next_start() { return t_has_next ? t_next_start : 0; }

void clear_next_deadline() { t_has_next = false; }

Nanos scope_deadline() {
  if (!t_scopes.empty()) return t_scopes.back();
  if (g_open.load(std::memory_order_acquire) == 0) return kNever;
  // A thread that never ran Python (autograd's device threads, which run DDP's and FSDP's hooks
  // for GPU tensors) issues ops on behalf of code blocked elsewhere: the soonest scope open in
  // the process bounds them. A Python thread outside any scope is not bound by others' scopes.
  if (PyGILState_GetThisThreadState() != nullptr) return kNever;
  std::lock_guard<std::mutex> lk(open_mu());
  return open_scopes().empty() ? kNever : *open_scopes().begin();
}

bool has_next_deadline() { return t_has_next; }

bool take_next_deadline(Nanos& out) {
  if (!t_has_next) return false;
  t_has_next = false;
  out = t_next;
  return true;
}

}  // namespace fastdist::watched
