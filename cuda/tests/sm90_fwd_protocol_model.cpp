// Thread model of the sm90 forward CTA protocol (fwd_kernel.cuh, mainloop.cuh,
// epilogue.cuh): producer warp, kWG consumer warpgroups (one thread each),
// with dropout's producer mask (FwdTuning::dropout_producer_mask) kMaskers
// mask threads (the mask warps; full_mask counts each, empty_mask each
// consumer, the tile hand-off both),
// mbarriers (full/empty Q, K[2], V[2], mask[2], o_free, tile hand-off), named barriers
// (pingpong turns, OWrite), the dynamic tile counter, and shared-memory cells
// tagged with what they hold. Asynchronous effects are placed at their most
// dangerous point: TMA loads write at issue, wgmma reads at wgmma_wait, TMA
// stores read at bulk_wait_read. Checks every read sees the right tag, every
// tile is processed once, and no deadlock (timeout). Random yields explore
// interleavings.
//
// Host only, no GPU: g++ -O2 -std=c++17 -pthread cuda/tests/sm90_fwd_protocol_model.cpp
//   -o /tmp/m && /tmp/m [trials per configuration, default 300]  (~10 s)
// Mutations of the protocol (no o_free wait, o_free parity off by one, no
// OWrite barrier, o_free before the store read, tile_empty parity off by one;
// the mask ring: no empty_mask wait, its parity off by one, tile_empty
// without the mask threads' arrivals) are caught as bad reads or DEADLOCK.
// Keep in step with the kernel code.
// varlen (fwd_varlen_kernel.cuh, varlen_scheduler.cuh): the tile hand-off
// numbered from the CTA's first tile (hand-off 0) and ending on an invalid
// tile, the V tail zeroed by every consumer WG after its first QK^T
// (kBarVarlenV), and WGs whose rows cross a sequence's end storing O by
// guarded row reads of the staged tile before its release.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

static std::mutex mu;
static std::condition_variable cv;
static std::atomic<bool> failed{false};
static std::string fail_msg;
static thread_local std::mt19937 trng;
static void jitter() { for (int k = trng() % 4; k > 0; --k) std::this_thread::yield(); }
static bool wait_until(const std::function<bool()>& pred) {  // under no lock
  std::unique_lock<std::mutex> l(mu);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  while (!pred()) {
    if (failed) return false;
    if (cv.wait_until(l, deadline) == std::cv_status::timeout && !pred()) {
      if (!failed) fail_msg = "DEADLOCK";
      failed = true;
      cv.notify_all();
      return false;
    }
  }
  return true;
}

struct MBar { int count = 1, pending = 1, done = 0; };
struct NBar { int arrived = 0, gen = 0; };

struct Cfg { int wg; bool pingpong, overlap, dynamic, oinv, alias_q, varlen = false, drop = false; };
constexpr int kMaskers = 2;  // model threads standing for the mask warps (each arrives on full_mask)
struct Tag { int kind = 0, tile = -1, x = -1; bool operator==(const Tag& o) const { return kind == o.kind && tile == o.tile && x == o.x; } };
enum { kQ = 1, kK, kV, kO, kM };

struct CTA {
  Cfg c;
  int bid, grid, total;
  const std::vector<int>* nb;  // KV blocks per tile (0 = no keys)
  const std::vector<int>* vtail;  // varlen: the tile's last KV block is partial (zeroed V rows)
  const std::vector<int>* short_wg;  // varlen: bit w: WG w's rows cross the sequence's end
  std::atomic<int>* counter;
  std::vector<std::atomic<int>>* seen;
  MBar full_q, empty_q, full_k[2], empty_k[2], full_v[2], empty_v[2], o_free, tile_full, tile_empty;
  MBar full_mask[2], empty_mask[2];
  NBar nbar[16];
  Tag qcell[3], kcell[2], vcell[2][3], ocell[3], mcell[2][kMaskers];
  int slot = -1;

  void mb_arrive(MBar& b) {
    std::lock_guard<std::mutex> l(mu);
    if (--b.pending == 0) { b.done++; b.pending = b.count; cv.notify_all(); }
  }
  void mb_wait(MBar& b, unsigned parity) { jitter(); wait_until([&] { return unsigned(b.done & 1) != parity; }); }
  // weight: 32 per warp; the producer warp is 32, a consumer WG 128.
  void bar_arrive(int id, int n, int w) {
    std::lock_guard<std::mutex> l(mu);
    NBar& b = nbar[id];
    b.arrived += w;
    if (b.arrived > n && !failed) { fail_msg = "named barrier overrun " + std::to_string(id); failed = true; cv.notify_all(); }
    if (b.arrived == n) { b.arrived = 0; b.gen++; cv.notify_all(); }
  }
  void bar_sync(int id, int n, int w) {
    jitter();
    int g;
    {
      std::lock_guard<std::mutex> l(mu);
      NBar& b = nbar[id];
      g = b.gen;
      b.arrived += w;
      if (b.arrived > n && !failed) { fail_msg = "named barrier overrun " + std::to_string(id); failed = true; cv.notify_all(); }
      if (b.arrived == n) { b.arrived = 0; b.gen++; cv.notify_all(); return; }
    }
    wait_until([&] { return nbar[id].gen != g; });
  }
  void check(const Tag& got, const Tag& want, const char* what) {
    std::lock_guard<std::mutex> l(mu);
    if (!(got == want) && !failed) {
      fail_msg = std::string("bad ") + what + ": got kind " + std::to_string(got.kind) + " tile " +
                 std::to_string(got.tile) + " x " + std::to_string(got.x) + ", want tile " +
                 std::to_string(want.tile) + " x " + std::to_string(want.x);
      failed = true;
      cv.notify_all();
    }
  }
  void put(Tag& cell, Tag t) { std::lock_guard<std::mutex> l(mu); cell = t; }
  Tag get(Tag& cell) { std::lock_guard<std::mutex> l(mu); return cell; }

  static constexpr int kBarEpi = 1, kBarSched = 4, kBarOWrite = 13, kBarVarlenV = 14;
  static constexpr int kZeroed = 1000;  // V tag offset of a stage whose tail rows a WG zeroed

  // varlen hand-off j (varlen_scheduler.cuh): publish by the producer, read by each consumer.
  void publish(unsigned j, int v) {
    mb_wait(tile_empty, (j & 1u) ^ 1u);
    { std::lock_guard<std::mutex> l(mu); slot = v; }
    mb_arrive(tile_full);
  }
  int read(unsigned j) {
    mb_wait(tile_full, j & 1u);
    int v;
    { std::lock_guard<std::mutex> l(mu); v = slot; }
    mb_arrive(tile_empty);
    return v;
  }

  void producer() {
    trng.seed(bid * 7919 + 1);
    int ks = 0, vs = 0; unsigned kp = 0, vp = 0;
    unsigned it = 0;
    int first = bid;
    if (c.varlen) {
      first = bid < total ? bid : -1;
      publish(0u, first);
    }
    for (int tile = first; tile >= 0 && tile < total && !failed; ++it) {
      int next = tile + grid;
      if (c.dynamic) next = counter->fetch_add(1) + grid;
      const int nblk = (*nb)[tile];
      auto load_k = [&](int n) {
        mb_wait(empty_k[ks], kp ^ 1u);
        put(kcell[ks], Tag{kK, tile, n});
        mb_arrive(full_k[ks]);
        if (++ks == 2) { ks = 0; kp ^= 1; }
      };
      auto load_v = [&](int n) {
        mb_wait(empty_v[vs], vp ^ 1u);
        for (int w = 0; w < c.wg; ++w) put(vcell[vs][w], Tag{kV, tile, n});
        mb_arrive(full_v[vs]);
        if (++vs == 2) { vs = 0; vp ^= 1; }
      };
      auto wait_o_free = [&] { if (c.oinv && it > 0) mb_wait(o_free, (it - 1) & 1u); };
      if (nblk > 0) load_k(nblk - 1);
      if (nblk == 0) wait_o_free();
      mb_wait(empty_q, (it & 1u) ^ 1u);
      for (int w = 0; w < c.wg; ++w) put(qcell[w], Tag{kQ, tile, w});
      mb_arrive(full_q);
      if (nblk > 0) wait_o_free();
      for (int n = nblk - 1; n >= 0; --n) {
        if (n > 0) load_k(n - 1);
        load_v(n);
      }
      if (c.varlen) {
        if (next >= total) next = -1;  // the decode past the last tile
        publish(it + 1, next);
      } else if (c.dynamic) {
        mb_wait(tile_empty, (it & 1u) ^ 1u);
        { std::lock_guard<std::mutex> l(mu); slot = next; }
        mb_arrive(tile_full);
      }
      tile = next;
    }
  }

  // Mask thread j (Cfg::drop): the masks of every block of the CTA's tiles, in
  // the consumers' order, into the 2-slot ring (mainloop.cuh make_masks); a
  // consumer of the tile hand-off (fwd_kernel.cuh mask_producer).
  void masker(int j) {
    trng.seed(bid * 15485863 + j + 5);
    int ms = 0; unsigned mp = 0;
    unsigned it = 0;
    for (int tile = bid; tile < total && !failed; ++it) {
      for (int n = (*nb)[tile] - 1; n >= 0; --n) {
        mb_wait(empty_mask[ms], mp ^ 1u);
        put(mcell[ms][j], Tag{kM, tile, n});
        mb_arrive(full_mask[ms]);
        if (++ms == 2) { ms = 0; mp ^= 1; }
      }
      int next = tile + grid;
      if (c.dynamic) {
        mb_wait(tile_full, it & 1u);
        { std::lock_guard<std::mutex> l(mu); next = slot; }
        mb_arrive(tile_empty);
      }
      tile = next;
    }
  }

  void consumer(int wg) {
    trng.seed(bid * 104729 + wg + 11);
    int ks = 0, vs = 0, ms = 0; unsigned kp = 0, vp = 0, mp = 0;
    const int nsched = 256;  // kBarSched: this WG + the one handing over the turn
    auto sched_sync = [&] { if (c.pingpong) bar_sync(kBarSched + wg, nsched, 128); };
    auto sched_arrive = [&] { if (c.pingpong) bar_arrive(kBarSched + (wg + 1 == c.wg ? 0 : wg + 1), nsched, 128); };
    if (c.pingpong && wg == 0) bar_arrive(kBarSched + 0, nsched, 128);
    unsigned it = 0;
    bool store_pending = false; Tag store_tag; Tag* store_cells[2] = {nullptr, nullptr}; int store_ncells = 0;
    auto wait_store_read = [&] {  // the TMA store reads its smem now (latest point)
      if (!store_pending) return;
      for (int i = 0; i < store_ncells; ++i) check(get(*store_cells[i]), store_tag, "O store source");
      store_pending = false;
    };
    int first = bid;
    if (c.varlen) first = read(0u);
    for (int tile = first; tile >= 0 && tile < total && !failed; ++it) {
      const int nblk = (*nb)[tile];
      const bool tail = c.varlen && (*vtail)[tile];
      // V tag of block n as the PV GEMM must read it.
      auto v_tag = [&](int n) { return Tag{kV, tile, n + (tail && n == nblk - 1 ? kZeroed : 0)}; };
      mb_wait(full_q, it & 1u);
      auto k_cons = [&](int n) {  // wait full, QK^T, (wgmma wait) reads Q and K
        mb_wait(full_k[ks], kp);
        check(get(qcell[wg]), Tag{kQ, tile, wg}, "Q");
        check(get(kcell[ks]), Tag{kK, tile, n}, "K");
      };
      auto k_rel = [&] { mb_arrive(empty_k[ks]); if (++ks == 2) { ks = 0; kp ^= 1; } };
      auto v_cons = [&](int n) {
        mb_wait(full_v[vs], vp);
        for (int w2 = 0; w2 < c.wg; ++w2) check(get(vcell[vs][w2]), v_tag(n), "V");
      };
      auto v_rel = [&] { mb_arrive(empty_v[vs]); if (++vs == 2) { vs = 0; vp ^= 1; } };
      auto m_cons = [&](int n) {  // Cfg::drop: load_mask (wait, read, release at once)
        if (!c.drop) return;
        mb_wait(full_mask[ms], mp);
        for (int j = 0; j < kMaskers; ++j) check(get(mcell[ms][j]), Tag{kM, tile, n}, "mask");
        mb_arrive(empty_mask[ms]);
        if (++ms == 2) { ms = 0; mp ^= 1; }
      };
      if (nblk > 0) {
        if (c.overlap) {
          int n = nblk - 1;
          k_cons(n); m_cons(n); k_rel();
          if (tail) {  // Consumer::zero_v_tail: this WG's share, then all WGs meet
            mb_wait(full_v[vs], vp);
            check(get(vcell[vs][wg]), Tag{kV, tile, n}, "V before zeroing");
            put(vcell[vs][wg], Tag{kV, tile, n + kZeroed});
            bar_sync(kBarVarlenV, 128 * c.wg, 128);
          }
          for (--n; n >= 0; --n) {
            mb_wait(full_k[ks], kp);
            sched_sync();
            // issue QK(n) and PV(n+1); their reads are checked at the waits
            mb_wait(full_v[vs], vp);
            sched_arrive();
            m_cons(n);
            check(get(qcell[wg]), Tag{kQ, tile, wg}, "Q");
            check(get(kcell[ks]), Tag{kK, tile, n}, "K");
            k_rel();
            for (int w2 = 0; w2 < c.wg; ++w2) check(get(vcell[vs][w2]), v_tag(n + 1), "V");
            v_rel();
          }
          v_cons(0); v_rel();
        } else {
          sched_sync();
          for (int n = nblk - 1; n >= 0; --n) {
            mb_wait(full_k[ks], kp);
            sched_arrive();
            m_cons(n);
            check(get(qcell[wg]), Tag{kQ, tile, wg}, "Q");
            check(get(kcell[ks]), Tag{kK, tile, n}, "K");
            k_rel();
            mb_wait(full_v[vs], vp);
            sched_sync();
            for (int w2 = 0; w2 < c.wg; ++w2) check(get(vcell[vs][w2]), Tag{kV, tile, n}, "V");
            v_rel();
          }
          sched_arrive();
        }
      }
      if (!c.alias_q) mb_arrive(empty_q);
      int next = tile + grid;
      if (c.varlen) {
        next = read(it + 1);
      } else if (c.dynamic) {
        mb_wait(tile_full, it & 1u);
        { std::lock_guard<std::mutex> l(mu); next = slot; }
        mb_arrive(tile_empty);
      }
      // epilogue
      (*seen)[tile]++;
      Tag o{kO, tile, wg};
      if (c.oinv) {
        bar_sync(kBarOWrite, 128 * c.wg, 128);
        for (int s = 0; s < 2; ++s) put(vcell[s][wg], o);
        store_cells[0] = &vcell[0][wg]; store_cells[1] = &vcell[1][wg]; store_ncells = 2;
      } else if (c.alias_q) {
        put(qcell[wg], o);
        store_cells[0] = &qcell[wg]; store_ncells = 1;
      } else {
        wait_store_read();
        put(ocell[wg], o);
        store_cells[0] = &ocell[wg]; store_ncells = 1;
      }
      store_pending = true; store_tag = o;
      jitter();
      if (c.varlen && ((*short_wg)[tile] >> wg & 1)) {
        // Guarded row stores: the WG reads the staged tile now, meets on its
        // epilogue barrier, then releases the aliased buffer.
        wait_store_read();
        bar_sync(kBarEpi + wg, 128, 128);
        if (c.alias_q) mb_arrive(empty_q);
        if (c.oinv) mb_arrive(o_free);
        tile = next;
        continue;
      }
      if (c.alias_q) { wait_store_read(); mb_arrive(empty_q); }
      if (c.oinv) { wait_store_read(); mb_arrive(o_free); }
      tile = next;
    }
    wait_store_read();
  }
};

int main(int argc, char** argv) {
  const int trials = argc > 1 ? atoi(argv[1]) : 300;
  std::mt19937 rng(12345);
  const Cfg cfgs[] = {
      {2, true, true, false, false, false},  // hdim 128 default
      {3, true, true, false, false, false},  // hdim 64 default
      {2, false, true, false, false, true},  // hdim 256 default (O in Q)
      {2, true, true, true, false, false},   // v5 hdim 128
      {3, true, true, true, false, false},   // v5 hdim 64
      {2, false, true, true, false, true},   // v5 hdim 256
      {2, false, true, false, true, false},  // v6
      {2, false, true, true, true, false},   // v7
      {2, true, true, false, true, false},   // v8 / v9
      {2, true, false, true, true, false},   // serial pingpong, dynamic, O in V (stress)
      {2, false, false, false, false, false},
      // varlen (dynamic hand-off of its own, overlap only): hdim 128, 64, 256, 256 causal (O in V)
      {2, true, true, true, false, false, true},
      {3, true, true, true, false, false, true},
      {2, false, true, true, false, true, true},
      {2, false, true, true, true, false, true},
      // dropout with the producer mask
      {2, true, true, false, false, false, false, true},   // hdim 128
      {2, true, true, true, false, false, false, true},    // hdim 128 causal (dynamic)
      {3, true, true, false, false, false, false, true},   // hdim 64
      {3, true, true, true, false, false, false, true},    // hdim 64 causal
      {2, false, true, false, false, true, false, true},   // hdim 256, the pair (O in Q)
      {2, false, true, true, true, false, false, true},    // hdim 256, the pair causal (O in V)
      {2, true, false, true, false, false, false, true},   // serial pingpong (stress)
  };
  int bad = 0;
  for (int ci = 0; ci < int(sizeof(cfgs) / sizeof(cfgs[0])); ++ci) {
    const Cfg c = cfgs[ci];
    int cfg_bad = 0;
    for (int t = 0; t < trials && !cfg_bad; ++t) {
      const int total = 1 + rng() % 12, grid = 1 + rng() % 3;
      std::vector<int> nb(total), vtail(total), short_wg(total);
      for (auto& x : nb) x = rng() % 4 == 0 ? 0 : 1 + rng() % 4;
      for (int i = 0; i < total; ++i) {
        vtail[i] = c.varlen && nb[i] > 0 && rng() % 2;
        short_wg[i] = c.varlen ? int(rng() % (1u << c.wg)) : 0;
      }
      std::atomic<int> counter{0};
      std::vector<std::atomic<int>> seen(total);
      for (auto& s : seen) s = 0;
      failed = false;
      fail_msg.clear();
      std::vector<CTA*> ctas;
      std::vector<std::thread> th;
      const int g = std::min(grid, total);
      for (int b = 0; b < g; ++b) {
        CTA* x = new CTA();
        x->c = c; x->bid = b; x->grid = g; x->total = total; x->nb = &nb; x->counter = &counter; x->seen = &seen;
        x->vtail = &vtail; x->short_wg = &short_wg;
        x->full_q = {1, 1, 0};
        x->empty_q = {c.wg, c.wg, 0};
        for (int s = 0; s < 2; ++s) {
          x->full_k[s] = {1, 1, 0}; x->full_v[s] = {1, 1, 0};
          x->empty_k[s] = {c.wg, c.wg, 0}; x->empty_v[s] = {c.wg, c.wg, 0};
        }
        x->o_free = {c.wg, c.wg, 0};
        x->tile_full = {1, 1, 0};
        const int hand_off = c.wg + (c.drop ? kMaskers : 0);
        x->tile_empty = {hand_off, hand_off, 0};
        for (int s = 0; s < 2; ++s) {
          x->full_mask[s] = {kMaskers, kMaskers, 0};
          x->empty_mask[s] = {c.wg, c.wg, 0};
        }
        ctas.push_back(x);
        th.emplace_back([x] { x->producer(); });
        for (int w = 0; w < c.wg; ++w) th.emplace_back([x, w] { x->consumer(w); });
        if (c.drop)
          for (int j = 0; j < kMaskers; ++j) th.emplace_back([x, j] { x->masker(j); });
      }
      for (auto& x : th) x.join();
      std::string msg = fail_msg;
      if (!failed)
        for (int i = 0; i < total; ++i)
          if (seen[i] != c.wg) { msg = "tile " + std::to_string(i) + " processed " + std::to_string(seen[i].load()) + "x"; break; }
      if (!failed && c.dynamic && counter.load() != total) msg = "claims " + std::to_string(counter.load()) + " != total";
      if (!msg.empty()) {
        std::printf("cfg %d (wg %d pp %d ov %d dyn %d oinv %d aliasQ %d drop %d) trial %d total %d grid %d: %s\n", ci,
                    c.wg, c.pingpong, c.overlap, c.dynamic, c.oinv, c.alias_q, c.drop, t, total, g, msg.c_str());
        cfg_bad = 1;
      }
      for (auto* x : ctas) delete x;
    }
    std::printf("cfg %d (wg %d pp %d ov %d dyn %d oinv %d aliasQ %d drop %d): %s\n", ci, c.wg, c.pingpong,
                c.overlap, c.dynamic, c.oinv, c.alias_q, c.drop, cfg_bad ? "FAIL" : "ok");
    bad += cfg_bad;
  }
  return bad != 0;
}
