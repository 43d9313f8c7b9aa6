// Fills a shoal_cuda_api table from functions named as its entries, in the namespace where
// it is expanded: the real plugin and the fake one implement the same names.
#pragma once
#include <string>
#include <utility>

#include "cuda_plugin/cuda_api.h"

// The table's error convention: `msg` kept in a per-thread buffer, returned as a C string
// (valid until the next error on this thread). Each plugin's Fail() is this.
inline shoal_cuda_error KeepError(std::string msg) {
  static thread_local std::string last;
  last = std::move(msg);
  return last.c_str();
}

#define SHOAL_FILL_CUDA_TABLE(t, device_count_fn) \
  do {                                      \
    (t).device_count = device_count_fn;     \
    (t).set_device = SetDevice;             \
    (t).get_device = GetDevice;             \
    (t).stream_create = StreamCreate;       \
    (t).stream_destroy = StreamDestroy;     \
    (t).stream_sync = StreamSync;           \
    (t).stream_wait_event = StreamWaitEvent; \
    (t).capture = Capture;                  \
    (t).event_create = EventCreate;         \
    (t).event_destroy = EventDestroy;       \
    (t).event_record = EventRecord;         \
    (t).event_query = EventQuery;           \
    (t).memcpy_async = MemcpyAsync;         \
    (t).host_alloc = HostAlloc;             \
    (t).host_free = HostFree;               \
    (t).device_alloc = DeviceAlloc;         \
    (t).device_free = DeviceFree;           \
    (t).combine = Combine;                  \
    (t).scale = Scale;                      \
    (t).pack = Pack;                        \
    (t).mpi_cuda_aware = MpiCudaAware;      \
    FillNccl(&(t));                         \
  } while (0)

// The NCCL entries, likewise (real NCCL and NCCL faked over MPI).
#define SHOAL_FILL_NCCL_TABLE(t)              \
  do {                                        \
    (t)->has_nccl = 1;                        \
    (t)->nccl_unique_id = UniqueId;           \
    (t)->nccl_comm_init = CommInit;           \
    (t)->nccl_comm_destroy = CommDestroy;     \
    (t)->nccl_check = CheckComm;              \
    (t)->nccl_allreduce = AllReduce;          \
    (t)->nccl_broadcast = Broadcast;          \
    (t)->nccl_allgatherv = Allgatherv;        \
    (t)->nccl_exchange = Exchange;            \
    (t)->nccl_comm_abort = CommAbort;         \
    (t)->nccl_reducescatter = ReduceScatter;  \
  } while (0)
