// Waiting for the GPU with a deadline, for the sm90 self-tests: a wrong
// barrier protocol or TMA transaction count hangs a kernel, and a hung
// cudaDeviceSynchronize would block the whole (time-limited) GPU run. These
// poll instead, and after kHangSeconds print what hung and exit with code 3.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "selftest_common.h"  // CHECK_CUDA

constexpr double kHangSeconds = 60;

// `query` returns cudaErrorNotReady while the work is running
// (cudaStreamQuery, cudaEventQuery).
template <typename Query>
void wait_or_die(Query query, const std::string& what) {
  const auto t0 = std::chrono::steady_clock::now();
  cudaError_t e;
  while ((e = query()) == cudaErrorNotReady) {
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > kHangSeconds) {
      std::printf("HANG: %s did not finish within %.0f s (barrier protocol / TMA transaction "
                  "bytes?); exiting\n",
                  what.c_str(), kHangSeconds);
      std::fflush(stdout);
      std::_Exit(3);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  CHECK_CUDA(e);
}

// cudaDeviceSynchronize for the default stream, with the deadline.
inline void sync_or_die(const std::string& what) {
  wait_or_die([] { return cudaStreamQuery(0); }, what);
  CHECK_CUDA(cudaDeviceSynchronize());
}
