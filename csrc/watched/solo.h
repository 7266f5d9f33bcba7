// A joining rank's stand-in backend: what a replacement's groups run on between
// fastdist.init_process_group and fastdist.sync_state, while the live ranks are still in their
// collective or in recover(). Every op completes at once with this rank's own data (a broadcast
// or an all-reduce leaves the tensors as they are, an all-gather copies the input into every
// slot), so that the constructors a script runs before sync_state (DDP's parameter check and
// broadcast, DeviceMesh) need no peer; sync_state then swaps a real backend in (swap_inner) and
// overwrites what these ops produced with a live rank's state. Point-to-point ops are refused.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "c10d_ops.h"

#include <string>
#include <vector>

namespace fastdist::watched {

class SoloBackend : public c10d::Backend {
 public:
  SoloBackend(int rank, int size, std::string name)
      : c10d::Backend(rank, size), name_(std::move(name)), options_(c10::make_intrusive<Options>(name_)) {}

  const std::string getBackendName() const override { return name_; }
  // torch sets the group's name and ranks on a new backend's options (from 2.14, `options` is a
  // property that reads this).
  c10::intrusive_ptr<Options> getBackendOptions() override { return options_; }
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return 0; }

  FASTDIST_C10D_OPS
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override {}

 private:
  const std::string name_;
  c10::intrusive_ptr<Options> options_;
};

}  // namespace fastdist::watched
