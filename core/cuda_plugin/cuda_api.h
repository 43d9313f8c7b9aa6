/* Interface between libshoal.so and its optional CUDA plugin, libshoal_cuda.so.
 *
 * libshoal.so dlopens the plugin the first time a CUDA tensor is enqueued, so one build
 * serves CPU-only and GPU machines (docs/design.md §4): a CPU machine never loads it,
 * and a machine without a driver gets a clear error instead of a failed import. The
 * plugin links the CUDA runtime statically (it needs only the driver, libcuda.so.1) and
 * dlopens libnccl.so.2 on first NCCL use. Plain C only: no C++ type crosses. A second
 * implementation, libshoal_cuda_fake.so (fake_plugin.cc), runs the table on the CPU for
 * tests (SHOAL_CUDA_PLUGIN=fake).
 *
 * Every fallible call returns NULL on success, or an error message owned by the plugin
 * that stays valid until the next call on the same thread. Streams and events are
 * cudaStream_t / cudaEvent_t passed as void*; `device` is a CUDA device ordinal. */
#ifndef SHOAL_CUDA_API_H_
#define SHOAL_CUDA_API_H_
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SHOAL_CUDA_ABI_VERSION 5

typedef const char* shoal_cuda_error;

/* One peer of a grouped NCCL exchange: send `count` elements of `buf` to `peer`,
 * or receive them into `buf` from `peer`. */
typedef struct {
  int32_t peer;
  void* buf;
  int64_t count;
} shoal_nccl_peer;

typedef struct {
  int32_t abi_version;
  /* e.g. "CUDA 13.0 runtime (static); kernels sm_80 sm_90; NCCL 2.32 headers" */
  const char* build;
  int32_t has_nccl; /* 0: the nccl_* entries are NULL (built without NCCL headers) */

  /* Number of usable devices; 0 (and *why set, if given) without a driver or device. */
  int (*device_count)(const char** why);
  shoal_cuda_error (*set_device)(int device);
  /* The calling thread's current device (-1 on error). */
  int (*get_device)(void);
  /* A non-blocking stream on `device`, so it never waits on the legacy default stream. */
  shoal_cuda_error (*stream_create)(int device, void** stream);
  shoal_cuda_error (*stream_destroy)(void* stream);
  shoal_cuda_error (*stream_sync)(void* stream);
  shoal_cuda_error (*stream_wait_event)(void* stream, void* event);
  /* Creates a timing-free event on `device` and records it on `stream` (may be the
   * legacy default stream, NULL), restoring the caller's current device. Used from user
   * threads at enqueue: it marks the point the producer reached. */
  shoal_cuda_error (*capture)(int device, void* stream, void** event);
  shoal_cuda_error (*event_create)(int device, void** event);
  shoal_cuda_error (*event_destroy)(void* event);
  shoal_cuda_error (*event_record)(void* event, void* stream);
  /* *done = 1 when everything before the event has finished, else 0. */
  shoal_cuda_error (*event_query)(void* event, int* done);
  /* cudaMemcpyAsync with the direction inferred from the pointers. */
  shoal_cuda_error (*memcpy_async)(void* dst, const void* src, size_t nbytes, void* stream);
  /* Pinned host memory usable from every device (cudaHostAllocPortable). */
  shoal_cuda_error (*host_alloc)(size_t nbytes, void** p);
  shoal_cuda_error (*host_free)(void* p);
  shoal_cuda_error (*device_alloc)(int device, size_t nbytes, void** p);
  shoal_cuda_error (*device_free)(void* p);

  /* Kernels on floating shoal_dtype values (float16/bfloat16 accumulate in float32),
   * `n` elements each, enqueued on `stream`:
   *   combine: uniform: out = (self + sum_j srcs[j]) / (n_src + 1)
   *            else:    out = self_weight * self + sum_j weights[j] * srcs[j]
   *            (out may alias self)
   *   scale:   dst = divide ? src / factor : src * factor  (dst may alias src) */
  shoal_cuda_error (*combine)(void* out, const void* self, const void* const* srcs,
                              const double* weights, int n_src, int uniform, double self_weight,
                              int dtype, int64_t n, void* stream);
  shoal_cuda_error (*scale)(void* dst, const void* src, double factor, int divide, int dtype,
                            int64_t n, void* stream);
  /* Fusion buffer: pack copies parts[k] (nbytes[k] bytes) to fused + offsets[k];
   * unpack copies back. One launch per 64 parts. */
  shoal_cuda_error (*pack)(void* fused, void* const* parts, const int64_t* offsets,
                           const int64_t* nbytes, int n_parts, int unpack, void* stream);

  /* NCCL, loaded on first use from $SHOAL_NCCL_LIBRARY or libnccl.so.2.
   * unique_id writes NCCL_UNIQUE_ID_BYTES (128) bytes. Ops are enqueued on `stream`;
   * nccl_check polls a communicator for an asynchronous error. */
  shoal_cuda_error (*nccl_unique_id)(void* id128);
  shoal_cuda_error (*nccl_comm_init)(int device, int nranks, const void* id128, int rank,
                                     void** comm);
  shoal_cuda_error (*nccl_comm_destroy)(void* comm);
  shoal_cuda_error (*nccl_check)(void* comm);
  /* In place; reduce_op SHOAL_REDUCE_SUM, MIN, MAX or PRODUCT (ncclSum, ncclMin, ncclMax,
   * ncclProd); int16 and bool are not supported by NCCL (an error). */
  shoal_cuda_error (*nccl_allreduce)(void* buf, int64_t count, int dtype, int reduce_op,
                                     void* comm, void* stream);
  shoal_cuda_error (*nccl_broadcast)(void* buf, int64_t nbytes, int root, void* comm,
                                     void* stream);
  /* Rank r's `nbytes[r]` bytes land at recv + offsets[r] (variable sizes: one
   * broadcast per rank in one group). */
  shoal_cuda_error (*nccl_allgatherv)(const void* send, void* recv, const int64_t* nbytes,
                                      const int64_t* offsets, int nranks, void* comm,
                                      void* stream);
  /* One group of sends and receives (counts in bytes). */
  shoal_cuda_error (*nccl_exchange)(const shoal_nccl_peer* sends, int n_send,
                                    const shoal_nccl_peer* recvs, int n_recv, void* comm,
                                    void* stream);
  /* ncclCommAbort: ends the communicator's outstanding work (its streams stop waiting). */
  shoal_cuda_error (*nccl_comm_abort)(void* comm);
  /* Reduces every rank's `send` (counts[0] + ... + counts[nranks-1] elements) with
   * reduce_op (as nccl_allreduce) and leaves rank r its counts[r] elements, from offset
   * counts[0] + ... + counts[r-1], in `recv`: ncclReduceScatter when the counts are equal,
   * else one ncclReduce per rank in one group. */
  shoal_cuda_error (*nccl_reducescatter)(const void* send, void* recv, const int64_t* counts, int nranks,
                                         int dtype, int reduce_op, void* comm, void* stream);

  /* 1 when the MPI library in this process can read and write this plugin's device
   * memory (CUDA-aware MPI: MPIX_Query_cuda_support() of Open MPI or MPICH), else 0;
   * *how says what was asked and what it answered. */
  int (*mpi_cuda_aware)(const char** how);
} shoal_cuda_api;

/* The plugin's one exported symbol; NULL if abi_version differs from the plugin's. */
typedef const shoal_cuda_api* (*shoal_cuda_plugin_fn)(int abi_version);
#define SHOAL_CUDA_PLUGIN_SYMBOL "shoal_cuda_plugin"

#ifdef __cplusplus
}
#endif
#endif /* SHOAL_CUDA_API_H_ */
