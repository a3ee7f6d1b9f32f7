// Division of key positions by the call's page size, which every tile load
// needs (page and slot of its keys): a multiply-high and a shift in place of
// the integer division sequence (~20 instructions per use), the multiplier
// computed once per CTA. Round-up multiplier (Granlund and Montgomery 1994,
// CUTLASS's FastDivmod): for a divisor d >= 2, p = 31 + ceil(log2 d) and
// m = ceil(2^p / d) (< 2^32), n / d = (n * m) >> p for every 0 <= n < 2^31.
#pragma once

#include <cstdint>

#include "jax_flash/host_device.h"

namespace jax_flash::decode {

struct PageDiv {
  uint32_t divisor, mul;
  int shift;  // p - 32

  JF_HOST_DEVICE explicit PageDiv(int d) : divisor(uint32_t(d)), mul(0), shift(0) {
    if (d > 1) {
      int log2_up = 0;
      while ((uint32_t(1) << log2_up) < uint32_t(d)) ++log2_up;
      const int p = 31 + log2_up;
      mul = uint32_t(((uint64_t(1) << p) + uint32_t(d) - 1) / uint32_t(d));
      shift = p - 32;
    }
  }
  // n / divisor for 0 <= n < 2^31.
  JF_HOST_DEVICE int div(int n) const {
    if (divisor == 1) return n;
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(uint32_t(n), mul);
#else
    const uint32_t hi = uint32_t((uint64_t(uint32_t(n)) * mul) >> 32);
#endif
    return int(hi >> shift);
  }
  // n % divisor, given q = n / divisor.
  JF_HOST_DEVICE int mod(int n, int q) const { return n - q * int(divisor); }
};

}  // namespace jax_flash::decode
