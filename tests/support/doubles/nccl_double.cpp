// The CPU double of ProcessGroupNCCL: see nccl_double.h for the contract it follows.
#include "nccl_double.h"

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cmath>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace fastdist::testing {

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Whether a torch.distributed call asked for an asynchronous op (its options' asyncOp, which
// the dispatcher passes since torch 2.7; an options struct without the field: asynchronous).
template <typename Opts>
auto async_of(const Opts& o, int) -> decltype(static_cast<bool>(o.asyncOp)) {
  return o.asyncOp;
}
template <typename Opts>
bool async_of(const Opts&, long) {
  return true;
}

[[noreturn]] void is_success_throws() {
  // torch's words (ProcessGroupNCCL.cpp, WorkNCCL::isSuccess).
  C10_THROW_ERROR(NotImplementedError, "WorkNCCL::isSuccess() is deprecated");
}

}  // namespace

// How one gloo op ended, learnt without blocking anyone: from its future's callback, or, for a
// point-to-point op (gloo gives it no future), on a thread of its own that waits for it.
struct Moved {
  std::atomic<bool> done{false};
  std::mutex mu;
  std::exception_ptr error;

  void finish(std::exception_ptr e) {
    if (e) {
      std::lock_guard<std::mutex> lk(mu);
      error = e;
    }
    done.store(true);
  }
};

namespace {

std::shared_ptr<Moved> track(const c10::intrusive_ptr<c10d::Work>& work) {
  auto moved = std::make_shared<Moved>();
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  try {
    fut = work->getFuture();
  } catch (const std::exception&) {
    fut.reset();
  }
  if (fut) {
    fut->addCallback([moved](c10::ivalue::Future& f) { moved->finish(f.hasError() ? f.exception_ptr() : nullptr); });
  } else {
    std::thread([moved, work]() {
      std::exception_ptr e;
      try {
        work->wait();
      } catch (...) {
        e = std::current_exception();
      }
      moved->finish(e);
    }).detach();
  }
  return moved;
}

}  // namespace

// One op on the "stream": it has run once the ops before it ran, gloo finished it, and DELAY
// passed (the end event's query). Shared by the work the caller holds and the watchdog's copy.
struct OpState {
  std::vector<std::shared_ptr<Moved>> moved;
  std::shared_ptr<OpState> prev;  // the op before it on the stream
  double start = now_seconds();
  std::mutex mu;
  bool ran = false;
  double ready_at = -1;

  bool ran_now() {
    std::shared_ptr<OpState> before;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (ran) return true;
      before = prev;
    }
    if (before && !before->ran_now()) return false;
    std::lock_guard<std::mutex> lk(mu);
    prev.reset();  // ran: nothing to keep alive
    for (const auto& m : moved) {
      if (!m->done.load()) return false;
    }
    // A stalled "kernel" (delay) hides even an error: NCCL notices a dead peer only through
    // its own checks, if ever (a kernel spins until the communicator is aborted).
    if (ready_at < 0) {
      const double d = NcclDouble::delay().load();
      ready_at = std::isfinite(d) ? now_seconds() + d : std::numeric_limits<double>::infinity();
    }
    if (now_seconds() < ready_at) return false;
    return ran = true;
  }

  std::exception_ptr error() {
    for (const auto& m : moved) {
      std::lock_guard<std::mutex> mlk(m->mu);
      if (m->error) return m->error;
    }
    return nullptr;
  }
};

// The watchdog's copy of a work (ProcessGroupNCCL keeps a copy of each WorkNCCL in its
// workMetaList_): what the watchdog finds is set here, never on the caller's work.
struct WatchCopy {
  std::shared_ptr<OpState> state;
  std::exception_ptr error;
};

// What the works of one communicator share: the data's transport, the stream's tail, whether the
// communicator was aborted, and the watchdog's list.
struct DoubleComm {
  c10::intrusive_ptr<c10d::Backend> transport;
  int rank = 0;
  std::atomic<bool> aborted{false};
  std::atomic<bool> async_error{false};  // ncclCommGetAsyncError would say so (comm_error())
  std::mutex mu;
  std::shared_ptr<OpState> tail;  // the last op queued on the stream
  bool coalescing = false;
  std::vector<std::shared_ptr<Moved>> batch;
  std::vector<at::Tensor> batch_tensors;
  std::mutex list_mu;  // workMetaListMutex_: held by enqueue, and by the watchdog through its dump
  std::vector<WatchCopy> copies;
};

namespace {

class DoubleWork : public c10d::Work {
 public:
  DoubleWork(std::shared_ptr<DoubleComm> comm, c10d::OpType type, std::shared_ptr<OpState> state,
             std::vector<at::Tensor> result)
      : c10d::Work(comm->rank, type), comm_(std::move(comm)), state_(std::move(state)), result_(std::move(result)) {
    // Like WorkNCCL's: completed when the op is enqueued, with its output tensors.
    fut_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    fut_->markCompleted(c10::IValue(result_));
  }

  // The end event's query (WorkNCCL::isCompleted): never blocks.
  bool isCompleted() override {
    std::lock_guard<std::mutex> lk(mu_);
    if (done_) return true;
    // Once the communicator is aborted (by fastdist or by the watchdog) its kernels exit, and
    // WorkNCCL::isCompleted() skips its error check (`if (!ncclComm_->isAborted())
    // checkAndSetException();`): the op reads as completed, with no error.
    if (comm_->aborted.load()) return done_ = true;
    if (!state_->ran_now()) return false;
    error_ = state_->error();  // an NCCL async error (a peer that died): completed, with the error
    return done_ = true;
  }

  bool isSuccess() const override { is_success_throws(); }

  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> lk(mu_);
    return error_;
  }

  std::vector<at::Tensor> result() override { return result_; }

  // WorkNCCL::wait without blocking wait: the current stream waits for the end event; the host
  // goes on at once. An error the work already has is thrown.
  bool wait(std::chrono::milliseconds) override {
    if (auto e = exception()) std::rethrow_exception(e);
    return true;
  }
  void synchronize() override {}

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return fut_; }

 private:
  std::shared_ptr<DoubleComm> comm_;
  std::shared_ptr<OpState> state_;
  const std::vector<at::Tensor> result_;
  c10::intrusive_ptr<c10::ivalue::Future> fut_;
  mutable std::mutex mu_;
  bool done_ = false;
  std::exception_ptr error_;
};

// A synchronous op's caller has only the stream to go by: this stands for an event recorded on
// it after the op, complete once the stream's tail ran. Like a CUDA event, it has no future.
class StreamMarker : public c10d::Work {
 public:
  StreamMarker(int rank, std::shared_ptr<DoubleComm> comm, std::shared_ptr<OpState> tail)
      : c10d::Work(rank), comm_(std::move(comm)), tail_(std::move(tail)) {}
  bool isCompleted() override { return !tail_ || comm_->aborted.load() || tail_->ran_now(); }
  bool isSuccess() const override { is_success_throws(); }
  std::exception_ptr exception() const override {
    return tail_ && !comm_->aborted.load() && tail_->ran_now() ? tail_->error() : nullptr;
  }
  bool wait(std::chrono::milliseconds) override { return true; }

 private:
  std::shared_ptr<DoubleComm> comm_;
  std::shared_ptr<OpState> tail_;
};

}  // namespace

std::atomic<double>& NcclDouble::delay() {
  static std::atomic<double> d{0.0};
  return d;
}
std::atomic<bool>& NcclDouble::abort_hangs() {
  static std::atomic<bool> h{false};
  return h;
}
std::atomic<int>& NcclDouble::aborts() {
  static std::atomic<int> n{0};
  return n;
}

std::atomic<double>& NcclDouble::dump_sleep() {
  static std::atomic<double> d{60.0};  // 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (15000)
  return d;
}

NcclDouble::NcclDouble(c10::intrusive_ptr<c10d::Backend> transport, double timeout, double group_timeout)
    : c10d::Backend(transport->getRank(), transport->getSize()), comm_(std::make_shared<DoubleComm>()),
      timeout_(timeout), options_(c10::make_intrusive<Options>(kName)) {
  if (std::isfinite(group_timeout)) {
    options_->timeout = std::chrono::milliseconds(static_cast<std::int64_t>(group_timeout * 1000.0));
  }
  comm_->transport = std::move(transport);
  comm_->rank = rank_;
  watchdog_ = std::thread([this] { watchdog(); });
}

NcclDouble::~NcclDouble() {
  // ProcessGroupNCCL's destructor joins its watchdog (and heartbeat monitor): a watchdog sleeping
  // out a dump holds the destructor that long.
  stop_.store(true);
  if (watchdog_.joinable()) watchdog_.join();
  // gloo's destructor joins its worker threads, which may still wait in an op of an aborted
  // communicator for a peer that never comes: that op's transport is kept, never destroyed.
  if (comm_->aborted.load()) new c10::intrusive_ptr<c10d::Backend>(std::move(comm_->transport));
}

c10d::ErrorType NcclDouble::getError() { return static_cast<c10d::ErrorType>(error_.load()); }

void NcclDouble::watchdog() {
  // Watchdog::runLoop: every 100 ms (kWatchdogThreadSleepMillis), each copy in the list.
  while (!stop_.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::unique_lock<std::mutex> lk(comm_->list_mu);
    if (comm_->aborted.load()) {
      comm_->copies.clear();
      continue;
    }
    c10d::ErrorType failed = c10d::ErrorType::SUCCESS;
    // NCCL's asynchronous error on the communicator itself (a peer died between ops, none of ours
    // in flight): the watchdog aborts it all the same.
    if (comm_->async_error.exchange(false)) failed = c10d::ErrorType::COMM_ERROR;
    for (auto it = comm_->copies.begin(); failed == c10d::ErrorType::SUCCESS && it != comm_->copies.end();) {
      if (it->state->ran_now()) {
        if (auto e = it->state->error()) {
          it->error = e;  // on the copy
          failed = c10d::ErrorType::COMM_ERROR;
          break;
        }
        it = comm_->copies.erase(it);
      } else if (now_seconds() - it->state->start > timeout_) {
        it->error = std::make_exception_ptr(std::runtime_error("Watchdog caught collective operation timeout"));
        failed = c10d::ErrorType::TIMEOUT;
        break;
      } else {
        ++it;
      }
    }
    if (failed == c10d::ErrorType::SUCCESS) continue;
    int none = static_cast<int>(c10d::ErrorType::SUCCESS);
    error_.compare_exchange_strong(none, static_cast<int>(failed));  // the first error stays
    comm_->aborted.store(true);  // TORCH_NCCL_ASYNC_ERROR_HANDLING=2: abort the communicators
    comm_->copies.clear();
    // The dump: the watchdog sleeps, still holding the list's lock (no op can be enqueued).
    const double sleep = dump_sleep().load();
    if (sleep > 0) std::this_thread::sleep_for(std::chrono::duration<double>(sleep));
  }
}

c10d::Backend* NcclDouble::comm() {
  // NCCLComm::getNcclComm, on every op ProcessGroupNCCL issues: an aborted communicator (by
  // fastdist, or by the watchdog after an error or a timeout) throws as the op is issued.
  TORCH_CHECK_WITH(DistBackendError, !comm_->aborted.load(), "NCCL communicator was aborted on rank ", rank_, ".");
  return comm_->transport.get();
}

c10::intrusive_ptr<c10d::Work> NcclDouble::enqueue(c10d::OpType type, c10::intrusive_ptr<c10d::Work> moved,
                                                   std::vector<at::Tensor> result, bool async_op) {
  auto m = track(moved);
  std::lock_guard<std::mutex> lk(comm_->mu);
  if (comm_->coalescing) {
    comm_->batch.push_back(std::move(m));
    comm_->batch_tensors.insert(comm_->batch_tensors.end(), result.begin(), result.end());
    return {};
  }
  auto state = queue(std::vector<std::shared_ptr<Moved>>{std::move(m)});
  auto work = c10::make_intrusive<DoubleWork>(comm_, type, std::move(state), std::move(result));
  if (!async_op) return {};  // ran on the current stream: no work (ProcessGroupNCCL, asyncOp false)
  return work;
}

std::shared_ptr<OpState> NcclDouble::queue(std::vector<std::shared_ptr<Moved>> moved) {
  // (called with comm_->mu held) The op goes on the stream and into the watchdog's list.
  auto state = std::make_shared<OpState>();
  state->moved = std::move(moved);
  state->prev = comm_->tail;
  comm_->tail = state;
  std::lock_guard<std::mutex> lk(comm_->list_mu);  // waits while the watchdog sleeps out a dump
  comm_->copies.push_back(WatchCopy{state, nullptr});
  return state;
}

c10::intrusive_ptr<c10d::Work> NcclDouble::current_stream_marker() {
  std::lock_guard<std::mutex> lk(comm_->mu);
  return c10::make_intrusive<StreamMarker>(rank_, comm_, comm_->tail);
}

void NcclDouble::startCoalescing() {
  std::lock_guard<std::mutex> lk(comm_->mu);
  comm_->coalescing = true;
  comm_->batch.clear();
  comm_->batch_tensors.clear();
}

c10::intrusive_ptr<c10d::Work> NcclDouble::endCoalescing() {
  std::lock_guard<std::mutex> lk(comm_->mu);
  comm_->coalescing = false;
  if (comm_->batch.empty()) return {};  // nothing was issued: no work (as ProcessGroupNCCL)
  auto state = queue(std::move(comm_->batch));
  auto work = c10::make_intrusive<DoubleWork>(comm_, c10d::OpType::COALESCED, std::move(state),
                                              std::move(comm_->batch_tensors));
  comm_->batch.clear();
  comm_->batch_tensors.clear();
  return work;
}

c10::intrusive_ptr<c10d::Work> NcclDouble::broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) {
  return enqueue(c10d::OpType::BROADCAST, comm()->broadcast(t, o), t, async_of(o, 0));
}
c10::intrusive_ptr<c10d::Work> NcclDouble::allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) {
  return enqueue(c10d::OpType::ALLREDUCE, comm()->allreduce(t, o), t, async_of(o, 0));
}
c10::intrusive_ptr<c10d::Work> NcclDouble::allreduce_coalesced(std::vector<at::Tensor>& t,
                                                               const c10d::AllreduceCoalescedOptions& o) {
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, comm()->allreduce_coalesced(t, o), t, async_of(o, 0));
}
c10::intrusive_ptr<c10d::Work> NcclDouble::reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) {
  return enqueue(c10d::OpType::REDUCE, comm()->reduce(t, o), t, async_of(o, 0));
}
c10::intrusive_ptr<c10d::Work> NcclDouble::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& o) {
  std::vector<at::Tensor> out;
  for (auto& slots : outputs) out.insert(out.end(), slots.begin(), slots.end());
  return enqueue(c10d::OpType::ALLGATHER, comm()->allgather(outputs, inputs, o), std::move(out),
                 async_of(o, 0));
}
c10::intrusive_ptr<c10d::Work> NcclDouble::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                           const c10d::AllgatherOptions& o) {
  return enqueue(c10d::OpType::_ALLGATHER_BASE, comm()->_allgather_base(output, input, o), {output},
                 async_of(o, 0));
}
c10::intrusive_ptr<c10d::Work> NcclDouble::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                           std::vector<at::Tensor>& inputs,
                                                                           const c10d::AllgatherOptions& o) {
  return enqueue(c10d::OpType::COALESCED, comm()->allgather_into_tensor_coalesced(outputs, inputs, o),
                 outputs, async_of(o, 0));
}
c10::intrusive_ptr<c10d::Work> NcclDouble::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs, const c10d::GatherOptions& o) {
  std::vector<at::Tensor> out;
  for (auto& slots : outputs) out.insert(out.end(), slots.begin(), slots.end());
  return enqueue(c10d::OpType::GATHER, comm()->gather(outputs, inputs, o), std::move(out), async_of(o, 0));
}
c10::intrusive_ptr<c10d::Work> NcclDouble::scatter(std::vector<at::Tensor>& outputs,
                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                   const c10d::ScatterOptions& o) {
  return enqueue(c10d::OpType::SCATTER, comm()->scatter(outputs, inputs, o), outputs, async_of(o, 0));
}
c10::intrusive_ptr<c10d::Work> NcclDouble::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                          std::vector<std::vector<at::Tensor>>& inputs,
                                                          const c10d::ReduceScatterOptions& o) {
  return enqueue(c10d::OpType::REDUCE_SCATTER, comm()->reduce_scatter(outputs, inputs, o), outputs,
                 async_of(o, 0));
}
c10::intrusive_ptr<c10d::Work> NcclDouble::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::ReduceScatterOptions& o) {
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, comm()->_reduce_scatter_base(output, input, o),
                 {output}, async_of(o, 0));
}
c10::intrusive_ptr<c10d::Work> NcclDouble::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                           std::vector<at::Tensor>& inputs,
                                                                           const c10d::ReduceScatterOptions& o) {
  return enqueue(c10d::OpType::COALESCED, comm()->reduce_scatter_tensor_coalesced(outputs, inputs, o),
                 outputs, async_of(o, 0));
}
c10::intrusive_ptr<c10d::Work> NcclDouble::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                         std::vector<int64_t>& out_splits,
                                                         std::vector<int64_t>& in_splits,
                                                         const c10d::AllToAllOptions& o) {
  return enqueue(c10d::OpType::ALLTOALL_BASE,
                 comm()->alltoall_base(output, input, out_splits, in_splits, o), {output}, async_of(o, 0));
}
c10::intrusive_ptr<c10d::Work> NcclDouble::allreduce_sparse(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) {
  return enqueue(c10d::OpType::ALLREDUCE, comm()->allreduce_sparse(t, o), t, async_of(o, 0));
}
c10::intrusive_ptr<c10d::Work> NcclDouble::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                               std::vector<at::Tensor>& inputs,
                                                               const c10d::AllgatherOptions& o) {
  std::vector<at::Tensor> out;
  for (auto& slots : outputs) out.insert(out.end(), slots.begin(), slots.end());
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, comm()->allgather_coalesced(outputs, inputs, o),
                 std::move(out), async_of(o, 0));
}
c10::intrusive_ptr<c10d::Work> NcclDouble::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                    const c10d::AllToAllOptions& o) {
  return enqueue(c10d::OpType::ALLTOALL, comm()->alltoall(outputs, inputs, o), outputs, async_of(o, 0));
}
c10::intrusive_ptr<c10d::Work> NcclDouble::recvAnysource(std::vector<at::Tensor>& t, int tag) {
  return enqueue(c10d::OpType::RECVANYSOURCE, comm()->recvAnysource(t, tag), t, true);
}
c10::intrusive_ptr<c10d::Work> NcclDouble::barrier(const c10d::BarrierOptions& o) {
  // ProcessGroupNCCL's barrier: a synchronous one blocks the host on the stream itself and hands
  // back no work; an asynchronous one's work blocks the host in its wait().
  auto work = enqueue(c10d::OpType::BARRIER, comm()->barrier(o), {}, true);
  if (async_of(o, 0)) return work;
  while (!work->isCompleted()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  return {};
}
c10::intrusive_ptr<c10d::Work> NcclDouble::send(std::vector<at::Tensor>& t, int dst, int tag) {
  // Point-to-point: asyncOp is not read (ProcessGroupNCCL::pointToPoint): a work always comes back.
  return enqueue(c10d::OpType::SEND, comm()->send(t, dst, tag), t, true);
}
c10::intrusive_ptr<c10d::Work> NcclDouble::recv(std::vector<at::Tensor>& t, int src, int tag) {
  return enqueue(c10d::OpType::RECV, comm()->recv(t, src, tag), t, true);
}

void NcclDouble::comm_error() { comm_->async_error.store(true); }

void NcclDouble::abort() {
  aborts().fetch_add(1);
  while (abort_hangs().load()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  comm_->aborted.store(true);
}

}  // namespace fastdist::testing
