// JF_HOST_DEVICE: the qualifier of the small functions shared by the kernels
// (device code), their launchers (host code) and the host-only checks that
// compile the same headers with a plain C++ compiler (no CUDA).
#pragma once

#if defined(__CUDACC__)
#define JF_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JF_HOST_DEVICE inline
#endif
