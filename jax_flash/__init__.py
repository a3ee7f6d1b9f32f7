"""jax_flash: FlashAttention for JAX (CUDA, Pallas and pure-XLA backends)."""

from jax_flash._src.backends import cuda as _cuda  # registers "cuda"
from jax_flash._src.backends import xla as _xla  # registers the "xla" backend
from jax_flash._src.api.attention import attention
from jax_flash._src.backends.registry import Unsupported
from jax_flash._src.backends.registry import runnable as available_implementations
from jax_flash._src.backends.build_info import build_info
from jax_flash._src.fp8.attention import fp8_attention
from jax_flash._src.fp8.tensor import Fp8Tensor, quantize_fp8
from jax_flash._src.decode.fp8_cache import Fp8KVCache, quantize_kv_cache
from jax_flash._src.decode.kvcache import attention_with_kvcache
from jax_flash._src.compat.nn import dot_product_attention
from jax_flash._src.ring.api import ring_attention
from jax_flash._src.api.varlen import varlen_attention

try:  # Pallas is part of jax, but keep the package importable without it.
  from jax_flash._src.backends.pallas import backend as _pallas  # registers "pallas"
except ImportError:  # pragma: no cover
  _pallas = None

__version__ = "0.1.0"
__all__ = ["attention", "dot_product_attention", "ring_attention",
           "varlen_attention", "attention_with_kvcache",
           "fp8_attention", "quantize_fp8", "Fp8Tensor",
           "quantize_kv_cache", "Fp8KVCache",
           "Unsupported", "available_implementations", "build_info",
           "__version__"]
