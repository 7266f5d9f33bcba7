// A CPU double of torch's ProcessGroupNCCL, for fastdist's tests: it follows the contract that
// torch's own source states (torch/csrc/distributed/c10d/ProcessGroupNCCL.{hpp,cpp}, 2.11 and
// 2.13), so that the watched backend meets on a CPU what it meets on a GPU, on the same C++ path
// (WatchedBackend with polled completion, csrc/watched/backend.cpp and work.cpp). The data moves
// through a gloo backend underneath (values are real: DDP and FSDP2 train, a replacement receives
// its state), and, as on a GPU, asynchronously to the host:
//
// - WorkNCCL::isSuccess() throws ("WorkNCCL::isSuccess() is deprecated"): completion and errors
//   are told only by isCompleted() and exception();
// - isCompleted() stands for the query of the op's end event: it never blocks, and says true once
//   the op ran (gloo finished it, the ops before it on the stream ran, and DELAY passed); an error
//   gloo met (a peer that died) is then in exception(), as an NCCL async error is;
// - a work's future completes when the op is enqueued, not when it ran;
// - wait() only makes the current stream wait: it returns at once, before the data is there
//   (it throws only an error the work already has);
// - a synchronous op (the options' asyncOp false, as torch.distributed passes for async_op=False)
//   runs on the caller's current stream and hands back no work at all (a null intrusive_ptr:
//   `return asyncOp ? work : nullptr;` in ProcessGroupNCCL::collective); a caller learns when it
//   ran only from the stream (current_stream_marker(): the double's CUDA event);
// - after abort() (ncclCommAbort) every op reads as completed with no error (WorkNCCL skips its
//   error check once the communicator is aborted); with abort_hangs, abort() never returns, like
//   an ncclCommAbort stuck behind a kernel;
// - a watchdog of its own (ProcessGroupNCCL's Watchdog::runLoop, the same in 2.11 and 2.14.1), on
//   a thread started with the backend, polls every op every 100 ms on its *own copies* of the
//   works (workEnqueue's `workMetaList_.emplace_back(*work)`): an op older than the group's
//   timeout (the creator's `timeout`), or one that met an error, has the error set on the copy
//   only, the backend's getError() set (TIMEOUT or COMM_ERROR, the first one stays), and the
//   communicator aborted (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, fastdist's mode): the work the
//   caller holds then reads as completed, with no error. The watchdog then sleeps out the dump
//   (4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC: dump_sleep, 60 s by default as in torch) holding the
//   lock that enqueueing an op takes;
// - the destructor joins the watchdog, so it waits out that sleep (ProcessGroupNCCL's joins its
//   watchdog and heartbeat monitor).
//
// One stream per communicator: an op counts as run only once the ops issued before it did.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "watched/c10d_ops.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace fastdist::testing {

struct DoubleComm;
struct OpState;
struct Moved;

class NcclDouble : public c10d::Backend {
 public:
  static constexpr const char* kName = "nccl_double";

  // Process-wide knobs of the double (tests set them from Python): how long an op runs after
  // gloo finished it (seconds; infinity: never, like a kernel behind a peer that never comes),
  // and whether abort() hangs.
  static std::atomic<double>& delay();
  static std::atomic<bool>& abort_hangs();
  static std::atomic<double>& dump_sleep();  // seconds the watchdog sleeps after a failed op
  static std::atomic<int>& aborts();  // abort() calls so far (fastdist's, not the watchdog's)

  // `transport`: the gloo backend (of the same rank and size) that moves the data; `timeout`:
  // what the double's own watchdog enforces (seconds; inf: never); `group_timeout`: the group's
  // timeout its options report (as ProcessGroupNCCL's Options._timeout; usually the same).
  NcclDouble(c10::intrusive_ptr<c10d::Backend> transport, double timeout, double group_timeout);
  ~NcclDouble() override;

  c10d::ErrorType getError() override;
  c10::intrusive_ptr<Options> getBackendOptions() override { return options_; }
  double timeout() const { return timeout_; }  // the group's timeout its watchdog enforces

  const std::string getBackendName() const override { return kName; }
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return 0; }

  FASTDIST_C10D_OPS
  void abort() override;
  // An asynchronous error on the communicator (a peer's death NCCL noticed between ops): the
  // watchdog's next round aborts it, as ProcessGroupNCCL's does with ncclCommGetAsyncError.
  void comm_error();
  void shutdown() override {}

  // The double's CUDA event on the caller's current stream: a work that completes once every op
  // issued so far on this communicator ran (what a synchronous op's caller has to go by).
  c10::intrusive_ptr<c10d::Work> current_stream_marker();

 private:
  // Queues an op that gloo runs as `moved` on the stream; its work, or none for a synchronous
  // op (or inside a coalesced batch, whose endCoalescing() hands back the batch's one work).
  c10d::Backend* comm();  // the transport, as NCCLComm::getNcclComm: throws once aborted
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, c10::intrusive_ptr<c10d::Work> moved,
                                         std::vector<at::Tensor> result, bool async_op);

  void watchdog();
  std::shared_ptr<OpState> queue(std::vector<std::shared_ptr<Moved>> moved);

  std::shared_ptr<DoubleComm> comm_;
  const double timeout_;
  c10::intrusive_ptr<Options> options_;
  std::atomic<bool> stop_{false};
  std::atomic<int> error_{static_cast<int>(c10d::ErrorType::SUCCESS)};
  std::thread watchdog_;
};

}  // namespace fastdist::testing
