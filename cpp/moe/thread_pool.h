// A small persistent worker pool for the MoE kernel.
//
// Why not torch's pool or OpenMP: the kernel is torch-free, and a private pool cannot
// deadlock against a busy intra-op pool of the caller. Workers spin briefly after a job
// (decode calls come back-to-back, and a condition-variable wake-up costs tens of
// microseconds) and then sleep. A worker that finds itself on the caller's CPU moves off it
// (see worker_main).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace llmq_moe {

class ThreadPool {
 public:
  // The process-wide pool (never destroyed, so no join at interpreter exit).
  static ThreadPool& instance();

  // Runs fn(i) for every i in [0, n) on up to `threads` threads, the caller being one of
  // them; returns when all items are done. Items are handed out dynamically, in chunks of
  // consecutive indices. Not
  // re-entrant: callers serialise through call_mutex().
  void parallel_for(int64_t n, int threads, const std::function<void(int64_t)>& fn);

  std::mutex& call_mutex() { return call_mu_; }

 private:
  ThreadPool() = default;
  void ensure_workers(int count);
  void worker_main(int id, uint64_t seen);
  void run_items();
  bool try_join(uint64_t gen);

  std::mutex call_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> workers_;
  // (generation << 8) | number of participating workers; published with release.
  std::atomic<uint64_t> state_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int> done_{0};
  // CPU the caller ran on when it published the current job (-1: unknown); see worker_main.
  std::atomic<int> caller_cpu_{-1};
  // (generation << 24) | closed bit (1 << 23) | number of helpers that joined the job.
  std::atomic<uint64_t> join_{0};
  int64_t n_ = 0;
  int64_t chunk_ = 1;
  const std::function<void(int64_t)>* fn_ = nullptr;
};

}  // namespace llmq_moe
