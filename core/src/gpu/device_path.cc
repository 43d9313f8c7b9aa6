#include "gpu/device_path.h"

#include <algorithm>
#include <cstring>

#include "ops/collectives.h"

namespace shoal {

void DevicePath::Stage(const EntryPtr& e, std::vector<Request>* to_coordinator) {
  if (!gpu_) gpu_ = std::make_unique<GpuStaging>(e->gpu->api);
  GpuOp& g = *e->gpu;
  const int op = e->sig.op, dt = e->sig.dtype;
  // The path follows from this rank's settings alone and is part of the signature, so
  // ranks that disagree get the same mismatch error. NCCL takes the collectives it can
  // sum, and neighbor ops (device_plane.h); a CUDA-aware MPI takes neighbor ops.
  const bool neighbor = op == SHOAL_OP_NEIGHBOR_ALLREDUCE || op == SHOAL_OP_NEIGHBOR_ALLGATHER;
  const bool nccl = cfg_.gpu_backend == "nccl" && g.api->has_nccl;
  if (neighbor) {
    g.direct = nccl || (cfg_.cuda_aware_mpi && g.api->mpi_cuda_aware(nullptr));
    e->sig.path = !g.direct ? kPathStaged : nccl ? kPathNccl : kPathMpi;
  } else {  // a process set's collectives are staged (NCCL's communicators here span every rank)
    // Integers under Horovod's scaling are staged too (the device's scale kernel computes
    // floating types only), whatever this rank's factors: ranks may pass different ones.
    const bool truncated = !IsFloating(dt) && e->horovod_scaling;
    g.nccl = nccl && e->set == 0 && (op == SHOAL_OP_BROADCAST || op == SHOAL_OP_ALLGATHER || op == SHOAL_OP_ALLTOALL ||
                      ((op == SHOAL_OP_ALLREDUCE || op == SHOAL_OP_REDUCESCATTER) && dt != SHOAL_INT16 &&
                       dt != SHOAL_BOOL && !truncated));
    e->sig.path = g.nccl ? kPathNccl : kPathStaged;
  }
  if (std::string(g.api->build).rfind("fake", 0) == 0) e->sig.path |= kFakePlugin;
  std::string why;
  if (g.direct && !plane_.Bind(g.api, g.device, gpu_.get(), &why)) {
    // Refused like a bad argument at the call: the peers get the same error.
    e->reject = std::string(OpName(op)) + ": " + why;
    e->reject_code = SHOAL_INVALID_ARGUMENT;
    g.direct = false;
    host_->Route(e, to_coordinator);
    return host_->Finish(e, Status::Error(SHOAL_INVALID_ARGUMENT, e->reject));
  }
  Status st = gpu_->Start(e);
  if (!st.ok()) host_->Finish(e, st);
}

bool DevicePath::Poll(std::vector<Request>* to_coordinator) {
  if (!gpu_) return false;
  std::vector<std::pair<EntryPtr, Status>> failed;
  auto ready = gpu_->Ready(&failed);
  for (auto& e : ready) host_->Route(e, to_coordinator);
  for (auto& f : failed) host_->Finish(f.first, f.second);
  bool nccl_done = false;
  for (auto& kv : nccl_) nccl_done |= kv.second->Progress();
  std::vector<std::pair<EntryPtr, Status>> device_done;
  bool device = plane_.Poll(&device_done);
  for (auto& d : device_done) host_->Finish(d.first, d.second);
  gpu_->Retire();
  return !ready.empty() || !failed.empty() || nccl_done || device;
}

Status DevicePath::Complete(Entry& e, const Status& st) {
  if (e.gpu->direct && !st.ok() && gpu_) {
    // Sends of this entry may still be queued on the device plane's streams.
    const char* err = nullptr;
    if (void* s = gpu_->Stream(e.gpu->device, &err)) plane_.Fence(e, s);
  }
  return gpu_ ? gpu_->Complete(e, st) : st;
}

bool DevicePath::Busy() const {
  if (gpu_ && !gpu_->Idle()) return true;
  for (auto& kv : nccl_)
    if (kv.second->num_in_flight() > 0) return true;
  return !plane_.Idle();
}

void DevicePath::Stop() {
  plane_.Stop();
  for (auto& kv : nccl_) kv.second->Stop();
}

void DevicePath::Run(const Response& r, const std::vector<EntryPtr>& batch) {
  const WorldInfo& w = backend_->world();
  const int device = batch[0]->gpu->device;
  auto& engine = nccl_[device];
  if (!engine) engine = std::make_unique<NcclBackend>(backend_, gpu_.get(), batch[0]->gpu->api, device);
  const char* err = nullptr;
  void* stream = gpu_->Stream(device, &err);
  for (const EntryPtr& e : batch) {
    const GpuOp& g = *e->gpu;
    auto done = [this, e](const Status& st) {
      e->t_comm_end = Clock::now();
      if (st.ok()) return host_->Finish(e, st);
      host_->Finish(e, Status::Error(st.code, OpError(e->sig.op, e->name, st.message)));
    };
    if (err) {
      done(Status::Error(SHOAL_ABORTED, std::string("CUDA: ") + err));
      continue;
    }
    if (g.device != device) {
      done(Status::Error(SHOAL_ABORTED, "NCCL: tensors of one fused batch are on different devices"));
      continue;
    }
    const int dtype = e->sig.dtype, scope = e->sig.scope;
    if (r.op == SHOAL_OP_ALLTOALL) {  // the result in host memory, as on the CPU path
      std::vector<int64_t> send, recv;
      bool any = false;
      const std::string bad = AlltoallCounts(r, *e, w.size, w.rank, &send, &recv, &any);
      if (!bad.empty()) done(Status::Error(SHOAL_ABORTED, "internal error: " + bad));
      else if (!any) done(Status::Ok());
      else engine->Alltoallv(g.dev_in, send, e->result, recv, dtype, done);
      continue;
    }
    if (r.op == SHOAL_OP_ALLGATHER || r.op == SHOAL_OP_REDUCESCATTER) {
      // Results in host memory, as on the CPU path (the binding moves them).
      std::vector<int64_t> counts = r.op == SHOAL_OP_ALLGATHER ? GatherCounts(*e, r.first_dims[0]) : ScatterCounts(*e, w.size, w.rank);
      if (e->count() == 0 && r.op == SHOAL_OP_REDUCESCATTER) {
        done(Status::Ok());
        continue;
      }
      if (e->result_nbytes == 0) {
        done(Status::Ok());
        continue;
      }
      if (r.op == SHOAL_OP_ALLGATHER) engine->Allgatherv(g.dev_in, e->count(), e->result, counts, dtype, done);
      else engine->ReduceScatter(g.dev_in, e->result, counts, dtype, e->sig.reduce_op, e->prescale, e->postscale, done);
      continue;
    }
    const int me = scope == SHOAL_SCOPE_MACHINE ? w.local_rank : w.rank;
    const bool copy = g.dev_out != g.dev_in && g.nbytes && (r.op == SHOAL_OP_ALLREDUCE || me == e->sig.root_rank);
    const char* e_copy = copy ? gpu_->api()->memcpy_async(g.dev_out, g.dev_in, g.nbytes, stream) : nullptr;
    if (e_copy || e->count() == 0) {
      done(e_copy ? Status::Error(SHOAL_ABORTED, std::string("CUDA: ") + e_copy) : Status::Ok());
    } else if (r.op == SHOAL_OP_BROADCAST) {
      engine->Broadcast(g.dev_out, e->count(), dtype, e->sig.root_rank, scope, done);
    } else {
      engine->Allreduce(g.dev_out, e->count(), dtype, e->sig.reduce_op, scope, e->prescale, e->postscale, done);
    }
  }
}

}  // namespace shoal
