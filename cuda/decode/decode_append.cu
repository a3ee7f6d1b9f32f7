// The append kernel of decode_append.h: one thread per 16-byte chunk of a new
// token's key row (and the same chunk of its value row).
#include <cstdint>

#include "decode/decode_append.h"
#include "jax_flash/support.h"
#include "sm80/mma.cuh"  // JF_LAUNCH (or its host emulation)

namespace jax_flash::decode {

namespace {

constexpr int kAppendThreads = 128;
constexpr int kChunkElems = 8;  // 16 bytes of 16-bit elements

JF_DEVICE int32_t held_after(const AppendParams& p, int b) {
  const int64_t capacity = int64_t(p.max_pages) * p.page_size;
  const int64_t total = int64_t(p.seqlens[b]) + p.seqlen_new;
  return int32_t(total < 0 ? 0 : (total > capacity ? capacity : total));
}

__global__ void __launch_bounds__(kAppendThreads) append_kernel(const __grid_constant__ AppendParams p) {
  const int64_t i = int64_t(blockIdx.x) * kAppendThreads + threadIdx.x;
  const int64_t row_chunks = int64_t(p.num_heads_k) * (p.head_dim / kChunkElems);  // a slot, all heads
  const int64_t per_seq = p.seqlen_new * row_chunks;
  if (per_seq == 0) {  // no new tokens: the lengths only
    if (i < p.batch) p.seqlens_out[i] = held_after(p, int(i));
    return;
  }
  if (i >= p.batch * per_seq) return;
  const int b = int(i / per_seq);
  const int64_t r = i % per_seq;  // t * row_chunks + (h * chunks + c): k_new's own order
  if (r == 0) p.seqlens_out[b] = held_after(p, b);
  const int64_t pos = int64_t(p.seqlens[b]) + r / row_chunks;
  if (pos < 0 || pos >= int64_t(p.max_pages) * p.page_size) return;
  const int page = p.page_table ? p.page_table[int64_t(b) * p.max_pages + pos / p.page_size] : b;
  if (page < 0 || page >= p.num_pages) return;
  const int64_t dst = (int64_t(page) * p.page_size + pos % p.page_size) * row_chunks + r % row_chunks;
  const int64_t src = i;  // [batch, seqlen_new, heads_k, head_dim] in chunks
  reinterpret_cast<int4*>(p.k)[dst] = reinterpret_cast<const int4*>(p.k_new)[src];
  reinterpret_cast<int4*>(p.v)[dst] = reinterpret_cast<const int4*>(p.v_new)[src];
}

int64_t append_threads(const AppendParams& p) {
  const int64_t per_seq = int64_t(p.seqlen_new) * p.num_heads_k * (p.head_dim / kChunkElems);
  return int64_t(p.batch) * (per_seq > 0 ? per_seq : 1);
}

}  // namespace

bool append_supported(const AppendParams& p) {
  if (p.batch < 0 || p.seqlen_new < 0 || p.num_heads_k <= 0) return false;
  if (p.head_dim <= 0 || p.head_dim % kChunkElems != 0) return false;
  if (p.page_size <= 0 || p.max_pages < 0 || p.num_pages < 0) return false;
  if (int64_t(p.max_pages) * p.page_size > (int64_t(1) << 31) - 1) return false;
  if ((append_threads(p) + kAppendThreads - 1) / kAppendThreads > (int64_t(1) << 31) - 1) return false;
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
  const unsigned blocks = unsigned((append_threads(p) + kAppendThreads - 1) / kAppendThreads);
  auto kernel = append_kernel;
  JF_LAUNCH(kernel, dim3(blocks), kAppendThreads, 0, stream)(p);
  return cudaGetLastError();
}

}  // namespace jax_flash::decode
