// The one Runtime of this process as the C ABI's functions reach it (api/c_api.cc, which
// owns it; api/c_api_windows.cc).
#pragma once
#include <cstddef>
#include <memory>

#include "runtime/runtime.h"

namespace shoal::api {

std::shared_ptr<Runtime> Current();  // null before init() and after shutdown()
// The runtime for a call that communicates; null (and *st set) if there is none to use
// (not initialized, or a process forked after init).
std::shared_ptr<Runtime> Usable(Status* st);
// `st`'s message into err[0..len) (truncated, terminated); returns its code.
int Report(const Status& st, char* err, size_t len);
Status NotInitialized();

}  // namespace shoal::api
