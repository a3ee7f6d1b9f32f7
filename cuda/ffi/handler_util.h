// Helpers shared by the XLA FFI handlers (handlers.cc, fp8_handlers.cc):
// messages, the NaN poisoning of outputs for tests, the mask options.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <string>

#include "jax_flash/device_attribute.h"
#include "jax_flash/packing_layout.h"
#include "jax_flash/params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash {

namespace ffi = xla::ffi;

inline std::string ShapeStr(const ffi::AnyBuffer& b) {
  std::string s = "[";
  auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(dims[i]);
  }
  return s + "]";
}

inline ffi::Error Invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_flash cuda: " + msg);
}

inline ffi::Error LaunchError(cudaError_t err, const char* what) {
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_flash cuda: ") + what +
                              " launch failed: " + cudaGetErrorString(err));
}

// JAX_FLASH_POISON_OUTPUTS=1 (read once): fill outputs with NaN (all bits set
// is a NaN in fp16, bf16 and fp32) before the launch so that any element a
// kernel fails to write shows up in the tests.
inline bool PoisonOutputs() {
  static const bool poison = [] {
    const char* env = std::getenv("JAX_FLASH_POISON_OUTPUTS");
    return env != nullptr && env[0] == '1';
  }();
  return poison;
}

inline void Poison(void* ptr, size_t bytes, cudaStream_t stream) {
  if (PoisonOutputs()) cudaMemsetAsync(ptr, 0xFF, bytes, stream);
}

inline bool SameShape(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  auto x = a.dimensions(), y = b.dimensions();
  if (x.size() != y.size()) return false;
  for (size_t i = 0; i < x.size(); ++i) if (x[i] != y[i]) return false;
  return a.element_type() == b.element_type();
}

// Shapes, contiguous [batch, seq, heads, head_dim] strides (elements) and
// pointers of q, k, v (q and k give the shapes, v its head dim; o, which the
// caller checks, is q's shape with v's head dim).
inline void FillShapes(FwdParams& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                const ffi::AnyBuffer& v) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  p.batch = static_cast<int>(qd[0]);
  p.seqlen_q = static_cast<int>(qd[1]);
  p.num_heads = static_cast<int>(qd[2]);
  p.head_dim = static_cast<int>(qd[3]);
  p.head_dim_v = static_cast<int>(vd[3]);
  p.seqlen_k = static_cast<int>(kd[1]);
  p.num_heads_k = static_cast<int>(kd[2]);
  // Contiguous BTHD strides (elements).
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  p.q_head_stride = D;
  p.q_row_stride = D * p.num_heads;
  p.q_batch_stride = p.q_row_stride * p.seqlen_q;
  p.k_head_stride = D;
  p.k_row_stride = D * p.num_heads_k;
  p.k_batch_stride = p.k_row_stride * p.seqlen_k;
  p.v_head_stride = Dv;
  p.v_row_stride = Dv * p.num_heads_k;
  p.v_batch_stride = p.v_row_stride * p.seqlen_k;
  p.o_head_stride = Dv;
  p.o_row_stride = Dv * p.num_heads;
  p.o_batch_stride = p.o_row_stride * p.seqlen_q;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
}

inline ffi::Error FillOptions(FwdParams& p, float scale, float softcap,
                       int32_t window_left, int32_t window_right,
                       bool has_segment_ids, const ffi::AnyBuffer& q_seg,
                       const ffi::AnyBuffer& kv_seg) {
  if (!std::isfinite(scale)) return Invalid("scale must be finite");
  if (softcap < 0.f) return Invalid("softcap must be >= 0 (0 = off)");
  if (window_left < -1 || window_right < -1) return Invalid("window sides must be >= -1");
  p.scale = scale;
  p.softcap = softcap;
  p.window_left = window_left;
  p.window_right = window_right;
  p.q_segment = nullptr;
  p.kv_segment = nullptr;
  if (has_segment_ids) {
    if (q_seg.element_type() != ffi::DataType::S32 ||
        kv_seg.element_type() != ffi::DataType::S32) {
      return Invalid("segment ids must be int32");
    }
    if (q_seg.element_count() != static_cast<size_t>(p.batch) * p.seqlen_q ||
        kv_seg.element_count() != static_cast<size_t>(p.batch) * p.seqlen_k) {
      return Invalid("segment ids must be [batch, seqlen_q] and [batch, seqlen_k]; got " +
                     ShapeStr(q_seg) + ", " + ShapeStr(kv_seg));
    }
    p.q_segment = static_cast<const int32_t*>(q_seg.untyped_data());
    p.kv_segment = static_cast<const int32_t*>(kv_seg.untyped_data());
  }
  p.num_sms = device_attribute<cudaDevAttrMultiProcessorCount>(0);
  return ffi::Error::Success();
}

// Attention dropout: the key words (uint32 [6]: key0, key1, batch0, head0,
// row0, col0, device data from a traced jax.random key and the call's origin;
// a dummy without dropout) and the
// byte threshold round(rate * 256) in [0, 255] (0 = no dropout).
inline ffi::Error FillDropout(FwdParams& p, const ffi::Buffer<ffi::U32>& words, int32_t threshold,
                              bool broadcast) {
  if (threshold < 0 || threshold > 255) {
    return Invalid("dropout_threshold must be in 0..255 (round(rate * 256)); got " +
                   std::to_string(threshold));
  }
  p.dropout = DropoutArgs{};
  if (threshold == 0) return ffi::Error::Success();
  if (words.element_count() != 6) {
    return Invalid("dropout key words must be uint32 [6] (key0, key1, batch0, head0, row0, col0); "
                   "got " + std::to_string(words.element_count()) + " elements");
  }
  p.dropout.words = words.typed_data();
  p.dropout.threshold = static_cast<uint32_t>(threshold);
  p.dropout.broadcast = broadcast;
  return ffi::Error::Success();
}

// The packing buffer (int32, jax_flash/packing_layout.h), written by the
// tile-span pre-pass (PackingImpl). Only with segment ids; else ignored.
inline ffi::Error FillPacking(FwdParams& p, const ffi::AnyBuffer& packing, bool has_shifts) {
  if (p.q_segment == nullptr) return ffi::Error::Success();
  const PackingLayout l = packing_layout(p.batch, p.seqlen_q, p.seqlen_k, has_shifts);
  if (packing.element_type() != ffi::DataType::S32 ||
      packing.element_count() != static_cast<size_t>(l.total)) {
    return Invalid("packing must be int32 [" + std::to_string(l.total) +
                   "] (jax_flash/packing_layout.h); got " + ShapeStr(packing));
  }
  if ((reinterpret_cast<uintptr_t>(packing.untyped_data()) & 31) != 0) {
    return Invalid("packing must be 32-byte aligned");
  }
  const int32_t* base = static_cast<const int32_t*>(packing.untyped_data());
  p.q_span = base + l.q_span;
  p.kv_span = base + l.kv_span;
  p.q_iv = base + l.q_iv;
  p.kv_iv = base + l.kv_iv;
  if (has_shifts) {
    p.q_shift = base + l.q_shift;
    p.kv_shift = base + l.kv_shift;
  }
  return ffi::Error::Success();
}

}  // namespace jax_flash
