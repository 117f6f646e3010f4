#pragma once

// A process group that passes every operation to another one (internal to the comm layer): the
// base of the groups that add something to Gloo's (named failures, shared memory on one host).

#include <utility>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "sigpipe_blocked.h"

namespace distoptim {
namespace comm {

/// Forwards every operation to `inner` and hands the Work it returns to `collective` or
/// `point_to_point`, which subclasses override to wrap it. Issuing follows c10d's contract (one
/// thread at a time, the same order on every member).
class ForwardingProcessGroup : public c10d::ProcessGroup {
 public:
  explicit ForwardingProcessGroup(c10::intrusive_ptr<c10d::ProcessGroup> inner)
      : c10d::ProcessGroup(inner->getRank(), inner->getSize()), inner_(std::move(inner)) {}

  const std::string getBackendName() const override { return inner_->getBackendName(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    return collective("broadcast", inner_->broadcast(tensors, opts));
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    return collective("allreduce", inner_->allreduce(tensors, opts));
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    return collective("allreduce_coalesced", inner_->allreduce_coalesced(tensors, opts));
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    return collective("reduce", inner_->reduce(tensors, opts));
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    return collective("allgather", inner_->allgather(outputs, inputs, opts));
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    return collective("allgather", inner_->_allgather_base(output, input, opts));
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override {
    return collective("allgather_coalesced", inner_->allgather_coalesced(outputs, inputs, opts));
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    return collective("gather", inner_->gather(outputs, inputs, opts));
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    return collective("scatter", inner_->scatter(outputs, inputs, opts));
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    return collective("reduce_scatter", inner_->reduce_scatter(outputs, inputs, opts));
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    return collective("reduce_scatter", inner_->_reduce_scatter_base(output, input, opts));
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override {
    return collective("alltoall", inner_->alltoall_base(output, input, output_split_sizes,
                                                        input_split_sizes, opts));
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    return collective("alltoall", inner_->alltoall(outputs, inputs, opts));
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return collective("barrier", inner_->barrier(opts));
  }

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    inner_->monitoredBarrier(opts, wait_all_ranks);
  }
  void setSequenceNumberForGroup() override { inner_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return inner_->getSequenceNumberForGroup(); }

  // Gloo may write to the peer's socket on the caller's thread as a send or receive is issued.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override {
    const detail::SigpipeBlocked sigpipe_blocked;
    return point_to_point("send to", dst_rank, inner_->send(tensors, dst_rank, tag));
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override {
    const detail::SigpipeBlocked sigpipe_blocked;
    return point_to_point("recv from", src_rank, inner_->recv(tensors, src_rank, tag));
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    const detail::SigpipeBlocked sigpipe_blocked;
    return point_to_point("recv from any rank", kAnyPeer, inner_->recvAnysource(tensors, tag));
  }

 protected:
  /// The peer of a receive from any rank.
  static constexpr int kAnyPeer = -2;

  /// The Work of the collective `name` as the caller gets it; called only once `inner` accepted
  /// the operation (one refused on issue throws before).
  virtual c10::intrusive_ptr<c10d::Work> collective(const char* /*name*/,
                                                    c10::intrusive_ptr<c10d::Work> work) {
    return work;
  }
  /// The same for a send or receive with the group rank `peer` (kAnyPeer for any).
  virtual c10::intrusive_ptr<c10d::Work> point_to_point(const char* /*name*/, int /*peer*/,
                                                        c10::intrusive_ptr<c10d::Work> work) {
    return work;
  }

 private:
  const c10::intrusive_ptr<c10d::ProcessGroup> inner_;
};

}  // namespace comm
}  // namespace distoptim
