#include "solo.h"

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace fastdist::watched {
namespace {

// A work that has already ended, its result `tensors`.
c10::intrusive_ptr<c10d::Work> done(const std::vector<at::Tensor>& tensors) {
  auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
  fut->markCompleted(c10::IValue(tensors));
  return c10d::Work::create_from_future(fut);
}

// Every rank's slot of a flat all-gather output holds this rank's input.
void fill_slots(at::Tensor& output, const at::Tensor& input) {
  auto flat = output.view(-1);
  const auto n = input.numel();
  auto src = input.reshape(-1);
  for (int64_t off = 0; off + n <= flat.numel() && n > 0; off += n) flat.narrow(0, off, n).copy_(src);
}

// A reduction on a stand-in would complete on this process alone: a replacement that trains
// before fastdist.sync_state() gave it its slot would train alone (its gradients never reduced
// with the job's) and could save a checkpoint that is not the job's. What model set-up issues
// (DDP's broadcast and all_gather, FSDP2's first all-gathers, barriers) still completes here.
[[noreturn]] void refuse(int rank, const char* op) {
  TORCH_CHECK(false, "fastdist: rank ", rank, " is a replacement that has not joined the job yet: it cannot ", op,
              " before fastdist.sync_state() has given it its slot (its reductions would be this process's "
              "alone). Call fastdist.sync_state(state) after building the model and before the first step.");
}

void copy_if_same(at::Tensor& dst, const at::Tensor& src) {
  if (dst.numel() == src.numel() && !dst.is_same(src)) dst.view(-1).copy_(src.reshape(-1));
}

}  // namespace

c10::intrusive_ptr<c10d::Work> SoloBackend::broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions&) {
  return done(t);
}
c10::intrusive_ptr<c10d::Work> SoloBackend::allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions&) {
  refuse(rank_, "all_reduce");
}
c10::intrusive_ptr<c10d::Work> SoloBackend::allreduce_sparse(std::vector<at::Tensor>& t,
                                                             const c10d::AllreduceOptions&) {
  refuse(rank_, "all_reduce");
}
c10::intrusive_ptr<c10d::Work> SoloBackend::allreduce_coalesced(std::vector<at::Tensor>& t,
                                                                const c10d::AllreduceCoalescedOptions&) {
  refuse(rank_, "all_reduce");
}
c10::intrusive_ptr<c10d::Work> SoloBackend::reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions&) {
  refuse(rank_, "reduce");
}
c10::intrusive_ptr<c10d::Work> SoloBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions&) {
  std::vector<at::Tensor> out;
  for (std::size_t i = 0; i < outputs.size() && i < inputs.size(); ++i) {
    for (auto& slot : outputs[i]) {
      copy_if_same(slot, inputs[i]);
      out.push_back(slot);
    }
  }
  return done(out);
}
c10::intrusive_ptr<c10d::Work> SoloBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                            const c10d::AllgatherOptions&) {
  fill_slots(output, input);
  return done({output});
}
c10::intrusive_ptr<c10d::Work> SoloBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                std::vector<at::Tensor>& inputs,
                                                                const c10d::AllgatherOptions& opts) {
  return allgather(outputs, inputs, opts);
}
c10::intrusive_ptr<c10d::Work> SoloBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                            std::vector<at::Tensor>& inputs,
                                                                            const c10d::AllgatherOptions&) {
  for (std::size_t i = 0; i < outputs.size() && i < inputs.size(); ++i) fill_slots(outputs[i], inputs[i]);
  return done(outputs);
}
c10::intrusive_ptr<c10d::Work> SoloBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                   std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  return allgather(outputs, inputs, c10d::AllgatherOptions());
}
c10::intrusive_ptr<c10d::Work> SoloBackend::scatter(std::vector<at::Tensor>& outputs,
                                                    std::vector<std::vector<at::Tensor>>& inputs,
                                                    const c10d::ScatterOptions&) {
  if (!outputs.empty() && !inputs.empty() && static_cast<int>(inputs[0].size()) > rank_) {
    copy_if_same(outputs[0], inputs[0][rank_]);
  }
  return done(outputs);
}
c10::intrusive_ptr<c10d::Work> SoloBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                           std::vector<std::vector<at::Tensor>>& inputs,
                                                           const c10d::ReduceScatterOptions&) {
  refuse(rank_, "reduce_scatter");
}
c10::intrusive_ptr<c10d::Work> SoloBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::ReduceScatterOptions&) {
  refuse(rank_, "reduce_scatter");
}
c10::intrusive_ptr<c10d::Work> SoloBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                            std::vector<at::Tensor>& inputs,
                                                                            const c10d::ReduceScatterOptions& opts) {
  refuse(rank_, "reduce_scatter");
}
c10::intrusive_ptr<c10d::Work> SoloBackend::alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>&,
                                                          std::vector<int64_t>&, const c10d::AllToAllOptions&) {
  refuse(rank_, "all_to_all");
}
c10::intrusive_ptr<c10d::Work> SoloBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                     const c10d::AllToAllOptions&) {
  refuse(rank_, "all_to_all");
}
c10::intrusive_ptr<c10d::Work> SoloBackend::barrier(const c10d::BarrierOptions&) { return done({}); }

c10::intrusive_ptr<c10d::Work> SoloBackend::send(std::vector<at::Tensor>&, int, int) {
  TORCH_CHECK(false, "fastdist: a joining rank cannot send before fastdist.sync_state() has given it its slot");
}
c10::intrusive_ptr<c10d::Work> SoloBackend::recv(std::vector<at::Tensor>&, int, int) {
  TORCH_CHECK(false, "fastdist: a joining rank cannot receive before fastdist.sync_state() has given it its slot");
}
c10::intrusive_ptr<c10d::Work> SoloBackend::recvAnysource(std::vector<at::Tensor>&, int) {
  TORCH_CHECK(false, "fastdist: a joining rank cannot receive before fastdist.sync_state() has given it its slot");
}

}  // namespace fastdist::watched
