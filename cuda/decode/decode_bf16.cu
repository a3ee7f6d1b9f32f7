// Decoding kernels for __nv_bfloat16 (see decode_launch.cuh).
#include "decode/decode_launch.cuh"

namespace jax_flash::decode {
template cudaError_t launch_decode<__nv_bfloat16>(const DecodeParams&, cudaStream_t);
}  // namespace jax_flash::decode
