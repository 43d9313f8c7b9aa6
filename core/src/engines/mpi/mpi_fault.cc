// Fault tolerance on MPI's ULFM (docs/design.md §16). Open MPI >= 5 declares ULFM's
// MPIX_ calls in mpi-ext.h (OMPI_HAVE_MPI_EXT_FTMPI); elsewhere a lost rank ends the job.
#include "engines/mpi/mpi_fault.h"

#include <algorithm>

#include "engines/backend.h"
#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>
#endif
#if defined(OMPI_HAVE_MPI_EXT_FTMPI) && OMPI_HAVE_MPI_EXT_FTMPI
#define SHOAL_ULFM 1
#endif

namespace shoal {
namespace {

MPI_Comm g_job = MPI_COMM_NULL;  // the last shrink's communicator; null: MPI_COMM_WORLD
std::atomic<LossWatch*> g_watch{nullptr};  // the running backend's (ReportMpiFailure)

bool IsProcessFailure(int rc) {
#ifdef SHOAL_ULFM
  int cls = MPI_SUCCESS;
  MPI_Error_class(rc, &cls);
  return cls == MPIX_ERR_PROC_FAILED || cls == MPIX_ERR_PROC_FAILED_PENDING || cls == MPIX_ERR_REVOKED;
#else
  (void)rc;
  return false;
#endif
}

}  // namespace

std::string MpiError(int code, const char* what) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, msg, &len);
  return std::string(what) + " failed: " + std::string(msg, len);
}

MPI_Comm MpiJobComm() { return g_job == MPI_COMM_NULL ? MPI_COMM_WORLD : g_job; }

LossWatch::~LossWatch() {
  LossWatch* self = this;
  g_watch.compare_exchange_strong(self, nullptr);
}

void LossWatch::Watch(MPI_Comm c) {
  watched_ = c;
  g_watch = this;
}

Status ReportMpiFailure(int rc, const std::string& what) {
  LossWatch* w = g_watch;
  return w ? w->Error(rc, what) : Status::Error(SHOAL_ABORTED, MpiError(rc, what.c_str()));
}

Status LossWatch::Error(int rc, const std::string& what) {
  if (!fault_tolerant_ || !IsProcessFailure(rc)) return Status::Error(SHOAL_ABORTED, MpiError(rc, what.c_str()));
#ifdef SHOAL_ULFM
  if (!lost_.exchange(true) && watched_ != MPI_COMM_NULL) MPIX_Comm_revoke(watched_);
#endif
  return Status::Error(SHOAL_RANK_LOST, MpiError(rc, what.c_str()));
}

bool MpiFaultTolerant(std::string* why) {
#ifdef SHOAL_ULFM
  (void)why;
  return true;
#else
  *why = "fault-tolerant mode needs an MPI with ULFM (Open MPI >= 5: install Shoal with SHOAL_MPI=openmpi); "
         "this Shoal is built with " + MpiLibraryVersion().substr(0, MpiLibraryVersion().find('\n'));
  return false;
#endif
}

Status ShrinkMpiJob(std::vector<int>* lost) {
#ifdef SHOAL_ULFM
  MPI_Comm old = MpiJobComm(), shrunk = MPI_COMM_NULL;
  // Learn of every failure first: a shrink of a communicator nobody revoked still excludes
  // only the failures its members agree on.
  MPIX_Comm_revoke(old);
  int rc = MPIX_Comm_shrink(old, &shrunk);
  if (rc != MPI_SUCCESS) return Status::Error(SHOAL_ABORTED, MpiError(rc, "MPIX_Comm_shrink"));
  MPI_Comm_set_errhandler(shrunk, MPI_ERRORS_RETURN);
  MPI_Group before = MPI_GROUP_NULL, after = MPI_GROUP_NULL;
  MPI_Comm_group(old, &before);
  MPI_Comm_group(shrunk, &after);
  int n = 0;
  MPI_Group_size(before, &n);
  std::vector<int> ranks(n), there(n);
  for (int r = 0; r < n; ++r) ranks[r] = r;
  MPI_Group_translate_ranks(before, n, ranks.data(), after, there.data());
  MPI_Group_free(&before);
  MPI_Group_free(&after);
  lost->clear();
  for (int r = 0; r < n; ++r)
    if (there[r] == MPI_UNDEFINED) lost->push_back(r);
  // The old communicator is not freed: freeing one with a dead member is not fault tolerant.
  g_job = shrunk;
  return Status::Ok();
#else
  (void)lost;
  std::string why;
  MpiFaultTolerant(&why);
  return Status::Error(SHOAL_ABORTED, why);
#endif
}

}  // namespace shoal
