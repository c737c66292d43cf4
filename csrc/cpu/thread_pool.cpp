#include "cpu/thread_pool.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace dlion {
namespace {

class ThreadPool {
 public:
  // Workers wait for a new generation of work, take tasks from a shared counter, and report.
  void run(int64_t n_tasks, int threads, const std::function<void(int64_t)>& fn) {
    const int helpers = std::min<int64_t>(threads, n_tasks) - 1;
    grow(helpers);
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = &fn;
      n_tasks_ = n_tasks;
      next_.store(0);
      participants_ = helpers;
      pending_ = helpers;
      error_ = nullptr;
      ++generation_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return pending_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void grow(int helpers) {
    while (static_cast<int>(workers_) < helpers) {
      const int index = static_cast<int>(workers_++);
      std::thread([this, index] { loop(index); }).detach();  // the pool lives until exit
    }
  }

  void loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (index >= participants_) continue;
      }
      work();
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }

  void work() {
    for (;;) {
      const int64_t task = next_.fetch_add(1);
      if (task >= n_tasks_) return;
      try {
        (*fn_)(task);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  int participants_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
  size_t workers_ = 0;
  std::exception_ptr error_;
};

std::mutex g_run_mu;          // one parallel_for at a time
ThreadPool* g_pool = nullptr;  // leaked on purpose: detached workers may outlive static teardown
pid_t g_pool_pid = 0;

}  // namespace

void parallel_for(int64_t n_tasks, int threads, const std::function<void(int64_t)>& fn) {
  if (n_tasks <= 0) return;
  if (threads <= 1 || n_tasks == 1) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t);
    return;
  }
  std::lock_guard<std::mutex> lock(g_run_mu);
  if (g_pool == nullptr || g_pool_pid != getpid()) {  // first use, or a forked child
    g_pool = new ThreadPool();
    g_pool_pid = getpid();
  }
  g_pool->run(n_tasks, threads, fn);
}

}  // namespace dlion
