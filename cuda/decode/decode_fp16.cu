// Decoding kernels for __half (see decode_launch.cuh).
#include "decode/decode_launch.cuh"

namespace jax_flash::decode {
template cudaError_t launch_decode<__half>(const DecodeParams&, cudaStream_t);
}  // namespace jax_flash::decode
