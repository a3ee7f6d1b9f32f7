// Host emulator runtime: coroutine CTAs, warp collectives with PTX fragment
// semantics, deferred cp.async, and the handful of CUDA runtime calls the
// launcher and the self-test make (memory lives in host RAM).
// See emu_device.h. Build: see cuda/tests/README.md.
#include <ucontext.h>

#include <algorithm>
#include <cassert>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "emu_device.h"
#include "tests/host_utils.h"

namespace jf_emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kMaxSmem = 227 * 1024;  // sm90 opt-in maximum (sm80: 163 KB)

enum class Kind : int { kNone, kMma, kLdsm, kShfl, kShflIdx };

struct Slot {
  Kind kind;
  float c[4];
  uint32_t a[4];
  uint32_t b[2];
  uint32_t addr;
  bool flag;
  float v;
  int mask;
  // results
  float oc[4];
  uint32_t r[4];
  float ov;
};

struct CopyOp {
  char* dst;
  const char* src;
  bool valid;
};

// cp.reduce.async.bulk (add.f32) from shared to global, performed at the
// bulk wait that covers it: the latest moment the hardware may read the
// source, so a source overwritten before its wait shows up as a wrong sum.
struct BulkOp {
  float* dst;
  const float* src;
  int count;
};

struct Thread {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;
  uint3 tid;
  bool done = false;
  std::vector<CopyOp> open_group;
  std::deque<std::vector<CopyOp>> groups;
  std::vector<BulkOp> bulk_open;
  std::deque<std::vector<BulkOp>> bulk_groups;
};

struct WarpState {
  int arrived = 0;
  uint64_t gen = 0;
  Slot slot[32];
};

struct Cta {
  dim3 grid, block;
  uint3 bid;
  std::vector<Thread> threads;
  std::vector<WarpState> warps;
  int bar_arrived = 0;
  uint64_t bar_gen = 0;
  char* smem = nullptr;
  size_t smem_bytes = 0;
  const std::function<void()>* body = nullptr;
  int current = -1;
  ucontext_t sched;
  int live = 0;
};

thread_local Cta* g_cta = nullptr;

struct Stats {
  uint64_t ldsm_matrices = 0, ldsm_wavefronts = 0;
  ~Stats() {
    if (ldsm_matrices)
      std::fprintf(stderr, "[emu] ldmatrix: %llu 8x8 matrices, %llu wavefronts (%.3f per matrix; 1.000 = conflict free)\n",
                   (unsigned long long)ldsm_matrices, (unsigned long long)ldsm_wavefronts,
                   double(ldsm_wavefronts) / double(ldsm_matrices));
  }
} g_stats;

// Stress knobs (environment):
//   JF_EMU_CPASYNC=eager  perform cp.async copies at issue time (catches a tile
//                         overwritten while other warps still read it);
//                         default "deferred": at wait_group (catches reads of a
//                         tile before its wait).
//   JF_EMU_SHUFFLE=seed   run the threads of a CTA in a random order each
//                         scheduling round (default: round-robin).
bool eager_cp_async() {
  static const bool v = [] {
    const char* e = std::getenv("JF_EMU_CPASYNC");
    return e && std::strcmp(e, "eager") == 0;
  }();
  return v;
}
unsigned shuffle_seed() {
  static const unsigned v = [] {
    const char* e = std::getenv("JF_EMU_SHUFFLE");
    return e ? unsigned(std::strtoul(e, nullptr, 10)) : 0u;
  }();
  return v;
}
std::map<const void*, int> g_max_dyn_smem;  // cudaFuncSetAttribute values
cudaError_t g_last_error = cudaSuccess;

Thread& self() { return g_cta->threads[g_cta->current]; }
int linear_tid() { return g_cta->current; }

void yield() { swapcontext(&self().ctx, &g_cta->sched); }

void thread_entry() {
  (*g_cta->body)();
  self().done = true;
  --g_cta->live;
  if (!self().open_group.empty() && false) trap("uncommitted cp.async");
  if (!self().bulk_open.empty() || !self().bulk_groups.empty())
    trap("bulk reduction not waited for before the thread exited");
  // Exited threads no longer count towards __syncthreads.
  if (g_cta->bar_arrived > 0 && g_cta->bar_arrived == g_cta->live) {
    g_cta->bar_arrived = 0;
    ++g_cta->bar_gen;
  }
  // Returning lets uc_link switch back to the scheduler.
}

// ---------------------------------------------------------------- 16-bit
float half_bits_to_float(uint16_t b, bool fp16) { return from_bits(b, fp16); }
float lo(uint32_t x, bool fp16) { return half_bits_to_float(uint16_t(x & 0xFFFF), fp16); }
float hi(uint32_t x, bool fp16) { return half_bits_to_float(uint16_t(x >> 16), fp16); }

// Generic warp collective: deposit, wait for the warp, compute once.
template <typename Compute>
Slot& collective(Kind kind, const Slot& in, Compute compute) {
  const int t = linear_tid();
  WarpState& w = g_cta->warps[t / 32];
  const int lane = t % 32;
  w.slot[lane] = in;
  w.slot[lane].kind = kind;
  const uint64_t my_gen = w.gen;
  if (++w.arrived == 32) {
    for (int l = 0; l < 32; ++l)
      if (w.slot[l].kind != kind) trap("divergent warp collective");
    compute(w.slot);
    w.arrived = 0;
    ++w.gen;
  } else {
    while (w.gen == my_gen) yield();
  }
  return w.slot[lane];
}

}  // namespace

// ---------------------------------------------------------------- builtins
uint3 thread_idx() { return self().tid; }
uint3 block_idx() { return g_cta->bid; }
dim3 block_dim() { return g_cta->block; }
dim3 grid_dim() { return g_cta->grid; }
char* smem_base() { return g_cta->smem; }

void trap(const char* why) {
  std::fprintf(stderr, "emulator trap: %s (block %u,%u,%u thread %d)\n", why,
               g_cta ? g_cta->bid.x : 0, g_cta ? g_cta->bid.y : 0, g_cta ? g_cta->bid.z : 0,
               g_cta ? g_cta->current : -1);
  std::abort();
}

void syncthreads() {
  const uint64_t my_gen = g_cta->bar_gen;
  if (++g_cta->bar_arrived == g_cta->live) {
    g_cta->bar_arrived = 0;
    ++g_cta->bar_gen;
  } else {
    while (g_cta->bar_gen == my_gen) yield();
  }
}

// mma.m16n8k16.row.col.f32.{bf16,f16}: per PTX ISA fragment tables.
//   A: reg i of lane l: rows g (i even) / g+8 (i odd), cols 2t + 8*(i>=2) + {0,1}
//   B: reg i: rows (k) 2t + 8*i + {0,1}, col g
//   C: c[i]: row g + 8*(i>=2), col 2t + (i&1)
void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool fp16) {
  Slot in{};
  std::memcpy(in.c, c, sizeof in.c);
  std::memcpy(in.a, a, sizeof in.a);
  in.b[0] = b0;
  in.b[1] = b1;
  in.flag = fp16;
  Slot& out = collective(Kind::kMma, in, [](Slot* s) {
    const bool f16 = s[0].flag;
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, t = l % 4;
      for (int i = 0; i < 4; ++i) {
        const int r = g + 8 * (i & 1), col = 2 * t + 8 * (i >> 1);
        A[r][col] = lo(s[l].a[i], f16);
        A[r][col + 1] = hi(s[l].a[i], f16);
      }
      for (int i = 0; i < 2; ++i) {
        const int k = 2 * t + 8 * i;
        B[k][g] = lo(s[l].b[i], f16);
        B[k + 1][g] = hi(s[l].b[i], f16);
      }
      for (int i = 0; i < 4; ++i) C[g + 8 * (i >> 1)][2 * t + (i & 1)] = s[l].c[i];
    }
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, t = l % 4;
      for (int i = 0; i < 4; ++i) {
        const int r = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        float acc = C[r][col];
        for (int k = 0; k < 16; ++k) acc += A[r][k] * B[k][col];
        s[l].oc[i] = acc;
      }
    }
  });
  std::memcpy(c, out.oc, sizeof out.oc);
}

// ldmatrix.x4 (.trans): lanes 8i..8i+7 address the rows of matrix i (16 bytes
// each, 16-byte aligned, inside shared memory). Lane l receives of matrix i:
//   plain: row l/4, elements 2(l%4), 2(l%4)+1
//   trans: elements (row 2(l%4), col l/4) and (row 2(l%4)+1, col l/4)
void ldmatrix(uint32_t (&r)[4], uint32_t addr, bool trans) {
  if (addr % 16 != 0 || addr + 16 > g_cta->smem_bytes) trap("ldmatrix address");
  Slot in{};
  in.addr = addr;
  in.flag = trans;
  Slot& out = collective(Kind::kLdsm, in, [](Slot* s) {
    for (int l = 0; l < 32; ++l)
      if (s[l].flag != s[0].flag) trap("mixed ldmatrix");
    const bool tr = s[0].flag;
    for (int m = 0; m < 4; ++m) {
      // Bank conflicts: the 8 16-byte rows of one matrix are one wavefront
      // when they fall into 8 distinct 16-byte bank groups.
      int per_group[8] = {0};
      int worst = 0;
      for (int row = 0; row < 8; ++row)
        worst = std::max(worst, ++per_group[(s[8 * m + row].addr >> 4) & 7]);
      g_stats.ldsm_matrices += 1;
      g_stats.ldsm_wavefronts += worst;
      uint16_t mat[8][8];
      for (int row = 0; row < 8; ++row)
        std::memcpy(mat[row], g_cta->smem + s[8 * m + row].addr, 16);
      for (int l = 0; l < 32; ++l) {
        uint16_t e0, e1;
        if (!tr) {
          e0 = mat[l / 4][2 * (l % 4)];
          e1 = mat[l / 4][2 * (l % 4) + 1];
        } else {
          e0 = mat[2 * (l % 4)][l / 4];
          e1 = mat[2 * (l % 4) + 1][l / 4];
        }
        s[l].r[m] = uint32_t(e0) | (uint32_t(e1) << 16);
      }
    }
  });
  std::memcpy(r, out.r, sizeof out.r);
}

float shfl_xor(float v, int mask) {
  Slot in{};
  in.v = v;
  in.mask = mask;
  Slot& out = collective(Kind::kShfl, in, [](Slot* s) {
    for (int l = 0; l < 32; ++l) s[l].ov = s[l ^ s[l].mask].v;
  });
  return out.ov;
}

float shfl_idx(float v, int src_lane) {
  Slot in{};
  in.v = v;
  in.mask = src_lane;
  Slot& out = collective(Kind::kShflIdx, in, [](Slot* s) {
    for (int l = 0; l < 32; ++l) s[l].ov = s[s[l].mask & 31].v;
  });
  return out.ov;
}

void cp_async(uint32_t dst, const void* src, bool valid) {
  if (dst % 16 != 0 || dst + 16 > g_cta->smem_bytes) trap("cp.async destination");
  if (valid && reinterpret_cast<uintptr_t>(src) % 16 != 0) trap("cp.async source alignment");
  if (eager_cp_async()) {
    if (valid)
      std::memcpy(g_cta->smem + dst, src, 16);
    else
      std::memset(g_cta->smem + dst, 0, 16);
    return;
  }
  self().open_group.push_back({g_cta->smem + dst, static_cast<const char*>(src), valid});
}
void bulk_reduce_add_f32(float* dst, uint32_t src, int bytes) {
  if (src % 16 != 0 || bytes % 16 != 0 || src + bytes > g_cta->smem_bytes) trap("bulk source");
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0) trap("bulk destination alignment");
  self().bulk_open.push_back({dst, reinterpret_cast<const float*>(g_cta->smem + src), bytes / 4});
}
void bulk_commit() {
  self().bulk_groups.push_back(std::move(self().bulk_open));
  self().bulk_open.clear();
}
void bulk_wait(int n) {
  auto& gs = self().bulk_groups;
  while (int(gs.size()) > n) {
    for (const BulkOp& op : gs.front())
      for (int i = 0; i < op.count; ++i) op.dst[i] += op.src[i];
    gs.pop_front();
  }
}
void cp_async_commit() {
  self().groups.push_back(std::move(self().open_group));
  self().open_group.clear();
}
void cp_async_wait(int n) {
  auto& gs = self().groups;
  while (int(gs.size()) > n) {
    for (const CopyOp& op : gs.front()) {
      if (op.valid)
        std::memcpy(op.dst, op.src, 16);
      else
        std::memset(op.dst, 0, 16);
    }
    gs.pop_front();
  }
}

cudaError_t launch(dim3 grid, dim3 block, size_t smem_bytes, const void* func,
                   const std::function<void()>& body) {
  const int nthreads = int(block.x * block.y * block.z);
  if (nthreads <= 0 || nthreads > 1024 || nthreads % 32 != 0 || grid.x == 0 || grid.y == 0 ||
      grid.z == 0 || grid.y > 65535 || grid.z > 65535)
    return g_last_error = cudaErrorInvalidConfiguration;
  int allowed = 48 * 1024;
  auto it = g_max_dyn_smem.find(func);
  if (it != g_max_dyn_smem.end()) allowed = it->second;
  if (smem_bytes > size_t(allowed)) return g_last_error = cudaErrorInvalidValue;
  // 1 KB-aligned shared memory, filled with NaN patterns (0xFF bytes).
  std::unique_ptr<char[]> smem_raw(new char[smem_bytes + 2048]);
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw.get()) + 1023) & ~uintptr_t(1023));
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Cta cta;
        cta.grid = grid;
        cta.block = block;
        cta.bid = make_uint3(bx, by, bz);
        cta.smem = smem;
        cta.smem_bytes = smem_bytes;
        std::memset(smem, 0xFF, smem_bytes);
        cta.body = &body;
        cta.threads.resize(nthreads);
        cta.warps.resize(nthreads / 32);
        cta.live = nthreads;
        g_cta = &cta;
        for (int t = 0; t < nthreads; ++t) {
          Thread& th = cta.threads[t];
          th.tid = make_uint3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
          th.stack.reset(new char[kStackBytes]);
          getcontext(&th.ctx);
          th.ctx.uc_stack.ss_sp = th.stack.get();
          th.ctx.uc_stack.ss_size = kStackBytes;
          th.ctx.uc_link = &cta.sched;
          makecontext(&th.ctx, thread_entry, 0);
        }
        // Round-robin until every thread finished; a full round without any
        // thread making progress is a deadlock (e.g. a barrier skipped by some).
        std::vector<int> order(nthreads);
        for (int t = 0; t < nthreads; ++t) order[t] = t;
        std::mt19937 rng(shuffle_seed() + bx * 7919 + by * 104729 + bz);
        while (cta.live > 0) {
          if (shuffle_seed()) std::shuffle(order.begin(), order.end(), rng);
          for (int t : order) {
            if (cta.threads[t].done) continue;
            cta.current = t;
            swapcontext(&cta.sched, &cta.threads[t].ctx);
          }
        }
        g_cta = nullptr;
      }
  (void)kMaxSmem;
  return cudaSuccess;
}

void set_max_dynamic_smem(const void* func, int bytes) { g_max_dyn_smem[func] = bytes; }

}  // namespace jf_emu

// ---------------------------------------------------------------- runtime API
// JF_EMU_SMEM_KB: opt-in shared memory per block to emulate (default 227 =
// H100/H200; 163 = A100, 99 = sm86/sm89) to exercise the small-tile fallbacks.
static int emu_smem_optin() {
  const char* e = std::getenv("JF_EMU_SMEM_KB");
  return (e ? std::atoi(e) : 227) * 1024;
}
extern "C" {

cudaError_t cudaMalloc(void** p, size_t n) {
  *p = std::aligned_alloc(256, (n + 255) / 256 * 256);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFree(void* p) {
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind) {
  std::memcpy(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int v, size_t n) {
  std::memset(p, v, n);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  std::memset(p, v, n);
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
cudaError_t cudaGetLastError() {
  const cudaError_t e = jf_emu::g_last_error;
  jf_emu::g_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value > emu_smem_optin()) return cudaErrorInvalidValue;
    jf_emu::set_max_dynamic_smem(func, value);
  }
  return cudaSuccess;
}
// The compute capability the launchers see (JF_EMU_CC_MAJOR, default 8): 9
// selects the sm90-only paths that the emulator implements (bulk dQ reduce).
static int emu_cc_major() {
  const char* e = std::getenv("JF_EMU_CC_MAJOR");
  return e ? std::atoi(e) : 8;
}
cudaError_t cudaGetDevice(int* dev) {
  *dev = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  *value = attr == cudaDevAttrMultiProcessorCount ? 132
           : attr == cudaDevAttrComputeCapabilityMajor ? emu_cc_major()
           : attr == cudaDevAttrMaxSharedMemoryPerBlockOptin ? emu_smem_optin()
                                                              : 0;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int) {
  std::memset(prop, 0, sizeof *prop);
  std::strcpy(prop->name, "host emulator");
  prop->major = 8;
  prop->minor = 0;
  return cudaSuccess;
}
const char* cudaGetErrorName(cudaError_t e) {
  static char buf[32];
  std::snprintf(buf, sizeof buf, "cudaError(%d)", int(e));
  return buf;
}
const char* cudaGetErrorString(cudaError_t e) { return cudaGetErrorName(e); }

}  // extern "C"
