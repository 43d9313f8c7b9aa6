// TensorFlow kernels for Shoal's ops: AsyncOpKernels over the C ABI of libshoal.so.
// Compiled against the installed TensorFlow on first import (see _build.py), so a
// TensorFlow upgrade gets a matching library instead of a crash.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "shoal/c_api.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace shoal_tf {
using namespace tensorflow;

int DtypeCode(DataType t) {
  switch (t) {
    case DT_HALF: return SHOAL_FLOAT16;
    case DT_BFLOAT16: return SHOAL_BFLOAT16;
    case DT_FLOAT: return SHOAL_FLOAT32;
    case DT_DOUBLE: return SHOAL_FLOAT64;
    case DT_INT8: return SHOAL_INT8;
    case DT_UINT8: return SHOAL_UINT8;
    case DT_INT16: return SHOAL_INT16;
    case DT_INT32: return SHOAL_INT32;
    case DT_INT64: return SHOAL_INT64;
    case DT_BOOL: return SHOAL_BOOL;
    default: return -1;
  }
}

// The op's outcome as a TensorFlow status (InvalidArgument: a ValueError when eager).
Status FromShoal(int status, const char* message) {
  if (status == SHOAL_INVALID_ARGUMENT || status == SHOAL_DUPLICATE_NAME || status == SHOAL_INVALID_TYPE)
    return errors::InvalidArgument(message);
  if (status == SHOAL_NEIGHBOR_MISMATCH) return errors::Aborted("ShoalError: NeighborPatternError: ", message);
  if (status == SHOAL_RANK_LOST) return errors::Aborted("ShoalError: RankLostError: ", message);
  if (status != SHOAL_OK) return errors::Aborted("ShoalError: ", message);
  return OkStatus();
}

// Output `index` from a core-allocated result (gathers: its shape is known only now).
Status TakeGathered(OpKernelContext* ctx, int64_t handle, int index) {
  void* data = nullptr;
  size_t nbytes = 0;
  int32_t ndim = 0;
  int64_t dims[32];
  if (shoal_take_result(handle, &data, &nbytes, &ndim, dims) != SHOAL_OK)
    return errors::Internal("Shoal: result of a gather is missing");
  TensorShape shape;
  for (int i = 0; i < ndim; ++i) shape.AddDim(dims[i]);
  Tensor* out = nullptr;
  Status st = ctx->allocate_output(index, shape, &out);
  if (st.ok() && nbytes) std::memcpy(out->data(), data, nbytes);
  shoal_free_buffer(data);
  return st;
}

// Output 1 of an alltoall: the rows received from each rank (int32, Horovod's).
Status TakeReceivedSplits(OpKernelContext* ctx, int64_t handle) {
  std::vector<int64_t> v(shoal_size() > 0 ? shoal_size() : 1);
  int32_t n = 0;
  if (shoal_received_splits(handle, v.data(), static_cast<int32_t>(v.size()), &n) != SHOAL_OK)
    return errors::Internal("Shoal: the received splits of an alltoall are missing");
  Tensor* out = nullptr;
  TF_RETURN_IF_ERROR(ctx->allocate_output(1, TensorShape({n}), &out));
  for (int32_t i = 0; i < n; ++i) out->flat<int32>()(i) = static_cast<int32>(v[i]);
  return OkStatus();
}

// Lives from enqueue until the core's completion callback.
struct Pending {
  OpKernelContext* ctx;
  AsyncOpKernel::DoneCallback done;
  Tensor input;  // keeps the input buffer alive
  bool gather;
  DataType dtype;
  bool splits;  // alltoall: output 1 is the received splits
};

void OnComplete(int64_t handle, int status, const char* message, void* arg) {
  Pending* p = static_cast<Pending*>(arg);
  Status st = FromShoal(status, message);
  if (st.ok() && p->gather) st = TakeGathered(p->ctx, handle, 0);
  if (st.ok() && p->splits) st = TakeReceivedSplits(p->ctx, handle);
  if (!st.ok()) p->ctx->SetStatus(st);
  shoal_release(handle);
  AsyncOpKernel::DoneCallback done = std::move(p->done);
  delete p;
  done();
}

std::vector<int32_t> Ranks(const Tensor& t) {
  auto v = t.flat<int32>();
  return std::vector<int32_t>(v.data(), v.data() + v.size());
}

std::vector<double> Weights(const Tensor& t) {
  auto v = t.flat<double>();
  return std::vector<double>(v.data(), v.data() + v.size());
}

// The part of an op's description its kernel fixes, from the node's attributes: the op,
// its name (kept in `name`, which must outlive `d`) and whichever of reduce op, scope, root,
// weights mode, topology check, process set and Horovod's scaling the op has.
Status FixedPart(OpKernelConstruction* c, int op, std::string* name, shoal_op_desc* d) {
  *d = shoal_op_desc{};
  d->op = op;
  TF_RETURN_IF_ERROR(c->GetAttr("op_name", name));
  d->name = name->c_str();
  for (auto [attr, field] : {std::pair<const char*, int32_t*>{"reduce_op", &d->reduce_op}, {"scope", &d->scope},
                             {"root_rank", &d->root_rank}, {"process_set", &d->process_set}})
    if (c->HasAttr(attr)) TF_RETURN_IF_ERROR(c->GetAttr(attr, field));
  bool uniform = true, topo_check = false;
  if (c->HasAttr("uniform")) TF_RETURN_IF_ERROR(c->GetAttr("uniform", &uniform));
  if (c->HasAttr("topo_check")) TF_RETURN_IF_ERROR(c->GetAttr("topo_check", &topo_check));
  d->uniform = uniform;
  d->topo_check = topo_check;
  if (c->HasAttr("horovod_scaling")) {
    // The factors as the text of a double (TensorFlow's float attributes are 32-bit).
    bool scaling = false;
    std::string pre, post;
    TF_RETURN_IF_ERROR(c->GetAttr("horovod_scaling", &scaling));
    TF_RETURN_IF_ERROR(c->GetAttr("prescale", &pre));
    TF_RETURN_IF_ERROR(c->GetAttr("postscale", &post));
    d->horovod_scaling = scaling;
    d->prescale_factor = std::strtod(pre.c_str(), nullptr);
    d->postscale_factor = std::strtod(post.c_str(), nullptr);
  }
  return OkStatus();
}

class ShoalKernel : public AsyncOpKernel {
 public:
  explicit ShoalKernel(OpKernelConstruction* c, int op) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, FixedPart(c, op, &name_, &base_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& in = ctx->input(0);
    const int code = DtypeCode(in.dtype());
    OP_REQUIRES_ASYNC(ctx, code >= 0, errors::InvalidArgument("Shoal: unsupported dtype ", DataTypeString(in.dtype())), done);
    // Ops whose result the core allocates (its shape known only at completion).
    const bool gather = base_.op == SHOAL_OP_ALLGATHER || base_.op == SHOAL_OP_NEIGHBOR_ALLGATHER ||
                        base_.op == SHOAL_OP_REDUCESCATTER || base_.op == SHOAL_OP_ALLTOALL;
    Tensor* out = nullptr;
    if (!gather) OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, in.shape(), &out), done);
    std::vector<int64_t> shape(in.dims());
    for (int i = 0; i < in.dims(); ++i) shape[i] = in.dim_size(i);
    std::vector<int32_t> recv, send;
    std::vector<double> recv_w, send_w;
    shoal_op_desc d = base_;
    d.input.data = const_cast<void*>(static_cast<const void*>(in.tensor_data().data()));
    d.input.dtype = code;
    d.input.ndim = in.dims();
    d.input.shape = shape.data();
    d.output = d.input;
    d.output.data = out ? const_cast<char*>(out->tensor_data().data()) : nullptr;
    if (base_.op == SHOAL_OP_NEIGHBOR_ALLREDUCE || base_.op == SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE) {
      d.self_weight = ctx->input(1).scalar<double>()();
      recv = Ranks(ctx->input(2));
      recv_w = Weights(ctx->input(3));
      send = Ranks(ctx->input(4));
      send_w = Weights(ctx->input(5));
    } else if (base_.op == SHOAL_OP_NEIGHBOR_ALLGATHER) {
      recv = Ranks(ctx->input(1));
      send = Ranks(ctx->input(2));
    }
    std::vector<int64_t> splits;  // alltoall: none (even) or one per rank
    if (base_.op == SHOAL_OP_ALLTOALL) {
      auto v = ctx->input(1).flat<int64>();
      splits.assign(v.data(), v.data() + v.size());
      d.n_splits = static_cast<int32_t>(splits.size());
      d.splits = splits.empty() ? nullptr : splits.data();
    }
    d.n_recv = static_cast<int32_t>(recv.size());
    d.recv_ranks = recv.data();
    d.recv_weights = recv_w.empty() ? nullptr : recv_w.data();
    d.n_send = static_cast<int32_t>(send.size());
    d.send_ranks = send.data();
    d.send_weights = send_w.empty() ? nullptr : send_w.data();
    auto* p = new Pending{ctx, done, in, gather, in.dtype(), base_.op == SHOAL_OP_ALLTOALL};
    char err[2048];
    int64_t handle = 0;
    int rc = shoal_enqueue_with_callback(&d, OnComplete, p, &handle, err, sizeof err);
    if (rc != SHOAL_OK) {  // the callback will not run
      delete p;
      ctx->SetStatus(errors::InvalidArgument(err));
      done();
    }
  }

 private:
  std::string name_;
  shoal_op_desc base_{};  // its op code, name and attributes
};

// A grouped op (shoal_enqueue_group): one input and one output per member; the kernel is
// done when every member's callback has run.
struct GroupPending {
  OpKernelContext* ctx;
  AsyncOpKernel::DoneCallback done;
  std::vector<Tensor> inputs;  // keep the input buffers alive
  bool gather;
  std::atomic<int> left;
  std::mutex mu;  // SetStatus
  std::vector<std::pair<GroupPending*, int>> members;  // the callbacks' args: (group, index)
};

void OnMemberComplete(int64_t handle, int status, const char* message, void* arg) {
  auto* m = static_cast<std::pair<GroupPending*, int>*>(arg);
  GroupPending* g = m->first;
  Status st = FromShoal(status, message);
  if (st.ok() && g->gather) st = TakeGathered(g->ctx, handle, m->second);
  if (!st.ok()) {
    std::lock_guard<std::mutex> lock(g->mu);
    g->ctx->SetStatus(st);
  }
  shoal_release(handle);
  if (--g->left > 0) return;
  AsyncOpKernel::DoneCallback done = std::move(g->done);
  delete g;
  done();
}

class ShoalGroupKernel : public AsyncOpKernel {
 public:
  ShoalGroupKernel(OpKernelConstruction* c, int op) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, FixedPart(c, op, &name_, &base_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const int n = ctx->num_inputs();
    OP_REQUIRES_ASYNC(ctx, n > 0, errors::InvalidArgument("Shoal: a grouped op needs at least one tensor"), done);
    const bool gather = base_.op != SHOAL_OP_ALLREDUCE;
    auto* g = new GroupPending{ctx, done, {}, gather, {n}, {}, {}};
    std::vector<std::vector<int64_t>> shapes(n);
    std::vector<shoal_op_desc> descs(n);
    Status st;
    for (int i = 0; i < n && st.ok(); ++i) {
      const Tensor& in = ctx->input(i);
      g->inputs.push_back(in);
      const int code = DtypeCode(in.dtype());
      if (code < 0) st = errors::InvalidArgument("Shoal: unsupported dtype ", DataTypeString(in.dtype()));
      Tensor* out = nullptr;
      if (st.ok() && !gather) st = ctx->allocate_output(i, in.shape(), &out);
      for (int k = 0; k < in.dims(); ++k) shapes[i].push_back(in.dim_size(k));
      shoal_op_desc& d = descs[i];
      d = base_;
      d.input.data = const_cast<void*>(static_cast<const void*>(in.tensor_data().data()));
      d.input.dtype = code;
      d.input.ndim = in.dims();
      d.input.shape = shapes[i].data();
      d.output = d.input;
      d.output.data = out ? const_cast<char*>(out->tensor_data().data()) : nullptr;
      g->members.push_back({g, i});
    }
    std::vector<void*> args(n);
    for (int i = 0; i < n && st.ok(); ++i) args[i] = &g->members[i];
    std::vector<int64_t> handles(n);
    char err[2048];
    if (st.ok() && shoal_enqueue_group(name_.c_str(), descs.data(), n, OnMemberComplete, args.data(), handles.data(),
                                       err, sizeof err) != SHOAL_OK)
      st = errors::InvalidArgument(err);
    if (!st.ok()) {  // no callback will run
      delete g;
      ctx->SetStatus(st);
      done();
    }
  }

 private:
  std::string name_;
  shoal_op_desc base_{};  // its op code, name and attributes
};

#define SHOAL_KERNEL(Kind, code)                                                      \
  class Kind##Op : public ShoalKernel {                                               \
   public:                                                                            \
    explicit Kind##Op(OpKernelConstruction* c) : ShoalKernel(c, code) {}              \
  };                                                                                  \
  REGISTER_KERNEL_BUILDER(Name("Shoal" #Kind).Device(DEVICE_CPU), Kind##Op);

SHOAL_KERNEL(Allreduce, SHOAL_OP_ALLREDUCE)
SHOAL_KERNEL(Broadcast, SHOAL_OP_BROADCAST)
SHOAL_KERNEL(Allgather, SHOAL_OP_ALLGATHER)
SHOAL_KERNEL(NeighborAllreduce, SHOAL_OP_NEIGHBOR_ALLREDUCE)
SHOAL_KERNEL(NeighborAllgather, SHOAL_OP_NEIGHBOR_ALLGATHER)
SHOAL_KERNEL(Reducescatter, SHOAL_OP_REDUCESCATTER)
SHOAL_KERNEL(HierarchicalNeighborAllreduce, SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE)
SHOAL_KERNEL(Alltoall, SHOAL_OP_ALLTOALL)

#define SHOAL_GROUP_KERNEL(Kind, code)                                                \
  class Grouped##Kind##Op : public ShoalGroupKernel {                                 \
   public:                                                                            \
    explicit Grouped##Kind##Op(OpKernelConstruction* c) : ShoalGroupKernel(c, code) {} \
  };                                                                                  \
  REGISTER_KERNEL_BUILDER(Name("ShoalGrouped" #Kind).Device(DEVICE_CPU), Grouped##Kind##Op);

SHOAL_GROUP_KERNEL(Allreduce, SHOAL_OP_ALLREDUCE)
SHOAL_GROUP_KERNEL(Allgather, SHOAL_OP_ALLGATHER)
SHOAL_GROUP_KERNEL(Reducescatter, SHOAL_OP_REDUCESCATTER)

#define SHOAL_TYPES "T: {half, bfloat16, float, double, int8, uint8, int16, int32, int64, bool}"

Status SameShape(shape_inference::InferenceContext* c) {
  c->set_output(0, c->input(0));
  return OkStatus();
}

Status GatherShape(shape_inference::InferenceContext* c) {
  shape_inference::ShapeHandle out;
  TF_RETURN_IF_ERROR(c->ReplaceDim(c->input(0), 0, c->UnknownDim(), &out));
  c->set_output(0, out);
  return OkStatus();
}

// process_set: shoal_op_desc's (0: every rank); horovod_scaling and the factors: its
// Horovod's scaling.
#define SHOAL_SCALING Attr("horovod_scaling: bool = false").Attr("prescale: string = '1.0'").Attr("postscale: string = '1.0'")
REGISTER_OP("ShoalAllreduce").Attr(SHOAL_TYPES).Attr("op_name: string").Attr("reduce_op: int")
    .Attr("scope: int = 0").Attr("process_set: int = 0").SHOAL_SCALING.Input("tensor: T").Output("sum: T")
    .SetShapeFn(SameShape);
REGISTER_OP("ShoalBroadcast").Attr(SHOAL_TYPES).Attr("op_name: string").Attr("root_rank: int")
    .Attr("scope: int = 0").Attr("process_set: int = 0").Input("tensor: T").Output("output: T")
    .SetShapeFn(SameShape);
REGISTER_OP("ShoalAllgather").Attr(SHOAL_TYPES).Attr("op_name: string").Attr("process_set: int = 0")
    .Input("tensor: T").Output("output: T").SetShapeFn(GatherShape);
REGISTER_OP("ShoalReducescatter").Attr(SHOAL_TYPES).Attr("op_name: string").Attr("reduce_op: int")
    .Attr("process_set: int = 0").SHOAL_SCALING.Input("tensor: T").Output("output: T").SetShapeFn(GatherShape);

REGISTER_OP("ShoalAlltoall").Attr(SHOAL_TYPES).Attr("op_name: string").Attr("process_set: int = 0")
    .Input("tensor: T").Input("splits: int64")
    .Output("output: T").Output("received_splits: int32").SetShapeFn([](shape_inference::InferenceContext* c) {
      TF_RETURN_IF_ERROR(GatherShape(c));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return OkStatus();
    });

#define SHOAL_LIST_TYPES "T: list({half, bfloat16, float, double, int8, uint8, int16, int32, int64, bool})"

Status EachSameShape(shape_inference::InferenceContext* c) {
  for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
  return OkStatus();
}

Status EachGatherShape(shape_inference::InferenceContext* c) {
  for (int i = 0; i < c->num_inputs(); ++i) {
    shape_inference::ShapeHandle out;
    TF_RETURN_IF_ERROR(c->ReplaceDim(c->input(i), 0, c->UnknownDim(), &out));
    c->set_output(i, out);
  }
  return OkStatus();
}

// A grouped op: one input and one output per member, of any dtypes.
#define SHOAL_GROUPED_OP(Name) \
  REGISTER_OP(Name).Attr(SHOAL_LIST_TYPES).Attr("op_name: string").Attr("process_set: int = 0")   \
      .Input("tensors: T").Output("outputs: T")
SHOAL_GROUPED_OP("ShoalGroupedAllreduce").Attr("reduce_op: int").Attr("scope: int = 0").SHOAL_SCALING
    .SetShapeFn(EachSameShape);
SHOAL_GROUPED_OP("ShoalGroupedAllgather").SetShapeFn(EachGatherShape);
SHOAL_GROUPED_OP("ShoalGroupedReducescatter").Attr("reduce_op: int").SHOAL_SCALING.SetShapeFn(EachGatherShape);
// Neighbor averaging over ranks, and the hierarchical op's over machines (ranks: machine ids).
#define SHOAL_NEIGHBOR_OP(Name)                                                                       \
  REGISTER_OP(Name).Attr(SHOAL_TYPES).Attr("op_name: string").Attr("uniform: bool").Attr("topo_check: bool") \
      .Input("tensor: T").Input("self_weight: double").Input("recv_ranks: int32")                    \
      .Input("recv_weights: double").Input("send_ranks: int32").Input("send_weights: double")        \
      .Output("output: T").SetShapeFn(SameShape)
SHOAL_NEIGHBOR_OP("ShoalNeighborAllreduce");
SHOAL_NEIGHBOR_OP("ShoalHierarchicalNeighborAllreduce");
REGISTER_OP("ShoalNeighborAllgather").Attr(SHOAL_TYPES).Attr("op_name: string").Attr("topo_check: bool")
    .Input("tensor: T").Input("recv_ranks: int32").Input("send_ranks: int32").Output("output: T")
    .SetShapeFn(GatherShape);

}  // namespace shoal_tf
