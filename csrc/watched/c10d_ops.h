// The c10d::Backend ops that each of fastdist's backends overrides (WatchedBackend, SoloBackend,
// and the tests' doubles): the one list of their declarations, so that an op torch adds is added once.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#define FASTDIST_C10D_OPS                                                                                           \
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts)     \
      override;                                                                                                     \
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts)     \
      override;                                                                                                     \
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,                                 \
                                                  const c10d::AllreduceOptions& opts) override;                     \
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,                              \
                                                     const c10d::AllreduceCoalescedOptions& opts) override;         \
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override; \
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,                           \
                                           std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts)     \
      override;                                                                                                     \
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,                             \
                                                 const c10d::AllgatherOptions& opts) override;                      \
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,                 \
                                                     std::vector<at::Tensor>& inputs,                               \
                                                     const c10d::AllgatherOptions& opts) override;                  \
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(                                                   \
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts)         \
      override;                                                                                                     \
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,                              \
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override; \
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,                                          \
                                         std::vector<std::vector<at::Tensor>>& inputs,                              \
                                         const c10d::ScatterOptions& opts) override;                                \
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,                                   \
                                                std::vector<std::vector<at::Tensor>>& inputs,                       \
                                                const c10d::ReduceScatterOptions& opts) override;                   \
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,                        \
                                                      const c10d::ReduceScatterOptions& opts) override;             \
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(                                                   \
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts)    \
      override;                                                                                                     \
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,                               \
                                               std::vector<int64_t>& outputSplitSizes,                              \
                                               std::vector<int64_t>& inputSplitSizes,                               \
                                               const c10d::AllToAllOptions& opts) override;                         \
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,        \
                                          const c10d::AllToAllOptions& opts) override;                              \
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;             \
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;             \
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;                 \
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
