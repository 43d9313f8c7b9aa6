// Multi-stage ops: hierarchical_neighbor_allreduce as one op of the core (BlueFog's
// semantics, docs/reference/bluefog-semantics.md §1.6). Its stages are ops of their own, named
// after it ("<name>.machine_sum", ".exchange", ".share"), so ranks match, negotiate, fuse
// and cache them like any op; each is queued when the one before completes, and the op's
// one handle completes after the last. On host memory the exchange moves all the data,
// sharded over the machine (neighbor/sharded_exchange.h); on CUDA tensors each stage moves
// it, and the result is divided by local_size() at the end.
#include "ops/stages.h"

#include "common/reduce.h"
#include "gpu/staging.h"

namespace shoal {

struct Stages {
  EntryPtr op;                 // what the caller holds
  std::vector<EntryPtr> rest;  // stages not queued yet, in order
};

EntryPtr HierarchicalStages::Start(const EntryPtr& e) const {
  const WorldInfo& w = world_;
  auto stages = std::make_shared<Stages>();
  stages->op = e;
  for (auto& [op, suffix, scope] : kHierarchicalStages) {
    auto s = std::make_shared<Entry>();
    s->sig = e->sig;
    s->sig.op = op;
    s->sig.scope = scope;  // share: broadcast from local rank 0
    s->name = e->name + suffix;
    s->input = s->output = e->output;  // in place, after the machine sum
    stages->rest.push_back(std::move(s));
  }
  Entry& sum = *stages->rest[0];
  sum.input = e->input;
  sum.sig.reduce_op = SHOAL_REDUCE_SUM;
  sum.gpu = std::move(e->gpu);  // the producer's point on the caller's stream, taken at the call
  Entry& exchange = *stages->rest[1];
  exchange.topo_check = e->topo_check;
  // Host memory: the exchange does the op (neighbor/sharded_exchange.h), local rank l with
  // local rank l of each neighbor machine; the machine's stages only negotiate (their
  // signatures keep the shape, so the machine's ranks still agree on it). CUDA tensors:
  // the machine's sum (NCCL or MPI), the exchange between local ranks 0, the broadcast.
  const bool sharded = e->sig.device_type != SHOAL_DEVICE_CUDA;
  if (sharded) {
    sum.span = stages->rest[2]->span = 0;
    exchange.input = e->input;
  }
  if (sharded || w.local_rank == 0) {  // machine m's local rank l is rank m * local_size() + l
    const int l = sharded ? w.local_rank : 0;
    for (int m : e->recv_ranks) exchange.recv_ranks.push_back(m * w.local_size + l);
    for (int m : e->send_ranks) exchange.send_ranks.push_back(m * w.local_size + l);
    exchange.recv_weights = e->recv_weights;
    exchange.send_weights = e->send_weights;
    exchange.self_weight = e->self_weight;
    exchange.uniform = e->uniform;
  }  // else no peers: it only takes part in the exchange's negotiation
  EntryPtr first = stages->rest.front();
  stages->rest.erase(stages->rest.begin());
  first->stages = std::move(stages);
  return first;
}

void HierarchicalStages::Next(const EntryPtr& s, const Status& st_in) {
  std::shared_ptr<Stages> stages = std::move(s->stages);
  const EntryPtr op = stages->op;
  Status st = st_in;
  EntryPtr next;
  if (st.ok() && !stages->rest.empty()) {
    next = stages->rest.front();
    stages->rest.erase(stages->rest.begin());
    if (op->sig.device_type == SHOAL_DEVICE_CUDA) {
      // After the stage before: its completion ordered the caller's stream after its result.
      shoal_op_desc d{};
      d.op = next->sig.op;
      d.input = {op->output.data, op->sig.dtype, 0, nullptr, op->output.device_type, op->output.device_id,
                 op->output.stream, nullptr};
      d.output = d.input;
      try {
        next->gpu = CaptureGpuOp(d, next->nbytes());
      } catch (const ArgumentError& ex) {
        st = Status::Error(SHOAL_ABORTED, OpError(next->sig.op, next->name, ex.what()));
        stages->rest.insert(stages->rest.begin(), next);
        next = nullptr;
      }
    }
  }
  if (next) {
    next->stages = std::move(stages);
    return host_->AfterStage(s, next, Status::Ok(), {});
  }
  // The ranks waiting for this op's later stages fail with it instead of waiting. A
  // refusal at the call (the refusing rank refused every stage: Runtime::Reject) with that
  // very error, so each stage's ranks get it whichever refusal their coordinator hears first
  // (the machine's stages and the exchange have coordinators of their own: docs/design.md §19).
  Status failed = st;
  if (!st.ok() && st.code != SHOAL_INVALID_ARGUMENT && st.code != SHOAL_INVALID_TYPE)
    failed = Status::Error(SHOAL_ABORTED, OpError(op->sig.op, op->name, "an earlier stage failed on rank " +
                                                                            std::to_string(world_.rank) + ": " + st.message));
  host_->AfterStage(s, nullptr, failed, stages->rest);
  // The sharded exchange divided each piece as it went.
  const bool divided = op->sig.device_type != SHOAL_DEVICE_CUDA;
  host_->Finish(op, st.ok() && !divided ? DivideResult(*op, world_.local_size) : st);
}

Status HierarchicalStages::DivideResult(const Entry& e, int divisor) {
  if (e.sig.device_type != SHOAL_DEVICE_CUDA) {
    Divide(e.output.data, e.output.data, e.sig.dtype, e.count(), divisor);
    return Status::Ok();
  }
  // On the caller's stream, which the last stage's completion ordered after the result.
  std::string why;
  const shoal_cuda_api* api = CudaPlugin(&why);
  const char* err = api ? api->set_device(e.output.device_id) : why.c_str();
  if (!err) err = api->scale(e.output.data, e.output.data, divisor, 1, e.sig.dtype, e.count(), e.output.stream);
  if (!err) return Status::Ok();
  return Status::Error(SHOAL_ABORTED, OpError(e.sig.op, e.name, std::string("CUDA: ") + err));
}

}  // namespace shoal
