/* Shoal C ABI: the only interface between libshoal.so and its bindings.
 * No C++ types cross it; every call that can fail returns a shoal_status and
 * writes a message into a caller-provided buffer. */
#ifndef SHOAL_C_API_H_
#define SHOAL_C_API_H_
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#pragma GCC visibility push(default)
#endif

typedef enum {
  SHOAL_OK = 0,
  SHOAL_INVALID_ARGUMENT = 1, /* bad argument at the call: ValueError */
  SHOAL_MISMATCH = 2,         /* ranks disagree (shape, dtype, op, root...): ShoalError */
  SHOAL_ABORTED = 3,          /* shut down, stalled or dead peer, MPI failure: ShoalError */
  SHOAL_NOT_INITIALIZED = 4,  /* called before init() or after shutdown() */
  SHOAL_UNKNOWN_HANDLE = 5,
  SHOAL_DUPLICATE_NAME = 6,   /* a second in-flight op with the same name: ValueError */
  SHOAL_TIMEOUT = 7,          /* shoal_wait_for: not complete yet */
  SHOAL_INVALID_TYPE = 8,     /* an argument of the wrong type at the call: TypeError */
  SHOAL_NEIGHBOR_MISMATCH = 9, /* a neighbor op's send and receive ranks disagree: a ShoalError that is also a
                                 ValueError (BlueFog's), shoal.NeighborPatternError */
  SHOAL_RANK_LOST = 10        /* fault-tolerant mode: a rank of the job died; shoal_recover goes on without it:
                                 shoal.RankLostError */
} shoal_status;

typedef enum {
  SHOAL_FLOAT16 = 0, SHOAL_BFLOAT16 = 1, SHOAL_FLOAT32 = 2, SHOAL_FLOAT64 = 3,
  SHOAL_INT8 = 4, SHOAL_UINT8 = 5, SHOAL_INT16 = 6, SHOAL_INT32 = 7, SHOAL_INT64 = 8,
  SHOAL_BOOL = 9
} shoal_dtype;

typedef enum { SHOAL_DEVICE_CPU = 0, SHOAL_DEVICE_CUDA = 1 } shoal_device_type;

typedef enum {
  SHOAL_OP_ALLREDUCE = 0, SHOAL_OP_BROADCAST = 1, SHOAL_OP_ALLGATHER = 2,
  SHOAL_OP_BARRIER = 3, SHOAL_OP_NEIGHBOR_ALLREDUCE = 4, SHOAL_OP_NEIGHBOR_ALLGATHER = 5,
  SHOAL_OP_REDUCESCATTER = 6, SHOAL_OP_ALLTOALL = 7, SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE = 8
} shoal_op_type;

/* Or'ed into the op code of a grouped op (shoal_enqueue_group): e.g. the op passed to
 * shoal_reject for a grouped allreduce refused at the call. */
#define SHOAL_GROUPED 0x100

typedef enum { SHOAL_SCOPE_WORLD = 0, SHOAL_SCOPE_MACHINE = 1 } shoal_scope;

/* Element-wise over the ranks (Horovod's hvd.Sum, Average, Min, Max, Product). Average is
 * the sum divided by the number of ranks. */
typedef enum {
  SHOAL_REDUCE_SUM = 0, SHOAL_REDUCE_AVERAGE = 1, SHOAL_REDUCE_MIN = 2, SHOAL_REDUCE_MAX = 3,
  SHOAL_REDUCE_PRODUCT = 4
} shoal_reduce_op;

/* A dense, C-contiguous tensor. `stream` and `ready_event` (CUDA) let the core
 * wait for the producer without a device-wide synchronisation; CPU tensors pass NULL. */
typedef struct {
  void* data;
  int32_t dtype;        /* shoal_dtype */
  int32_t ndim;
  const int64_t* shape; /* ndim entries; ndim == 0 is a scalar */
  int32_t device_type;  /* shoal_device_type */
  int32_t device_id;
  void* stream;
  void* ready_event;
} shoal_tensor;

typedef struct {
  int32_t op;          /* shoal_op_type */
  const char* name;    /* NULL or "" for a deterministic generated name */
  shoal_tensor input;
  shoal_tensor output; /* same shape/dtype as input; may alias it. Unused by allgather,
                        * reducescatter (core-allocated results) and barrier */
  /* allreduce, reducescatter (Sum or Average). reducescatter: the reduction of every rank's
   * [d0, ...] tensor, split along dim 0 in rank order, the first d0 % size ranks one row
   * more (Horovod's split): this rank's [d0 / size (+1), ...] slice is the result. */
  int32_t reduce_op;
  int32_t root_rank;   /* broadcast: rank in the scope's communicator */
  int32_t scope;       /* allreduce, broadcast: shoal_scope (machine = the ranks of this machine) */
  /* neighbor_allreduce: receive from recv_ranks, combine
   *   uniform:  (x + sum_j x_j) / (n_recv + 1)      (sum then divide: exact)
   *   else:     self_weight * x + sum_j recv_weights[j] * x_j
   * and send x * send_weights[k] (NULL: 1.0) to send_ranks[k].
   * neighbor_allgather: receive from recv_ranks, send to send_ranks; the core-allocated
   * result is the received tensors concatenated along dim 0 in recv_ranks order. */
  int32_t n_recv;
  const int32_t* recv_ranks;
  const double* recv_weights;
  double self_weight;
  int32_t uniform;
  int32_t n_send;
  const int32_t* send_ranks;
  const double* send_weights;
  /* hierarchical_neighbor_allreduce (BlueFog's): recv_ranks, send_ranks and the weights as
   * for neighbor_allreduce, but naming machines (0 .. machine_size()-1); on a homogeneous
   * job, with S_m the sum of machine m's tensors and L = local_size(),
   *   uniform:  (S_self + sum_j S_j) / (L * (n_recv + 1))
   *   else:     (self_weight * S_self + sum_j recv_weights[j] * S_j) / L
   * on every rank of the machine. Runs as stages, each an op of its own named after the op:
   * "<name>.machine_sum" (allreduce Sum within the machine), "<name>.exchange" (neighbor
   * allreduce between the machines' local rank 0), "<name>.share" (broadcast from local
   * rank 0 within the machine), then the division; one handle. A stage that fails here
   * fails the later stages on the ranks waiting for them. */
  /* neighbor ops: have the coordinator check, for this call, that every send has a
   * matching receive (a global round trip; static topologies are checked once instead). */
  int32_t topo_check;
  /* Collectives (allreduce, broadcast, allgather, reducescatter, barrier): the process set
   * that runs it (shoal_add_process_set's id; 0: every rank). Only its members call it; names
   * are scoped per set; Average divides by the set's size; broadcast's root_rank is a world
   * rank in the set; reducescatter splits over the set's ranks in ascending order, and
   * allgather concatenates in that order. Neighbor ops and machine scope: 0 only. */
  int32_t process_set;
  /* alltoall (Horovod's): splits[q] rows of dim 0 go to rank q, in order (n_splits ==
   * size, non-negative, summing to dim 0); n_splits == 0: dim 0 / size rows each (dim 0
   * must divide). Ranks agree on dtype and the dimensions after the first. The
   * core-allocated result is the rows every rank sent here, concatenated along dim 0 in
   * rank order; shoal_received_splits says how many came from each rank. */
  int32_t n_splits;
  const int64_t* splits;
  /* allreduce, reducescatter (CPU and GPU tensors): Horovod's scaling, read when
   * horovod_scaling != 0 (a zeroed descriptor scales nothing). This rank's input is
   * multiplied by prescale_factor before the reduction and the result by postscale_factor
   * after it (after Average's division); integer tensors truncate toward zero
   * (trunc(x * factor), computed in double, as Horovod's ScaleBuffer). Average of an
   * integer tensor is allowed (refused without it): the sum divided by the scope's size
   * toward zero, or trunc(sum * postscale_factor / size) with a postscale. On the NCCL
   * path integer tensors with horovod_scaling set are staged through the host (the path is
   * part of the signature: ranks set it alike for integer tensors; their factors may differ). */
  int32_t horovod_scaling;
  double prescale_factor;
  double postscale_factor;
} shoal_op_desc;

int shoal_init(char* err, size_t err_len);
int shoal_shutdown(void);
int shoal_is_initialized(void);
/* MPI_Finalize if Shoal initialised MPI; call once at process exit. */
void shoal_finalize_mpi(void);
/* End the whole job now (MPI_Abort): for a rank that fails while its peers may be
 * blocked waiting for it. */
void shoal_abort(int exit_code);
/* This rank takes part in no more ops: every peer learns it, and ops there that need this
 * rank fail with SHOAL_ABORTED naming it instead of waiting. Later enqueues are refused.
 * Idempotent; shoal_shutdown calls it. */
void shoal_leave(void);
/* A call of `op` in `process_set` (0: every rank) refused at the call above the core (bad
 * arguments): its name (NULL: the next unnamed one) and step are used up, and every rank that
 * submits the same call gets `code` (SHOAL_INVALID_ARGUMENT or SHOAL_INVALID_TYPE) with
 * `message` instead of waiting for this rank. */
void shoal_reject(int op, const char* name, int code, const char* message, int32_t process_set);
/* Fault-tolerant mode (SHOAL_FAULT_TOLERANT=1, Open MPI >= 5 with ULFM; docs/design.md §16).
 * After an op failed with SHOAL_RANK_LOST, every survivor calls this (collective over the
 * survivors): the lost runtime's ops have all failed with SHOAL_RANK_LOST; the job's
 * communicator shrinks to the survivors (renumbered 0..n-1 in their old order) and a fresh
 * runtime starts over it. Writes the lost ranks (numbered as before the loss, ascending) to
 * lost[0..min(*n_lost, capacity)). If the current runtime has lost no rank, does nothing and
 * sets *n_lost = 0. Handles of the lost runtime stay valid (they report SHOAL_RANK_LOST). */
int shoal_recover(int32_t* lost, int32_t capacity, int32_t* n_lost, char* err, size_t err_len);
/* 1 while the current runtime has lost a rank and not yet recovered (fault-tolerant mode). */
int shoal_rank_lost(void);
/* 1 in a child process forked after shoal_init: queries (rank, size) work, every call
 * that communicates fails at once (the MPI state belongs to the parent), and shutdown
 * and finalize do nothing. */
int shoal_forked(void);

/* -1 when not initialised. */
int shoal_rank(void);
int shoal_size(void);
int shoal_local_rank(void);
int shoal_local_size(void);
int shoal_machine_rank(void);
int shoal_machine_size(void);
int shoal_is_homogeneous(void);
int shoal_mpi_threads_supported(void);
/* Writes e.g. "MPICH 5.0.2" into buf. */
void shoal_mpi_library_version(char* buf, size_t len);

/* Horovod's process sets: sub-communicators over some of the ranks. Every rank calls
 * add/remove, with the same arguments and in the same order (they agree through one global
 * exchange); any disagreement (other ranks, a rank calling the other function, a rank that
 * refused the call above the core with `refusal`, SHOAL_INVALID_TYPE) is the same error on
 * every rank, and a rank that never calls ends in a stall error after SHOAL_STALL_CHECK_TIME.
 * add: `ranks` (any order, world ranks) become a set whose id (> 0, never reused) it writes;
 * SHOAL_INVALID_ARGUMENT for an empty or bad list or the ranks of a set that exists.
 * remove: SHOAL_INVALID_ARGUMENT for an unknown id or when ops of the set are in flight on
 * some rank. Members make (free) the set's communicator together; ops in disjoint sets
 * negotiate with their own coordinator (the set's first rank) and never wait for each other. */
int shoal_add_process_set(const int32_t* ranks, int32_t n, const char* refusal, int32_t* id, char* err,
                          size_t err_len);
int shoal_remove_process_set(int32_t id, const char* refusal, char* err, size_t err_len);
/* The world ranks of set `id` (ascending) into `ranks` (up to `capacity`); returns how many it
 * has, or -1 for an unknown set (never added, or removed). */
int shoal_process_set_ranks(int32_t id, int32_t* ranks, int32_t capacity);
/* The static topologies (docs/design.md §7; BlueFog's convention: edge i -> j of weight w
 * means node j weights node i's value by w when it combines, a self loop gives a node its
 * own weight): a graph over the ranks (set_topology) and one over the machines
 * (set_machine_topology, for the hierarchical op). */
typedef enum { SHOAL_GRAPH_RANKS = 0, SHOAL_GRAPH_MACHINES = 1 } shoal_graph;
/* Sets `graph` to the edges src[k] -> dst[k] of weight weights[k], k < n_edges, over n_nodes
 * nodes: size() ranks or machine_size() machines. weighted = 0: neighbor ops over it average
 * uniformly. Local to this rank: the caller checks that every rank passes the same graph.
 * Writes the graph's new version (1, 2, ...). */
int shoal_set_topology(int graph, int32_t n_nodes, int64_t n_edges, const int32_t* src, const int32_t* dst,
                       const double* weights, int weighted, int64_t* version, char* err, size_t err_len);
typedef struct {
  int64_t version;  /* 0: never set (the counts are then 0) */
  int32_t weighted;
  int32_t n_recv, n_send;
  double self_weight; /* the self loop's weight, 0 without one */
} shoal_topology_info;
/* This rank's (SHOAL_GRAPH_RANKS) or this rank's machine's (SHOAL_GRAPH_MACHINES) view of
 * `graph`: in-neighbors ascending with the weights it gives them, out-neighbors ascending.
 * Writes at most `capacity` entries per list; info->n_recv and n_send are the full counts. */
int shoal_topology_plan(int graph, int32_t capacity, int32_t* recv, double* recv_weights, int32_t* send,
                        shoal_topology_info* info, char* err, size_t err_len);

/* Queues an op; it may also start it on the calling thread (one communication cycle). */
int shoal_enqueue(const shoal_op_desc* desc, int64_t* handle, char* err, size_t err_len);
/* Horovod's join: this rank has run out of data (semantics: shoal.join() in shoal/_ops.py).
 * Until every rank has joined it takes part in the other ranks' allreduces (contributing
 * the identity of the reduction: zeros for Sum and Average, whose divisor stays the number
 * of ranks; the dtype's largest value (+inf) for Min, its lowest (-inf) for Max, 1 for
 * Product), reducescatters (zeros) and barriers; their broadcasts, allgathers, alltoalls
 * and neighbor ops with it fail with an error naming the joined ranks.
 * Completes when the last rank joins: shoal_take_result then gives that rank as one int32
 * (ndim 0). Ops enqueued on this rank while its join is in flight are refused. */
int shoal_enqueue_join(int64_t* handle, char* err, size_t err_len);
/* Completion callback, called once when the op finishes (status SHOAL_OK or an error
 * and its message), from the thread then driving communication: the background thread
 * or a thread inside shoal_wait. It may call shoal_take_result and shoal_release for its
 * handle; it must not block or wait. Used by the TensorFlow kernels. */
typedef void (*shoal_callback)(int64_t handle, int status, const char* message, void* arg);
int shoal_enqueue_with_callback(const shoal_op_desc* desc, shoal_callback callback, void* arg,
                                int64_t* handle, char* err, size_t err_len);
/* A grouped op (Horovod's grouped_allreduce, grouped_allgather, grouped_reducescatter):
 * n ops of one type (descs[i].op: allreduce, allgather or reducescatter; descs[i].name is
 * ignored) negotiated as one unit named `name` (NULL or "": a generated name, counted per
 * op type). Either all of them run, allreduces fused where they can be, or all fail with
 * the same error: a bad argument in any desc refuses them all here (and on every rank
 * that submits the group), a disagreement across ranks on the number of ops or on any
 * member fails every member everywhere. Member i is named "<name>[i]" (timeline, errors).
 * handles receives n handles, one per member, each waited and released as usual;
 * `callback`, if not NULL, is called for each member with args[i] (args may be NULL). */
int shoal_enqueue_group(const char* name, const shoal_op_desc* descs, int32_t n, shoal_callback callback,
                        void* const* args, int64_t* handles, char* err, size_t err_len);
/* 1 when complete, 0 while pending, -SHOAL_UNKNOWN_HANDLE for an unknown handle. */
int shoal_poll(int64_t handle);
/* 1 while the core may still read or write the op's tensors (running, or failed while a
 * send straight from its memory was in flight), 0 once they may be freed,
 * -SHOAL_UNKNOWN_HANDLE for an unknown handle. Bindings keep tensors alive until 0. */
int shoal_in_use(int64_t handle);
/* Blocks until complete, driving the communication meanwhile (polling while peers
 * answer, then sleeping); returns the op's status and message. The handle stays valid
 * until shoal_release. */
int shoal_wait(int64_t handle, char* err, size_t err_len);
/* As shoal_wait, but returns SHOAL_TIMEOUT after `timeout_ms` if the op is still
 * running (so a binding can check for Ctrl-C between waits). */
int shoal_wait_for(int64_t handle, int64_t timeout_ms, char* err, size_t err_len);
/* Results the core allocated (allgather, reducescatter, alltoall, neighbor_allgather): ownership moves to the caller, who frees
 * the buffer with shoal_free_buffer. shape must hold 32 entries. */
int shoal_take_result(int64_t handle, void** data, size_t* nbytes, int32_t* ndim, int64_t* shape);
void shoal_free_buffer(void* data);
/* A completed alltoall: the rows received from each rank (in rank order) into splits
 * (capacity entries); *n is the number of ranks. */
int shoal_received_splits(int64_t handle, int64_t* splits, int32_t capacity, int32_t* n);
int shoal_release(int64_t handle);
/* A binding's data kept with an op's handle (the objects that own its tensors, how its
 * wait gives the result): the one registry of a handle's objects. `drop(data)` runs exactly
 * once, when the handle is released (shoal_release, in its caller's thread) or its runtime
 * ends (in the thread that ends it: shoal_shutdown's, or the last waiter's), never under a
 * lock of the core. Attaching again drops what was attached before. SHOAL_UNKNOWN_HANDLE
 * for an unknown handle (nothing is dropped: the caller keeps `data`). */
int shoal_attach(int64_t handle, void* data, void (*drop)(void* data));
/* The data attached to `handle`; NULL if none, or for an unknown handle. */
void* shoal_attached(int64_t handle);
/* Takes back the data attached to `handle` (NULL if none, or for an unknown handle): its
 * drop will not run, the caller owns it. One thread of several that finish a handle gets it. */
void* shoal_detach(int64_t handle);
/* The handle the next op will get: op handles are numbered once per process, so those
 * below it were issued before (a binding tells a handle its runtime ended from one it
 * never issued). */
int64_t shoal_next_handle(void);

/* User activities on the timeline (SHOAL_TIMELINE): a span named `activity` on the
 * track of `tensor_name`. Return 1 when the timeline is on, 0 otherwise. */
int shoal_timeline_start_activity(const char* tensor_name, const char* activity);
int shoal_timeline_end_activity(const char* tensor_name);

/* One-sided window ops (BlueFog's win_*), run in order on the window thread with their
 * own handle space. Semantics: docs/reference/bluefog-semantics.md §1.7 and shoal/_win.py. */
typedef enum {
  SHOAL_WIN_CREATE = 0, SHOAL_WIN_FREE = 1, SHOAL_WIN_PUT = 2, SHOAL_WIN_ACCUMULATE = 3,
  SHOAL_WIN_GET = 4, SHOAL_WIN_UPDATE = 5, SHOAL_WIN_LOCK = 6, SHOAL_WIN_UNLOCK = 7
} shoal_win_op;

typedef struct {
  int32_t op;         /* shoal_win_op */
  const char* name;   /* free: NULL or "" frees every window */
  shoal_tensor tensor; /* create/put/accumulate: the local value; update: updated in place */
  int32_t n;          /* ranks: create = in-neighbours; put/accumulate = destinations;   */
  const int32_t* ranks; /* get/update = sources; lock/unlock = mutex ranks             */
  const double* weights; /* one per rank (NULL: 1.0); unused by create and lock      */
  int32_t n_send;     /* create: out-neighbours */
  const int32_t* send_ranks;
  double self_weight; /* put/accumulate: local tensor *= self_weight; update: weight of x */
  int32_t uniform;    /* update: (x + sum of buffers) / (n + 1) */
  int32_t zero_init, require_mutex, reset, with_p, for_self;
  int32_t clone;      /* update: the tensor is a copy; do not publish it as this rank's value */
  const char* refused; /* create: NULL, or why this rank refused the call (its peers raise it too) */
  int32_t refused_code; /* with refused: SHOAL_INVALID_ARGUMENT or SHOAL_INVALID_TYPE */
} shoal_win_desc;

int shoal_win_enqueue(const shoal_win_desc* desc, int64_t* handle, char* err, size_t err_len);
/* 1 when complete, 0 while pending, -SHOAL_UNKNOWN_HANDLE. */
int shoal_win_poll(int64_t handle);
/* As shoal_wait_for, for window handles (timeout_ms < 0: no limit). */
int shoal_win_wait_for(int64_t handle, int64_t timeout_ms, char* err, size_t err_len);
int shoal_win_release(int64_t handle);
/* Puts and gets received per in-neighbour since the last update: n_out entries. */
int shoal_win_versions(const char* name, int32_t* ranks, int64_t* versions, int32_t capacity,
                       int32_t* n_out, char* err, size_t err_len);
int shoal_win_associated_p(const char* name, double* p, char* err, size_t err_len);
/* Names of the windows that exist, one per line, sorted. Returns the bytes needed
 * (call again with a larger buffer if that exceeds len), or -SHOAL_NOT_INITIALIZED. */
int shoal_win_names(char* buf, size_t len);

/* Counters as "key=value" lines. */
int shoal_stats(char* buf, size_t len);
void shoal_reset_stats(void);

/* GPU support of this build, without touching a GPU: returns 1 and writes what the
 * CUDA plugin (libshoal_cuda.so) holds, e.g. "CUDA 13.0 runtime (static); kernels sm_80
 * sm_90; NCCL backend ...", or returns 0 and writes why there is none. CUDA tensors
 * (device_type SHOAL_DEVICE_CUDA) are accepted only when it returns 1; their `stream` is
 * the producer's stream (NULL: the legacy default stream) and `ready_event`, if not NULL,
 * an event the caller recorded after the producer and keeps alive until completion. */
int shoal_gpu_support(char* buf, size_t len);

/* The CUDA plugin file libshoal.so loads (or would load) for CUDA tensors: beside it,
 * libshoal_cuda.so, or libshoal_cuda_fake.so (CPU fake devices, tests only) with
 * SHOAL_CUDA_PLUGIN=fake, or the path SHOAL_CUDA_PLUGIN names. Returns the bytes needed,
 * with the terminator. */
int shoal_gpu_plugin_path(char* buf, size_t len);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#ifdef __cplusplus
}
#endif
#endif /* SHOAL_C_API_H_ */
