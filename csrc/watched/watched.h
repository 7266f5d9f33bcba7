// Watched groups: a c10d::Backend that wraps the real one (gloo, NCCL) of a torch ProcessGroup and
// gives every op on it a deadline, whoever issues it (fastdist, torch.distributed, DDP's reducer,
// FSDP2, DeviceMesh), on any thread.
//
// The ProcessGroup stays torch's own object, with its name, its backend type (GLOO / NCCL) and its
// options; only the Backend registered in it is a WatchedBackend, which forwards every op to the
// inner backend and returns a WatchedWork. Recovery swaps the inner backend for a fresh one in
// place (swap_inner), so DDP, FSDP2 and DeviceMesh, which hold the ProcessGroup, train on.
//
// Per op: the deadline is the innermost fastdist scope of the issuing thread (or, for a thread
// with none of its own, such as autograd's device threads, the soonest scope open in the process),
// else the group's default timeout. gloo also gets it as its per-call timeout (plus a grace), so
// that its worker thread is freed shortly after the deadline. An engine token expires at the
// deadline; a group whose op expired or failed is dead, and the first thread to see that builds
// the typed error once (a Python callback: the who-is-missing report) and fails every op in flight
// on the group with it, so DDP's backward, a dist.* call and a work.wait() all raise the same
// CollectiveTimeoutError or GroupAbortedError. Later ops are refused at once until recovery.
//
// Lock order: the GIL before GroupCtl::mu before WatchedWork::mu; no lock is held while Python
// runs or while an inner backend is called.
//
// Where each part lives: backend.cpp (WatchedBackend, the registry of backends), work.cpp
// (WatchedWork), group.cpp (GroupCtl, the fault builder, the checks), scopes.cpp (deadline
// scopes), poller.cpp (NCCL-like completion), signals.cpp (Ctrl-C), errors.cpp;
// csrc/bindings/watched_module.cpp binds them to Python.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "../engine/engine.h"
#include "c10d_ops.h"

namespace fastdist::watched {

// Scopes: pushed by fastdist.fail_after / fail_at on the thread that enters them.
void push_scope(Nanos deadline);
void pop_scope();
// The deadline for the next op issued on this thread by fastdist's own functions (the sooner of
// their timeout= and the scopes), consumed by that op; kNever for none.
// `start`: when the call began (engine clock), the op's start in its record and its error
// ("after a timeout of ..." is deadline - start); 0: when the backend is reached.
void set_next_deadline(Nanos deadline, Nanos start = 0);
void clear_next_deadline();
// The deadline an op issued now on this thread gets from the scopes (kNever: none).
Nanos scope_deadline();
// The main thread's pthread id: a waiter there runs Python's signal handlers between slices.
void set_main_thread(unsigned long ident);

class WatchedWork;
class WatchedBackend;
class GilProbe;

// How a backend that completes its ops as ProcessGroupNCCL does (a work's future completes at
// enqueue; completion is told only by isCompleted(); a synchronous op hands back no work, having
// run on the caller's current stream), without being torch's ProcessGroupNCCL, tells fastdist so:
// its Python object has an attribute `_fastdist_stream_marker`, a capsule named
// kStreamMarkerCapsule holding a StreamMarkerFn. Its groups are then polled, and where it hands
// back no work the function gives the work that stands for an event on the caller's current
// stream (a new reference, released from its intrusive_ptr). Nothing else of such a backend is
// known here. (ProcessGroupNCCL needs none of this: fastdist records a CUDA event itself.)
using StreamMarkerFn = c10d::Work* (*)(c10d::Backend& backend);
constexpr const char* kStreamMarkerCapsule = "fastdist.stream_marker";

// What kind of fault an op met; Python sees the same enum (fastdist._watched.FaultKind).
enum class FaultKind : std::uint8_t {
  kTimeout,      // its deadline passed
  kBackend,      // the inner backend failed it
  kInterrupted,  // Ctrl-C
  kRefused,      // issued on a dead group
  kRemote,       // a peer's fault ended it
};
const char* fault_kind_name(FaultKind kind);

// What the Python side is told about a fault, and answers with the exception to raise.
struct FaultInfo {
  FaultKind kind = FaultKind::kTimeout;
  std::string op;
  std::uint64_t seq = 0;
  double start = 0;     // engine clock, seconds
  double deadline = 0;  // engine clock, seconds
  std::string detail;   // the backend's words, or the dead reason
  std::string prev;     // "op #n" of the op before seq, or ""
  bool waiter = false;  // built on a thread that waits for the op (it may run the handler)
  unsigned long thread = 0;  // pthread id of the thread that issued the op
  // A timeout's: whether Python got the GIL in time to report it, else the report made in C++
  // (see NativeReport). Null for the other kinds.
  std::shared_ptr<GilProbe> probe;
};

// What a rank whose Python cannot run at a deadline (a thread holds the GIL in a long C call)
// still does, in C++, kGilWait after it: the first steps of fastdist.store.board's
// report, the same records in the same keys. It claims the group's fault, rings its children in
// the ring tree (their inboxes) and posts its status ("timed_out", with "gil": true), so the other
// ranks raise at once, naming this rank as the one that timed out, instead of waiting for it and
// then calling it dead. When Python does run, C++ still claims the fault and rings, as soon as
// the builder has the GIL, while Python goes on with the rest of the report. Set by Python for
// each generation of the group, only on a store that runs no Python (TCPStore, FileStore,
// HashStore, a PrefixStore over one of those).
struct NativeReport {
  c10::intrusive_ptr<c10d::Store> store;
  std::string group;
  std::int64_t generation = 0;
  int rank = 0;         // in the group
  int global_rank = 0;  // in the job
  std::string fault_key, status_key, count_key;
  std::vector<std::string> inboxes;  // of this rank's children when it rings
  std::string secret;                // the job's (fastdist.store.seal): its records are signed
  mutable std::atomic<bool> posted{false};
};

// How long a timeout's report waits for the GIL before C++ makes it: Python switches threads
// every 5 ms, so only a call that holds the GIL throughout (or a starved machine) takes longer.
// (Within the other ranks' report window, min(1 s, 10% of their op's budget), so that a rank
// whose op fails when this rank's backend closes the group still reads this status.)
constexpr Nanos kGilWait = 200'000'000;

// Decides, once, between Python's report of a fault and the one made in C++.
class GilProbe {
 public:
  // The builder got the GIL: true if C++ had reported already.
  bool enter();
  // Waits up to `wait` for the builder; true (C++ must report) if it did not come.
  bool expire(Nanos wait);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false;
  bool native_ = false;
};

// Builds a FaultError (see errors.cpp) from the Python error currently set; needs the GIL.
std::exception_ptr fetch_python_error();
bool python_finalizing();

// Builds the exception for a fault; runs Python (takes the GIL). Returns a python_error.
using FaultBuilder = std::function<std::exception_ptr(std::uintptr_t ctl, const FaultInfo&)>;
void set_fault_builder(FaultBuilder builder);

// Cross-rank checks (FASTDIST_CHECK=1) of the ops torch issues on a watched group: with checks
// on, every op not issued by fastdist's own functions (which check their own) is compared with
// the other ranks' before it is issued. The hook runs Python (takes the GIL); it returns false
// when the deadline passed while comparing, and throws (a python_error: CollectiveMismatchError)
// on a mismatch, before anything is sent.
using CheckHook = std::function<bool(std::uintptr_t ctl, const char* op, const std::string& signature, double deadline)>;
void set_check_hook(CheckHook hook);
void set_checks_enabled(bool on);

// One op in a group's history (GroupCtl::history): a fixed-size record, written at issue and
// at end under the group's lock (no allocation on the hot path).
enum class Outcome : std::uint8_t { kPending = 0, kOk = 1, kTimedOut = 2, kFailed = 3 };

struct OpRecord {
  static constexpr std::uint8_t kDims = 4;
  std::uint64_t seq = 0;
  const char* op = "";
  unsigned long thread = 0;  // pthread id (= threading.get_ident()) of the issuer
  Nanos start = 0;
  Nanos end = 0;
  Outcome outcome = Outcome::kPending;
  std::int8_t dtype = -1;  // the first input's c10::ScalarType, or -1
  std::uint8_t ndim = 0;   // its dimensions (the first kDims of them in shape)
  std::uint32_t tensors = 0;
  std::int64_t shape[kDims] = {};
};

// The benchmarks' switch: with it off, the history keeps only op names (for "last seen in").
void set_history_enabled(bool on);

// An op name that lives for the whole process (names of ops issued from Python: a handful).
const char* intern(const std::string& op);

// One group's op numbers, history and dead state: a watched backend's (each backend of a watched
// group has one), or, made from Python, an unwatched group's (fastdist.groups.pgstate), so that
// every group keeps them by the same rules.
class GroupCtl {
 public:
  GroupCtl(std::string name, int rank, int size, Nanos default_timeout, bool polled, std::shared_ptr<Engine> engine)
      : name(std::move(name)), rank(rank), size(size), default_timeout(default_timeout), polled(polled),
        engine(std::move(engine)) {}

  const std::string name;
  const int rank;
  const int size;
  std::atomic<Nanos> default_timeout;
  const bool polled;  // NCCL-like: completion only through isCompleted(), not the future
  const std::shared_ptr<Engine> engine;

  std::uintptr_t id() const { return reinterpret_cast<std::uintptr_t>(this); }

  // Numbers an op (1, 2, ...); the same numbers on every rank that issues the same ops. `op`
  // must outlive the group (a literal, or intern()'s).
  std::uint64_t begin(const char* op, Nanos start, c10::ArrayRef<at::Tensor> ins);
  // Records how op `seq` ended (once; the first outcome stays).
  void end(std::uint64_t seq, Outcome outcome);
  // The last kRing ops, oldest first.
  std::vector<OpRecord> history();
  std::string prev_of(std::uint64_t seq);
  std::uint64_t seq();
  // Gives back `seq` when the op was refused before it was issued (bad arguments): the numbers
  // stay in step across ranks.
  void rollback(std::uint64_t seq);

  // The group's dead state, for watched and unwatched groups alike. A reason C++ gives itself
  // (a fault's "op #n timed out", Ctrl-C) is provisional: Python's report says better, and its
  // first reason replaces it (settle_dead). Refusals read whichever is there.
  bool dead();
  std::string dead_reason();
  // Marks the group dead with a provisional reason; false if it already was dead.
  bool mark_dead(const std::string& reason);
  // Python's reason: recorded unless one of Python's is there already (or `replace`). Returns
  // whether none of Python's was there before.
  bool settle_dead(const std::string& reason, bool replace);
  // Python's reason, or "" when there is none (alive, or only a provisional one).
  std::string settled_reason();
  // After recovery: alive again, with a fresh fault slot and no ops in flight.
  void revive();
  // The backend's communicators are being aborted (WatchedBackend::abort): an op that reads as
  // completed from now on was cut short, not run. Cleared by revive().
  void set_aborted() { aborted_.store(true); }
  bool aborted() const { return aborted_.load(); }

  // The fault of this generation: the first caller builds the error (with `info`), everyone gets
  // the same exception; every op still in flight fails with it.
  std::exception_ptr fault(const FaultInfo& info);
  // The exception to refuse a new op with on a dead group.
  std::exception_ptr refusal(const char* op);

  // The report C++ makes when Python cannot run at a deadline (null: none).
  void set_native_report(std::shared_ptr<const NativeReport> report);
  // Whether C++ posted this rank's status for `generation` (Python then does not post again).
  bool native_posted(std::int64_t generation);
  // For a timeout about to be built: a probe that reports in C++ if Python does not get the GIL
  // within kGilWait (null when no NativeReport is set, or it was used already).
  std::shared_ptr<GilProbe> probe_gil(const FaultInfo& info);

  // A peer reported a fault on the group (`detail`: its record): the oldest op in flight fails
  // with the error the builder makes of it, and every other op with it (the group's fault); with
  // none in flight, the group is only marked dead (`reason`). True if an op was failed.
  bool fail_remote(const std::string& detail, const std::string& reason);

  void track(const c10::intrusive_ptr<WatchedWork>& w);
  void untrack(WatchedWork* w);
  std::vector<c10::intrusive_ptr<WatchedWork>> inflight();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::uint64_t seq_ = 0;
  static constexpr std::size_t kRing = 64;
  OpRecord ring_[kRing] = {};
  bool dead_ = false;
  std::atomic<bool> aborted_{false};
  bool settled_ = false;  // dead_reason_ is Python's
  std::string dead_reason_;
  int fault_state_ = 0;  // 0 none, 1 being built, 2 delivered
  std::shared_ptr<const NativeReport> native_;
  std::exception_ptr fault_error_;
  // Weak: a work nobody holds any more ends its watch (release_resources) and leaves here.
  std::unordered_map<WatchedWork*, c10::weak_intrusive_ptr<WatchedWork>> inflight_;
};

class WatchedWork : public c10d::Work {
 public:
  WatchedWork(c10::intrusive_ptr<c10d::Work> inner, std::shared_ptr<GroupCtl> ctl, const char* op, std::uint64_t seq,
              Nanos start, Nanos deadline, c10d::OpType type);
  // Polled works: the backend that issued the op (asked whether it failed the op behind the
  // work's back, see poll_inner) and the device the op runs on (the poller queries its end event
  // with that device current, as torch's watchdog does).
  void set_issuer(const c10::intrusive_ptr<WatchedBackend>& backend, std::optional<c10::Device> device);
  std::optional<c10::Device> device() const { return device_; }
  ~WatchedWork() override;
  void release_resources() override;

  // Starts watching (after construction: callbacks need a reference to this).
  void arm();

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override;
  bool wait(std::chrono::milliseconds timeout) override;
  void abort();
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // Ends the op with `error` unless it already ended (fault delivery, refusal).
  void fail(std::exception_ptr error);
  // The inner work ended (from its future's callback, the poller or a waiter).
  void inner_done(std::exception_ptr error);
  // The deadline passed (engine executor thread).
  void expired();
  // For the poller: whether the inner work has finished on the device.
  bool poll_inner();
  // Ctrl-C: wakes a waiter at once (it runs Python's signal handler itself and raises its
  // KeyboardInterrupt); returns false when nobody waits (the op must be ended for torch's waiter).
  bool wake_waiter();

  // What a peer's fault report asks about this op: which op, and the thread that issued it.
  const char* op_name() const { return op_; }
  std::uint64_t op_seq() const { return seq_; }
  Nanos op_start() const { return start_; }
  unsigned long issuing_thread() const { return thread_; }
  bool ended() const;
  // A peer reported a fault on the group: fails this op (and, through the group's fault, every
  // other op in flight) with the error built for `detail` (the peer's record).
  std::exception_ptr fail_remote(const std::string& detail);


 private:
  FaultInfo info(FaultKind kind, const std::string& detail, bool waiter) const;
  // Ends the op (called with `lk` held on wmu_, returns with it released).
  void finish_and_unlock(std::exception_ptr error, std::unique_lock<std::mutex>& lk);
  void trigger_fault_async(FaultInfo info);
  c10::intrusive_ptr<c10::ivalue::Future> make_future() const;
  void complete_future(const c10::intrusive_ptr<c10::ivalue::Future>& fut, std::exception_ptr error);
  bool wait_posted(std::chrono::milliseconds timeout);

  c10::intrusive_ptr<c10d::Work> inner_;
  std::shared_ptr<GroupCtl> ctl_;
  c10::weak_intrusive_ptr<c10d::Backend> issuer_;  // a WatchedBackend (null until set_issuer)
  std::optional<c10::Device> device_;
  const char* op_;
  const std::uint64_t seq_;
  const Nanos start_;
  const Nanos deadline_;
  const unsigned long thread_;  // pthread id (= Python's threading.get_ident()) of the issuer
  std::shared_ptr<Token> token_;
  c10::intrusive_ptr<c10::ivalue::Future> inner_fut_;  // null for posted ops (gloo send/recv)
  c10::intrusive_ptr<c10::ivalue::Future> fut_;        // ours (made on demand): completed when the op ends

  mutable std::mutex wmu_;
  std::condition_variable wcv_;
  bool done_ = false;
  bool inner_ended_ = false;
  bool abandoned_ = false;  // counted in abandoned_inflight()
  std::atomic<int> waiters_{0};
  std::exception_ptr error_;
  std::exception_ptr inner_error_;
};

class WatchedBackend : public c10d::Backend {
 public:
  WatchedBackend(c10::intrusive_ptr<c10d::Backend> inner, std::shared_ptr<GroupCtl> ctl,
                 StreamMarkerFn marker = nullptr);

  c10::intrusive_ptr<c10d::Backend> inner();
  // Recovery: later ops go to `fresh`; the group is alive again. The old backend is let go on a
  // thread of its own: ProcessGroupNCCL's destructor joins its watchdog, which may be sleeping
  // out a dump (60 s by default), and its heartbeat monitor; gloo's joins a worker still in an
  // op. recover() must not wait for either.
  void swap_inner(c10::intrusive_ptr<c10d::Backend> fresh);
  // Whether the inner backend failed its ops on its own (ProcessGroupNCCL's watchdog sets its
  // error, then aborts the communicator, after which the op in flight reads as completed with
  // no error): its getError(), where it has one.
  bool inner_failed(std::string& why);
  c10d::ErrorType getError() override;
  const std::shared_ptr<GroupCtl>& ctl() const { return ctl_; }

  const std::string getBackendName() const override;
  // Virtual in the Backend of newer torch versions (they override there), plain members where an
  // older torch has no such virtual: one source builds against torch 2.6 and newer.
  bool supportsSplitting() const;
  bool supportsCoalescing() const;
  void setTimeout(std::chrono::milliseconds timeout);
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  c10::intrusive_ptr<Options> getBackendOptions();

  FASTDIST_C10D_OPS
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;
  void waitForPendingWorks() override;
  void setGroupUid(const std::string& pg_uid);
  void eagerConnectSingleDevice(at::Device device);
  void abort();
  void shutdown();

 private:
  template <typename Opts, typename Issue>
  c10::intrusive_ptr<c10d::Work> run(const char* op, c10d::OpType type, const Opts& opts, Issue&& issue,
                                     c10::ArrayRef<at::Tensor> ins = {});
  template <typename Issue>
  c10::intrusive_ptr<c10d::Work> run_plain(const char* op, c10d::OpType type, Issue&& issue,
                                           c10::ArrayRef<at::Tensor> ins = {});
  std::exception_ptr fault_at_issue(FaultKind kind, const char* op, std::uint64_t seq, Nanos start, Nanos deadline,
                                    std::string detail);
  c10::intrusive_ptr<c10d::Work> watch(const char* op, c10d::OpType type, std::uint64_t seq, Nanos start,
                                       Nanos deadline, c10::intrusive_ptr<c10d::Work> inner,
                                       c10::ArrayRef<at::Tensor> ins);
  Nanos deadline_for(Nanos now);
  void refuse_if_dead(const char* op);

  std::mutex inner_mu_;
  c10::intrusive_ptr<c10d::Backend> inner_;
  std::shared_ptr<GroupCtl> ctl_;
  const StreamMarkerFn marker_;
};

// Works that failed (at their deadline, or with their group) while their inner op was still in
// flight: the backend will call back into them when that op ends. Interpreter exit waits for
// this to reach 0 (bounded), so that no backend thread drops a Python error during finalization.
std::int64_t abandoned_inflight();

// Ctrl-C: a SIGINT handler chained in front of Python's wakes a thread that ends every op in
// flight on a watched group (the group is then dead), so a main thread blocked in torch's C++
// (DDP's backward waits on its buckets' futures, with no signal check) gets KeyboardInterrupt
// at once. Installed once; a handler Python installs later for SIGINT replaces it.
void install_sigint_hook();

// At interpreter exit: the inner backends of dead groups are kept alive for good, so that no
// destructor joins a backend thread still inside an op that will not end (gloo's waits for its
// own timeout; an exit must not).
void keep_dead_backends();

void register_backend(const c10::intrusive_ptr<WatchedBackend>& b);

// The NCCL-like poller: completes the works of polled groups that nobody waits on.
void poll_register(const c10::intrusive_ptr<WatchedWork>& work);

}  // namespace fastdist::watched
