// Decoding kernels for __nv_bfloat16 (see decode_launch.cuh).
#include "decode/decode_launch.cuh"

namespace jax_flash::decode {
template cudaError_t launch_decode_split<__nv_bfloat16>(const DecodeParams&, cudaStream_t);
template cudaError_t launch_decode_combine<__nv_bfloat16>(const DecodeParams&, cudaStream_t, CombineKind);
}  // namespace jax_flash::decode
