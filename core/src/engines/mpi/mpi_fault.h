// Fault tolerance on MPI's ULFM (docs/design.md §16): the job's communicator, which a
// shrink replaces, and the watch that turns a process failure into SHOAL_RANK_LOST.
#pragma once
#include <mpi.h>

#include <atomic>
#include <string>
#include <vector>

#include "common/common.h"

namespace shoal {

// The communicator of the job's live ranks: MPI_COMM_WORLD until a shrink (ShrinkMpiJob).
// Backends and windows duplicate it.
MPI_Comm MpiJobComm();

std::string MpiError(int code, const char* what);

// One backend's view of failures. Without fault tolerance every MPI error is SHOAL_ABORTED.
// With it, an error of ULFM's classes (a process failed; a communicator revoked) is
// SHOAL_RANK_LOST, and the first one revokes the watched communicator so that every
// survivor's next call on it fails too, whatever it was waiting for.
class LossWatch {
 public:
  explicit LossWatch(bool fault_tolerant) : fault_tolerant_(fault_tolerant) {}
  ~LossWatch();
  // Also makes this the watch that ReportMpiFailure reports to.
  void Watch(MPI_Comm c);
  Status Error(int rc, const std::string& what);
  bool lost() const { return lost_; }

 private:
  const bool fault_tolerant_;
  MPI_Comm watched_ = MPI_COMM_NULL;
  std::atomic<bool> lost_{false};
};

// For MPI calls outside the backend (the window engine): `rc` as the watch of the running
// backend sees it, so a process failure seen there is the runtime's loss too (SHOAL_RANK_LOST,
// its communicator revoked); SHOAL_ABORTED without such a watch.
Status ReportMpiFailure(int rc, const std::string& what);

}  // namespace shoal
