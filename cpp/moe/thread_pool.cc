#include "thread_pool.h"

#include <chrono>

#if defined(__linux__)
#include <sched.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LLMQ_PAUSE() _mm_pause()
#else
#define LLMQ_PAUSE() std::this_thread::yield()
#endif

namespace llmq_moe {

namespace {
constexpr int kMaxThreads = 128;
// How long an idle worker spins before sleeping on the condition variable.
constexpr auto kSpinTime = std::chrono::microseconds(100);
}  // namespace

ThreadPool& ThreadPool::instance() {
  static ThreadPool* pool = new ThreadPool();
  return *pool;
}

void ThreadPool::ensure_workers(int count) {
  while (static_cast<int>(workers_.size()) < count) {
    int id = static_cast<int>(workers_.size());
    // The generation is read here, not in the new thread: the first job may be published
    // before that thread runs, and it must not mistake that job for an old one.
    const uint64_t seen = state_.load(std::memory_order_acquire) >> 8;
    workers_.emplace_back([this, id, seen] { worker_main(id, seen); });
    workers_.back().detach();
  }
}

void ThreadPool::run_items() {
  const int64_t n = n_, chunk = chunk_;
  for (;;) {
    const int64_t begin = next_.fetch_add(chunk, std::memory_order_relaxed);
    if (begin >= n) break;
    const int64_t end = begin + chunk < n ? begin + chunk : n;
    for (int64_t i = begin; i < end; ++i) (*fn_)(i);
  }
}

namespace {
constexpr uint64_t kClosed = uint64_t{1} << 23;
constexpr uint64_t kCountMask = kClosed - 1;
}  // namespace

// A helper joins job `gen` only while the caller has not closed it. The caller closes the
// job once all items are handed out and then waits only for helpers that joined: a helper
// the OS has not scheduled yet (the other core busy with another process) cannot stall the
// call; it finds the job closed when it runs and skips it.
bool ThreadPool::try_join(uint64_t gen) {
  uint64_t v = join_.load(std::memory_order_acquire);
  for (;;) {
    if ((v >> 24) != (gen & ((uint64_t{1} << 40) - 1)) || (v & kClosed)) return false;
    if (join_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire)) return true;
  }
}

namespace {
// The scheduler sometimes wakes a sleeping worker on the CPU its waker (the caller) runs on,
// and leaves it there: measured on 2 cores, a decode call then took 0.6-0.8 ms instead of
// 0.33 (the worker spinning or working next to the caller, /proc/<pid>/task/*/stat showing
// both on one CPU while the other idled). So a worker that sees a new job while on the
// caller's CPU restricts itself to the other CPUs it started with, which moves it at once.
// It is computed from the start-up set each time, so the caller moving cannot strand it.
class StayOffCaller {
 public:
  StayOffCaller() {
#if defined(__linux__)
    ok_ = sched_getaffinity(0, sizeof(start_), &start_) == 0 && CPU_COUNT(&start_) > 1;
#endif
  }
  void check(int caller_cpu) {
#if defined(__linux__)
    if (!ok_ || caller_cpu < 0 || caller_cpu >= CPU_SETSIZE || sched_getcpu() != caller_cpu) return;
    cpu_set_t others = start_;
    CPU_CLR(caller_cpu, &others);
    if (CPU_COUNT(&others) > 0) sched_setaffinity(0, sizeof(others), &others);
#else
    (void)caller_cpu;
#endif
  }

 private:
#if defined(__linux__)
  cpu_set_t start_;
#endif
  bool ok_ = false;
};

int current_cpu() {
#if defined(__linux__)
  return sched_getcpu();
#else
  return -1;
#endif
}
}  // namespace

void ThreadPool::worker_main(int id, uint64_t seen) {
  StayOffCaller placement;
  for (;;) {
    uint64_t s = state_.load(std::memory_order_acquire);
    if ((s >> 8) == seen) {
      auto start = std::chrono::steady_clock::now();
      int polls = 0;
      while (((s = state_.load(std::memory_order_acquire)) >> 8) == seen) {
        LLMQ_PAUSE();
        if (++polls % 256 == 0 && std::chrono::steady_clock::now() - start > kSpinTime) {
          std::unique_lock<std::mutex> lk(mu_);
          cv_.wait(lk, [&] { return (state_.load(std::memory_order_acquire) >> 8) != seen; });
          start = std::chrono::steady_clock::now();
        }
      }
    }
    seen = s >> 8;
    placement.check(caller_cpu_.load(std::memory_order_relaxed));
    if (id < static_cast<int>(s & 0xff) && try_join(seen)) {
      run_items();
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int threads, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (threads > kMaxThreads) threads = kMaxThreads;
  int helpers = threads - 1;
  if (helpers > n - 1) helpers = static_cast<int>(n - 1);
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  ensure_workers(helpers);
  n_ = n;
  // Consecutive items go to one thread in chunks (so an item can prefetch its successor's
  // data), small enough (~8 per thread) to balance when a thread is slowed down.
  chunk_ = n / (8 * (helpers + 1));
  if (chunk_ < 1) chunk_ = 1;
  fn_ = &fn;
  next_.store(0, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  caller_cpu_.store(current_cpu(), std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lk(mu_);
    uint64_t gen = (state_.load(std::memory_order_relaxed) >> 8) + 1;
    join_.store((gen & ((uint64_t{1} << 40) - 1)) << 24, std::memory_order_release);
    state_.store((gen << 8) | static_cast<uint64_t>(helpers), std::memory_order_release);
  }
  cv_.notify_all();
  run_items();
  // All items are handed out: close the job and wait for the helpers that joined it (they
  // are running their last items).
  const int joined = static_cast<int>(join_.fetch_or(kClosed, std::memory_order_acq_rel) & kCountMask);
  for (int polls = 0; done_.load(std::memory_order_acquire) < joined; ++polls) {
    if (polls < 2000) LLMQ_PAUSE();
    else std::this_thread::yield();
  }
  fn_ = nullptr;
}

}  // namespace llmq_moe
