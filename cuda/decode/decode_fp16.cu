// Decoding kernels for __half (see decode_launch.cuh).
#include "decode/decode_launch.cuh"

namespace jax_flash::decode {
template cudaError_t launch_decode_split<__half>(const DecodeParams&, cudaStream_t);
template cudaError_t launch_decode_combine<__half>(const DecodeParams&, cudaStream_t, CombineKind);
}  // namespace jax_flash::decode
