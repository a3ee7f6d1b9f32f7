// The append kernel of decode_append.h: a CTA per sequence, each thread
// copying 16-byte chunks of the new tokens' key rows (and the same chunks of
// their value rows).
#include <cstdint>

#include "decode/decode_append.h"
#include "jax_flash/support.h"
#include "sm80/mma.cuh"  // JF_LAUNCH (or its host emulation)

namespace jax_flash::decode {

namespace {

constexpr int kAppendThreads = 128;
constexpr int kChunkElems = 8;  // 16 bytes of 16-bit elements

JF_DEVICE int32_t held_after(int64_t held, const AppendParams& p) {
  const int64_t capacity = int64_t(p.max_pages) * p.page_size;
  const int64_t total = held + p.seqlen_new;
  return int32_t(total < 0 ? 0 : (total > capacity ? capacity : total));
}

// One CTA per sequence: its threads read the sequence's length, then one
// writes the length after, past a barrier, so that seqlens_out may be
// seqlens itself (the FFI call updates a cache index in place).
__global__ void __launch_bounds__(kAppendThreads) append_kernel(const __grid_constant__ AppendParams p) {
  const int b = blockIdx.x;
  const int64_t held = p.seqlens[b];
  __syncthreads();
  if (threadIdx.x == 0) p.seqlens_out[b] = held_after(held, p);
  // 32-bit index math (append_supported bounds it); 64-bit offsets.
  const int row_chunks = p.num_heads_k * (p.head_dim / kChunkElems);  // a slot, all heads
  const int per_seq = p.seqlen_new * row_chunks;
  const int capacity = p.max_pages * p.page_size;
  for (int r = threadIdx.x; r < per_seq; r += kAppendThreads) {
    // r = t * row_chunks + (h * chunks + c): k_new's own order
    const int64_t pos = held + r / row_chunks;
    if (pos < 0 || pos >= capacity) continue;
    const int at = int(pos);
    const int page = p.page_table ? p.page_table[int64_t(b) * p.max_pages + at / p.page_size] : b;
    if (page < 0 || page >= p.num_pages) continue;
    const int64_t dst = (int64_t(page) * p.page_size + at % p.page_size) * row_chunks + r % row_chunks;
    const int64_t src = int64_t(b) * per_seq + r;  // [batch, seqlen_new, heads_k, head_dim] in chunks
    reinterpret_cast<int4*>(p.k)[dst] = reinterpret_cast<const int4*>(p.k_new)[src];
    reinterpret_cast<int4*>(p.v)[dst] = reinterpret_cast<const int4*>(p.v_new)[src];
  }
}

}  // namespace

bool append_supported(const AppendParams& p) {
  if (p.batch < 0 || p.seqlen_new < 0 || p.num_heads_k <= 0) return false;
  if (p.head_dim <= 0 || p.head_dim % kChunkElems != 0) return false;
  if (p.page_size <= 0 || p.max_pages < 0 || p.num_pages < 0) return false;
  if (int64_t(p.max_pages) * p.page_size > (int64_t(1) << 31) - 1) return false;
  if (int64_t(p.seqlen_new) * p.num_heads_k * (p.head_dim / kChunkElems) > (int64_t(1) << 31) - 1)
    return false;
  if (p.batch > 0 && (p.seqlens == nullptr || p.seqlens_out == nullptr)) return false;
  if (p.page_table == nullptr && p.max_pages != 1) return false;  // row b = sequence b
  if (p.batch > 0 && p.seqlen_new > 0 &&
      (!aligned16(p.k) || !aligned16(p.v) || !aligned16(p.k_new) || !aligned16(p.v_new)))
    return false;
  return true;
}

cudaError_t run_append(const AppendParams& p, cudaStream_t stream) {
  if (!append_supported(p)) return cudaErrorInvalidValue;
  if (p.batch == 0) return cudaSuccess;
  auto kernel = append_kernel;
  JF_LAUNCH(kernel, dim3(unsigned(p.batch)), kAppendThreads, 0, stream)(p);
  return cudaGetLastError();
}

}  // namespace jax_flash::decode
