// What the parts of the watched backend share among themselves (not part of watched.h's API).
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "watched.h"

namespace fastdist::watched {

// errors.cpp: errors made in C++, and Python's carried through it.
std::exception_ptr plain_error(const std::string& what);
std::string what_of(const std::exception_ptr& e);

// backend.cpp: how long gloo itself may take over an op with `budget` seconds left to its
// deadline, in seconds: the budget plus a grace of 10% of it, between 0.1 and 1 s, so that the
// engine sees the deadline first on every rank (the skew between their deadlines is absorbed by
// the grace) and a dead group's worker thread is freed soon after. The one rule for gloo's
// per-call timeout, posted ops' waits, and fastdist's own calls on unwatched groups (bound).
double gloo_budget(double budget);

// scopes.cpp: the deadline fastdist's own functions hand the next op (set_next_deadline).
bool has_next_deadline();
bool take_next_deadline(Nanos& out);
Nanos next_start();  // the call's start given with it (0: none)

// group.cpp: the fault builder, and the cross-rank checks of the ops torch issues.
FaultBuilder& builder();
bool checks_enabled();
CheckHook& check_hook();
std::string signature_of(c10::ArrayRef<at::Tensor> ins);

// signals.cpp: a waiter on the main thread runs Python's signal handlers every slice.
constexpr Nanos kSlice = 100'000'000;  // 100 ms
std::exception_ptr check_signals();
// On the main thread, after a Ctrl-C that found no op in flight: Python's pending
// KeyboardInterrupt, raised now (its handler runs here), or nullptr.
std::exception_ptr take_unclaimed_sigint();

// work.cpp: ops abandoned at their deadline, still in flight in the backend.
std::atomic<std::int64_t>& abandoned();

// marker.cpp: where ProcessGroupNCCL hands back no work for an op (a synchronous one runs on the
// caller's current stream), a work that completes once that stream ran it: a CUDA event recorded
// there now. (Another NCCL-like backend brings its own: StreamMarkerFn in watched.h.)
c10::intrusive_ptr<c10d::Work> stream_marker(c10d::Backend& inner, c10::ArrayRef<at::Tensor> ins);
// The device an op on `ins` runs on: its first non-CPU tensor's, else the backend's bound device
// (`bound`); none for a CPU op.
std::optional<c10::Device> device_of(c10::ArrayRef<at::Tensor> ins, std::optional<c10::Device> bound);
// Whether the stream an op on `ins` is issued on (its device's current stream; for an op with no
// CUDA tensor, the bound or current CUDA device's) is capturing a CUDA graph.
bool capturing(c10::ArrayRef<at::Tensor> ins, std::optional<c10::Device> bound);
// Sets the calling thread's CUDA graph capture mode to relaxed (where a CUDA runtime is loaded).
void relax_capture_mode();

// backend.cpp: every watched backend still alive.
std::vector<c10::intrusive_ptr<WatchedBackend>> live_backends();

// seal.cpp: the tag of a record under the job's secret (fastdist.store.seal: the first 32 hex
// digits of its HMAC-SHA256), and the record as written (tagged; as is without a secret).
constexpr std::size_t kSealTagHex = 32;
std::string seal_tag(const std::string& key, const std::string& body);
std::string sealed(const std::string& key, const std::string& body);

}  // namespace fastdist::watched
