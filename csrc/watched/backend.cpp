// WatchedBackend: the c10d Backend that wraps a group's own and watches each of its ops, and the
// registry of every watched backend.
#include "internal.h"

#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace fastdist::watched {

double gloo_budget(double budget) { return budget + std::min(1.0, std::max(0.1, 0.1 * budget)); }


namespace {

std::mutex& backends_mu() {
  static auto* mu = new std::mutex();
  return *mu;
}
std::vector<c10::weak_intrusive_ptr<WatchedBackend>>& backends() {
  static auto* v = new std::vector<c10::weak_intrusive_ptr<WatchedBackend>>();
  return *v;
}

// Lets go of the backends recovery replaced, one at a time, on one thread of its own: their
// destructors may join threads that sleep or wait for a peer (watched.h, swap_inner). One thread
// for the process, not one per recovery, so that a job's thread count does not grow with its faults.
struct Reaper {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<c10::intrusive_ptr<c10d::Backend>> queue;
  bool started = false;

  void add(c10::intrusive_ptr<c10d::Backend> old) {
    {
      std::lock_guard<std::mutex> lk(mu);
      queue.push_back(std::move(old));
      if (!started) {
        started = true;
        std::thread([this] { loop(); }).detach();
      }
    }
    cv.notify_one();
  }

  void loop() {
    for (;;) {
      std::vector<c10::intrusive_ptr<c10d::Backend>> batch;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return !queue.empty(); });
        batch.swap(queue);
      }
      batch.clear();  // the destructors run here, outside the lock
    }
  }
};

Reaper& reaper() {
  static auto* r = new Reaper();  // leaked: its thread outlives static destruction
  return *r;
}

}  // namespace

std::vector<c10::intrusive_ptr<WatchedBackend>> live_backends() {
  std::vector<c10::intrusive_ptr<WatchedBackend>> out;
  std::lock_guard<std::mutex> lk(backends_mu());
  auto& v = backends();
  v.erase(std::remove_if(v.begin(), v.end(), [&](auto& w) {
            auto strong = w.lock();
            if (!strong) return true;
            out.push_back(std::move(strong));
            return false;
          }),
          v.end());
  return out;
}

void keep_dead_backends() {
  static auto* kept = new std::vector<c10::intrusive_ptr<c10d::Backend>>();  // never freed
  for (auto& b : live_backends()) {
    if (b->ctl()->dead()) kept->push_back(b->inner());
  }
}

// ---------------------------------------------------------------------------------------------
// WatchedBackend

WatchedBackend::WatchedBackend(c10::intrusive_ptr<c10d::Backend> inner, std::shared_ptr<GroupCtl> ctl,
                               StreamMarkerFn marker)
    : c10d::Backend(inner->getRank(), inner->getSize()), inner_(std::move(inner)), ctl_(std::move(ctl)),
      marker_(marker) {
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 3
  setBoundDeviceId(inner_->getBoundDeviceId());
#endif
}

void register_backend(const c10::intrusive_ptr<WatchedBackend>& b) {
  std::lock_guard<std::mutex> lk(backends_mu());
  backends().emplace_back(b);
}

c10::intrusive_ptr<c10d::Backend> WatchedBackend::inner() {
  std::lock_guard<std::mutex> lk(inner_mu_);
  return inner_;
}

void WatchedBackend::swap_inner(c10::intrusive_ptr<c10d::Backend> fresh) {
  TORCH_CHECK(fresh->getRank() == getRank() && fresh->getSize() == getSize(),
              "fastdist: a group rebuilt in place keeps its rank and size");
  {
    std::lock_guard<std::mutex> lk(inner_mu_);
    inner_.swap(fresh);
  }
  ctl_->revive();
  // `fresh` now holds the old backend. Its destructor may join threads that sleep or wait for a
  // peer (see watched.h): it runs on a thread of its own, never on recover()'s.
  reaper().add(std::move(fresh));
}

bool WatchedBackend::inner_failed(std::string& why) {
  c10d::ErrorType error = c10d::ErrorType::SUCCESS;
  {
    std::lock_guard<std::mutex> lk(inner_mu_);  // not copied out: the last reference stays here
    try {
      error = inner_->getError();
    } catch (const std::exception&) {
      return false;  // torch before 2.14: a backend without getError() throws (gloo)
    }
  }
  switch (error) {
    case c10d::ErrorType::SUCCESS:
      return false;
    case c10d::ErrorType::TIMEOUT:
      why = "the backend's own watchdog timed it out (the group's timeout) and aborted the communicator";
      break;
    case c10d::ErrorType::COMM_ERROR:
      why = "the backend met a communicator error and aborted the communicator";
      break;
    default:
      why = "the backend reports a peer's error and aborted the communicator";
      break;
  }
  return true;
}

c10d::ErrorType WatchedBackend::getError() {
  std::lock_guard<std::mutex> lk(inner_mu_);
  return inner_->getError();
}

Nanos WatchedBackend::deadline_for(Nanos now) {
  Nanos d;
  if (take_next_deadline(d)) return d;
  d = scope_deadline();
  const Nanos dflt = ctl_->default_timeout.load(std::memory_order_relaxed);
  if (dflt != kNever && dflt < kNever - now) d = std::min(d, now + dflt);
  return d;
}

void WatchedBackend::refuse_if_dead(const char* op) {
  if (ctl_->dead()) {
    Nanos unused;
    take_next_deadline(unused);
    std::rethrow_exception(ctl_->refusal(op));
  }
}

c10::intrusive_ptr<c10d::Work> WatchedBackend::watch(const char* op, c10d::OpType type, std::uint64_t seq, Nanos start,
                                                     Nanos deadline, c10::intrusive_ptr<c10d::Work> inner,
                                                     c10::ArrayRef<at::Tensor> ins) {
  auto w = c10::make_intrusive<WatchedWork>(std::move(inner), ctl_, op, seq, start, deadline, type);
  if (ctl_->polled) w->set_issuer(c10::intrusive_ptr<WatchedBackend>::reclaim_copy(this), device_of(ins, getBoundDeviceId()));
  w->arm();
  return w;
}

// The op numbered `seq` failed on this rank before it was issued, or as it was: the group's
// fault, raised on this thread (the others are told, as for a failed work).
std::exception_ptr WatchedBackend::fault_at_issue(FaultKind kind, const char* op, std::uint64_t seq, Nanos start,
                                                  Nanos deadline, std::string detail) {
  FaultInfo fi;
  fi.kind = kind;
  fi.op = op;
  fi.seq = seq;
  fi.start = nanos_to_seconds(start);
  fi.deadline = nanos_to_seconds(deadline);
  fi.detail = std::move(detail);
  fi.prev = ctl_->prev_of(seq);
  fi.waiter = true;
  return ctl_->fault(fi);
}

template <typename Opts, typename Issue>
c10::intrusive_ptr<c10d::Work> WatchedBackend::run(const char* op, c10d::OpType type, const Opts& opts, Issue&& issue,
                                                   c10::ArrayRef<at::Tensor> ins) {
  refuse_if_dead(op);
  if (auto interrupt = take_unclaimed_sigint()) {
    // Ctrl-C came while this thread was in C++ before the op (an autograd backward): raised
    // here, rather than after the op's whole deadline in a wait torch's C++ makes. This rank
    // skips the op: the group is out of step, and the others are told.
    if (ctl_->mark_dead(std::string(op) + " was interrupted on rank " + std::to_string(ctl_->rank) +
                        " before it was issued")) {
      FaultInfo fi;
      fi.kind = FaultKind::kInterrupted;
      fi.op = op;
      fi.seq = ctl_->seq();
      fi.detail = "interrupted (SIGINT)";
      auto ctl = ctl_;
      std::thread([ctl, fi]() { ctl->fault(fi); }).detach();
    }
    std::rethrow_exception(interrupt);
  }
  if (ctl_->polled && capturing(ins, getBoundDeviceId())) {
    // A CUDA graph captures the op: it runs when the graph is replayed, which no backend sees,
    // and an event recorded in a capture cannot be queried. Issued as on plain NCCL, unwatched.
    Nanos unused;
    take_next_deadline(unused);
    Opts o = opts;
    return issue(*this->inner(), o);
  }
  const bool from_fastdist = has_next_deadline();  // fastdist's own functions checked the call already
  const Nanos call_start = next_start();
  Nanos now = steady_now();
  Nanos deadline = deadline_for(now);
  const bool p2p = type == c10d::OpType::SEND || type == c10d::OpType::RECV ||
                   type == c10d::OpType::RECVANYSOURCE || type == c10d::OpType::COALESCED;
  if (checks_enabled() && !from_fastdist && !p2p && deadline > now && check_hook()) {
    // Compared with the other ranks' before anything is sent: a mismatch (a size that differs
    // in an all_gather, say) would otherwise end the process inside gloo.
    if (!check_hook()(ctl_->id(), op, signature_of(ins), nanos_to_seconds(deadline))) deadline = steady_now();
    now = steady_now();
  }
  if (deadline <= now) {
    // The deadline passed before the op was issued: this rank skips it, so the group is out of
    // step. Say so, as for a timeout.
    const std::uint64_t seq = ctl_->begin(op, now, ins);
    std::rethrow_exception(
        fault_at_issue(FaultKind::kTimeout, op, seq, now, deadline, "the deadline had passed before the call"));
  }
  Opts o = opts;
  if (!ctl_->polled && deadline != kNever) {
    // gloo gives up a little after fastdist's deadline, freeing its worker thread.
    const double ms = std::ceil(gloo_budget(nanos_to_seconds(deadline - now)) * 1000.0);
    if (ms < 1e12) {
      auto t = std::chrono::milliseconds(static_cast<std::int64_t>(ms));
      if (o.timeout == c10d::kUnsetTimeout || t < o.timeout) o.timeout = t;
    }
  }
  // The op began when fastdist's call did (its timeout= counts from there), else now.
  const Nanos start = call_start > 0 && call_start <= now ? call_start : now;
  const std::uint64_t seq = ctl_->begin(op, start, ins);
  auto inner = this->inner();
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = issue(*inner, o);
    // ProcessGroupNCCL hands back no work for a synchronous op (it ran on the caller's current
    // stream) nor for an empty or synchronous coalesced batch: the op is watched through an
    // event recorded on that stream now, so that it is bounded all the same.
    if (!work) work = marker_ ? c10::intrusive_ptr<c10d::Work>::reclaim(marker_(*inner)) : stream_marker(*inner, ins);
  } catch (const c10::Error& err) {
    if (dynamic_cast<const c10::DistError*>(&err) == nullptr) {
      ctl_->rollback(seq);  // refused by the backend (bad arguments): nothing was sent
      throw;
    }
    // NCCL: its communicator was aborted (by its watchdog, say).
    std::rethrow_exception(
        fault_at_issue(FaultKind::kBackend, op, seq, start, deadline, err.what_without_backtrace()));
  } catch (const std::exception& err) {
    // gloo: a peer's connection closed before the op was issued (its pair throws at once). A
    // raw error would end a replacement that is receiving its state, say, instead of recovering.
    std::rethrow_exception(fault_at_issue(FaultKind::kBackend, op, seq, start, deadline, err.what()));
  }
  return watch(op, type, seq, start, deadline, std::move(work), ins);
}

template <typename Issue>
c10::intrusive_ptr<c10d::Work> WatchedBackend::run_plain(const char* op, c10d::OpType type, Issue&& issue,
                                                         c10::ArrayRef<at::Tensor> ins) {
  struct NoOpts {
    std::chrono::milliseconds timeout = c10d::kUnsetTimeout;
  } none;
  return run(op, type, none, [&](c10d::Backend& b, NoOpts&) { return issue(b); }, ins);
}

const std::string WatchedBackend::getBackendName() const {
  return const_cast<WatchedBackend*>(this)->inner()->getBackendName();
}
bool WatchedBackend::supportsSplitting() const { return const_cast<WatchedBackend*>(this)->inner()->supportsSplitting(); }
bool WatchedBackend::supportsCoalescing() const {
  return const_cast<WatchedBackend*>(this)->inner()->supportsCoalescing();
}
void WatchedBackend::setTimeout(std::chrono::milliseconds timeout) {
  inner()->setTimeout(timeout);
  ctl_->default_timeout.store(static_cast<Nanos>(timeout.count()) * 1'000'000);
}
void WatchedBackend::startCoalescing() { inner()->startCoalescing(); }
c10::intrusive_ptr<c10d::Work> WatchedBackend::endCoalescing() {
  return run_plain("coalesced", c10d::OpType::COALESCED, [](c10d::Backend& b) { return b.endCoalescing(); });
}
c10::intrusive_ptr<c10d::Backend::Options> WatchedBackend::getBackendOptions() { return inner()->getBackendOptions(); }

c10::intrusive_ptr<c10d::Work> WatchedBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                         const c10d::BroadcastOptions& opts) {
  return run("broadcast", c10d::OpType::BROADCAST, opts,
             [&](c10d::Backend& b, c10d::BroadcastOptions& o) { return b.broadcast(tensors, o); }, tensors);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                         const c10d::AllreduceOptions& opts) {
  return run("all_reduce", c10d::OpType::ALLREDUCE, opts,
             [&](c10d::Backend& b, c10d::AllreduceOptions& o) { return b.allreduce(tensors, o); }, tensors);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                                const c10d::AllreduceOptions& opts) {
  return run("all_reduce_sparse", c10d::OpType::ALLREDUCE, opts,
             [&](c10d::Backend& b, c10d::AllreduceOptions& o) { return b.allreduce_sparse(tensors, o); }, tensors);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                   const c10d::AllreduceCoalescedOptions& opts) {
  return run("all_reduce_coalesced", c10d::OpType::ALLREDUCE_COALESCED, opts,
             [&](c10d::Backend& b, c10d::AllreduceCoalescedOptions& o) { return b.allreduce_coalesced(tensors, o); }, tensors);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  return run("reduce", c10d::OpType::REDUCE, opts,
             [&](c10d::Backend& b, c10d::ReduceOptions& o) { return b.reduce(tensors, o); }, tensors);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllgatherOptions& opts) {
  return run("all_gather", c10d::OpType::ALLGATHER, opts,
             [&](c10d::Backend& b, c10d::AllgatherOptions& o) { return b.allgather(outputs, inputs, o); }, inputs);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                               const c10d::AllgatherOptions& opts) {
  return run("all_gather_into_tensor", c10d::OpType::_ALLGATHER_BASE, opts,
             [&](c10d::Backend& b, c10d::AllgatherOptions& o) { return b._allgather_base(output, input, o); }, input);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                   std::vector<at::Tensor>& inputs,
                                                                   const c10d::AllgatherOptions& opts) {
  return run("all_gather_coalesced", c10d::OpType::ALLGATHER_COALESCED, opts,
             [&](c10d::Backend& b, c10d::AllgatherOptions& o) { return b.allgather_coalesced(outputs, inputs, o); }, inputs);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                               std::vector<at::Tensor>& inputs,
                                                                               const c10d::AllgatherOptions& opts) {
  return run("all_gather_into_tensor_coalesced", c10d::OpType::COALESCED, opts,
             [&](c10d::Backend& b, c10d::AllgatherOptions& o) {
               return b.allgather_into_tensor_coalesced(outputs, inputs, o);
             }, inputs);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  return run("gather", c10d::OpType::GATHER, opts,
             [&](c10d::Backend& b, c10d::GatherOptions& o) { return b.gather(outputs, inputs, o); }, inputs);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::scatter(std::vector<at::Tensor>& outputs,
                                                       std::vector<std::vector<at::Tensor>>& inputs,
                                                       const c10d::ScatterOptions& opts) {
  return run("scatter", c10d::OpType::SCATTER, opts,
             [&](c10d::Backend& b, c10d::ScatterOptions& o) { return b.scatter(outputs, inputs, o); });
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                              std::vector<std::vector<at::Tensor>>& inputs,
                                                              const c10d::ReduceScatterOptions& opts) {
  return run("reduce_scatter", c10d::OpType::REDUCE_SCATTER, opts,
             [&](c10d::Backend& b, c10d::ReduceScatterOptions& o) { return b.reduce_scatter(outputs, inputs, o); });
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                    const c10d::ReduceScatterOptions& opts) {
  return run("reduce_scatter_tensor", c10d::OpType::_REDUCE_SCATTER_BASE, opts,
             [&](c10d::Backend& b, c10d::ReduceScatterOptions& o) { return b._reduce_scatter_base(output, input, o); }, input);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                               std::vector<at::Tensor>& inputs,
                                                                               const c10d::ReduceScatterOptions& opts) {
  return run("reduce_scatter_tensor_coalesced", c10d::OpType::COALESCED, opts,
             [&](c10d::Backend& b, c10d::ReduceScatterOptions& o) {
               return b.reduce_scatter_tensor_coalesced(outputs, inputs, o);
             }, inputs);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                             std::vector<int64_t>& outputSplitSizes,
                                                             std::vector<int64_t>& inputSplitSizes,
                                                             const c10d::AllToAllOptions& opts) {
  return run("all_to_all_single", c10d::OpType::ALLTOALL_BASE, opts, [&](c10d::Backend& b, c10d::AllToAllOptions& o) {
    return b.alltoall_base(output, input, outputSplitSizes, inputSplitSizes, o);
  }, input);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::AllToAllOptions& opts) {
  return run("all_to_all", c10d::OpType::ALLTOALL, opts,
             [&](c10d::Backend& b, c10d::AllToAllOptions& o) { return b.alltoall(outputs, inputs, o); }, inputs);
}
void WatchedBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  inner()->monitoredBarrier(opts, waitAllRanks);
}
void WatchedBackend::setSequenceNumberForGroup() { inner()->setSequenceNumberForGroup(); }
uint64_t WatchedBackend::getSequenceNumberForGroup() { return inner()->getSequenceNumberForGroup(); }
c10::intrusive_ptr<c10d::Work> WatchedBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  return run_plain("send", c10d::OpType::SEND, [&](c10d::Backend& b) { return b.send(tensors, dstRank, tag); }, tensors);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  return run_plain("recv", c10d::OpType::RECV, [&](c10d::Backend& b) { return b.recv(tensors, srcRank, tag); }, tensors);
}
c10::intrusive_ptr<c10d::Work> WatchedBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return run_plain("recv", c10d::OpType::RECVANYSOURCE, [&](c10d::Backend& b) { return b.recvAnysource(tensors, tag); }, tensors);
}
namespace {
// Asks for an asynchronous op, where the options have the field (torch 2.7 and newer).
template <typename Opts>
auto make_async(Opts& o, int) -> decltype(void(o.asyncOp = true)) {
  o.asyncOp = true;
}
template <typename Opts>
void make_async(Opts&, long) {}
}  // namespace

c10::intrusive_ptr<c10d::Work> WatchedBackend::barrier(const c10d::BarrierOptions& opts) {
  return run("barrier", c10d::OpType::BARRIER, opts, [&](c10d::Backend& b, c10d::BarrierOptions& o) {
    // ProcessGroupNCCL's synchronous barrier blocks the host on the stream inside the call, where
    // no deadline is armed yet: issued asynchronously, its work is waited on (bounded) instead.
    if (ctl_->polled) make_async(o, 0);
    return b.barrier(o);
  });
}
void WatchedBackend::waitForPendingWorks() { inner()->waitForPendingWorks(); }
void WatchedBackend::setGroupUid(const std::string& pg_uid) {
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 5
  c10d::Backend::setGroupUid(pg_uid);
  inner()->setGroupUid(pg_uid);
#else
  (void)pg_uid;
#endif
}
void WatchedBackend::eagerConnectSingleDevice(at::Device device) { inner()->eagerConnectSingleDevice(device); }
void WatchedBackend::abort() {
  // An aborted NCCL communicator's ops read as completed with no error (WorkNCCL::isCompleted
  // skips its error check once the communicator is aborted): the group says so first, so that
  // no op in flight is taken for a success.
  ctl_->set_aborted();
  inner()->abort();
}
void WatchedBackend::shutdown() { inner()->shutdown(); }


}  // namespace fastdist::watched
