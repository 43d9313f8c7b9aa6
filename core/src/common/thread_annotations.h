// Locking stated in the code (docs/design.md, "Core layout": locking): Clang's thread-safety
// attributes on a mutex type of our own, so a clang build with -Wthread-safety checks that
// every field marked GUARDED_BY(mu) is touched only with mu held, and every function marked
// REQUIRES(mu) is called only with it held (CMake: SHOAL_THREAD_SAFETY_ANALYSIS). Other
// compilers see no attributes: the types below are std::mutex and std::unique_lock inlined.
#pragma once
#include <chrono>
#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define SHOAL_THREAD_ATTRIBUTE(x) __attribute__((x))
#else
#define SHOAL_THREAD_ATTRIBUTE(x)
#endif

// A type whose objects are locks (the analysis calls them capabilities).
#define CAPABILITY(kind) SHOAL_THREAD_ATTRIBUTE(capability(kind))
// An RAII type that holds a capability from its constructor to its destructor.
#define SCOPED_CAPABILITY SHOAL_THREAD_ATTRIBUTE(scoped_lockable)
// The field may be read or written only with the capability held.
#define GUARDED_BY(x) SHOAL_THREAD_ATTRIBUTE(guarded_by(x))
// What the pointer (or smart pointer) points to may be touched only with it held.
#define PT_GUARDED_BY(x) SHOAL_THREAD_ATTRIBUTE(pt_guarded_by(x))
// The caller must hold these; the function neither takes nor releases them.
#define REQUIRES(...) SHOAL_THREAD_ATTRIBUTE(requires_capability(__VA_ARGS__))
// The function takes / releases these (no argument on a member: the object itself).
#define ACQUIRE(...) SHOAL_THREAD_ATTRIBUTE(acquire_capability(__VA_ARGS__))
#define RELEASE(...) SHOAL_THREAD_ATTRIBUTE(release_capability(__VA_ARGS__))
// The caller must not hold these (the function takes them).
#define EXCLUDES(...) SHOAL_THREAD_ATTRIBUTE(locks_excluded(__VA_ARGS__))
// From this call on, the analysis takes the capability as held.
#define ASSERT_CAPABILITY(x) SHOAL_THREAD_ATTRIBUTE(assert_capability(x))
// Not checked; each use says why the analysis cannot follow it.
#define NO_THREAD_SAFETY_ANALYSIS SHOAL_THREAD_ATTRIBUTE(no_thread_safety_analysis)

namespace shoal {

class UniqueLock;

// std::mutex, as a capability.
class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  // The caller holds this mutex by a path the analysis cannot see (a lock returned from a
  // function). A statement to the analysis only: std::mutex cannot tell who holds it.
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  friend class UniqueLock;
  std::mutex mu_;
};

// std::lock_guard: held for the scope.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ACQUIRE(mu) : mu_(mu) { mu_.Lock(); }
  ~MutexLock() RELEASE() { mu_.Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
};

// std::unique_lock: held for the scope, may be released and taken again inside it, and waits
// on a std::condition_variable. For the analysis the mutex stays held across a wait (the
// wait gives it up and takes it back before returning, as the code after the wait expects).
class SCOPED_CAPABILITY UniqueLock {
 public:
  explicit UniqueLock(Mutex& mu) ACQUIRE(mu) : lock_(mu.mu_) {}
  ~UniqueLock() RELEASE() {}
  UniqueLock(const UniqueLock&) = delete;
  UniqueLock& operator=(const UniqueLock&) = delete;

  void Unlock() RELEASE() { lock_.unlock(); }
  void Lock() ACQUIRE() { lock_.lock(); }

  // One wait: callers loop on their condition, which the analysis checks with the mutex held
  // (a predicate lambda would be checked as a function of its own, without it).
  void Wait(std::condition_variable& cv) { cv.wait(lock_); }
  template <typename Clock, typename Duration>
  std::cv_status WaitUntil(std::condition_variable& cv, const std::chrono::time_point<Clock, Duration>& t) {
    return cv.wait_until(lock_, t);
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

// Holds a mutex from a function's return to the end of the caller's scope (C++17 returns it
// without a copy). The analysis cannot follow a lock across a return, so this type is no
// capability: code that needs the mutex held says so with Mutex::AssertHeld.
class ReturnedLock {
 public:
  explicit ReturnedLock(Mutex& mu) NO_THREAD_SAFETY_ANALYSIS : mu_(mu) { mu_.Lock(); }
  ~ReturnedLock() NO_THREAD_SAFETY_ANALYSIS { mu_.Unlock(); }
  ReturnedLock(const ReturnedLock&) = delete;
  ReturnedLock& operator=(const ReturnedLock&) = delete;

 private:
  Mutex& mu_;
};

}  // namespace shoal
