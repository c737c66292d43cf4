// A small persistent thread pool for the CPU kernels (no OpenMP: torch may bring its own runtime).
#pragma once

#include <cstdint>
#include <functional>

namespace dlion {

// Runs fn(task) for every task in [0, n_tasks) on up to `threads` threads (the caller included),
// and returns when all are done. The first exception thrown by a task is rethrown here.
// Safe to call from several threads (calls are serialized) and after fork() (the child builds a
// fresh pool).
void parallel_for(int64_t n_tasks, int threads, const std::function<void(int64_t)>& fn);

}  // namespace dlion
