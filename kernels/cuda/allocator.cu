/*
 * allocator.cu: the caching device allocator of loom (device_malloc / device_free, kernels.h)
 * and its pools: the ordinary one, the graph pool of a captured step, the side scope's and a
 * side branch's. The streams these pools follow are in runtime.cu.
 *
 * Caching allocator
 *   Small requests (< 1 MiB: statistics, scalars, activations of small models) are rounded up
 *   to a size class (multiples of 512 B up to 8 KiB, then eighths of each power of two: at
 *   most 1/8 of slack) and kept in one free list per class.
 *   Large requests (>= 1 MiB) are rounded up to 512 B and carved out of segments, as PyTorch's
 *   caching allocator does: a segment is one cudaMalloc (20 MiB for requests under 10 MiB, so
 *   that several share it; else the request rounded up to 2 MiB), split into blocks kept in
 *   address order. A request takes the smallest free block that holds it (best fit over every
 *   segment) and splits off the rest when at least 1 MiB is left; a freed block merges with
 *   free neighbours of its segment. So a batch whose shapes change from step
 *   to step (a packed VLM batch: sequence, image and token counts) reuses the same bytes in new
 *   cuts instead of adding a block per new size to the cache.
 *   device_free() never calls cudaFree: a steady-state training step does no cudaMalloc and
 *   no cudaFree (both synchronize the device). Reuse is stream-ordered: every loom kernel runs
 *   on default_stream(), so a block freed after a launch and handed out again is only touched
 *   by later work in the same stream. When cudaMalloc runs out of memory, the cached small
 *   blocks and the wholly free segments are released (after a device synchronize) and the
 *   request is tried once more.
 *   Statistics: bytes_in_use() counts the sizes of live blocks (as rounded and cut: a block
 *   handed out whole with under 1 MiB to spare counts whole); bytes_reserved() adds the cached
 *   free bytes, i.e. everything taken from the driver; peaks since reset_peak_bytes().
 *
 * Graph pool: while a training step is captured into a CUDA graph (graph_pool_begin/end), the
 *   allocations come from a second set of free lists and segments, and every block handed out
 *   then stays the graph pool's for good (freed later, it returns there; a graph segment is
 *   only ever cut for the pool): a graph writes its addresses at every replay, so they must
 *   never be given to other code. release_cached() (synchronizes) gives the unused small
 *   blocks and free segments of the ordinary pool back to the driver before a capture, so the
 *   eager warm-up steps' cache and the graph's pool are not both reserved.
 *
 * Side scope (side_scope_begin/end, per host thread): default_stream() returns side_stream(), a
 *   second stream, so every op the thread enqueues meanwhile runs there (a frozen vision
 *   tower's forward for the next batch while the step computes), and the allocator serves the
 *   thread from a third pool whose blocks stay the side pool's for good. Why a pool of its own:
 *   the ordinary pool's reuse is ordered by the default stream only, so a block freed by side
 *   work and handed to the default stream could be written while the side stream still reads
 *   it. In the side pool, a block freed on the host is reused by later side work only, and the
 *   caller makes the side stream wait (an event) for the default stream's work enqueued before
 *   the scope, so a side block the default stream read (the features it consumed) is free on
 *   the GPU too. The cuBLASLt workspace is one per stream; cuDNN's attention plans keep state of
 *   their own, so attention in a side scope runs our kernels (attention.cu). Inside a captured
 *   step the side scope takes a pool of its own again (graph side: the graph's addresses).
 *
 * Side branch (side_branch_fork / side_branch_end / side_branch_join): a side scope that the
 *   main stream joins before it reads the result, within one step (the MIM target's forward
 *   beside the encoder's and predictor's, nn/mim.cpp). Its pool (branch, or graph branch while
 *   capturing) shares the main pool's memory both ways: where the branch finds no free block of
 *   its own it takes a whole free segment of the main pool (freed on the host before the fork,
 *   so its last main-stream use is ordered before the side stream's wait for the fork event),
 *   and at the join, once the main stream waits for the branch's end, the branch's whole free
 *   segments and small blocks go back to the main pool. What the two streams hold at once (the
 *   target's working set beside the encoder's) still adds to the reserved bytes: +0.98 GB on
 *   the contrastive MIM step (bench/RESULTS.md 2026-12-05, "target beside the encoder").
 *
 * Test: tests/cuda/test_cuda_runtime.cpp; on a CUDA machine:
 *   bash tools/gpu-kernels.sh tests/cuda/test_cuda_runtime.cpp
 */
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "kernels/cuda/common.cuh"

namespace loom::cuda {

namespace {

constexpr size_t kSmallLimit = size_t(1) << 20;     // 1 MiB: below, size-class lists
constexpr size_t kRound = 512;                       // every block is a multiple of 512 B
constexpr size_t kSegmentRound = size_t(2) << 20;    // segments: multiples of 2 MiB
constexpr size_t kSharedSegment = size_t(20) << 20;  // the segment of requests under 10 MiB
constexpr size_t kMinSplit = size_t(1) << 20;        // split off a remainder of at least 1 MiB

size_t round_up(size_t n, size_t r) { return (n + r - 1) / r * r; }
size_t round_size(size_t bytes) { return round_up(bytes == 0 ? 1 : bytes, kRound); }
// The size class of a small request: multiples of 512 B up to 8 KiB, then eighths of the power
// of two below the size (8-9 KiB -> 9 KiB, 500 KiB -> 512 KiB; at most 1/8 more), so that
// requests whose sizes change a little from step to step (the packed VLM batch's per-image and
// per-sequence buffers) share a few classes instead of each new size costing a cudaMalloc and a
// cached block of its own. LOOM_ALLOC_EXACT=1: 512-byte classes throughout (measurement).
size_t small_class(size_t sz) {
  static const bool exact = [] {
    const char* e = std::getenv("LOOM_ALLOC_EXACT");
    return e && e[0] == '1';
  }();
  if (exact || sz <= 8192) return sz;
  size_t p = 8192;
  while (p * 2 <= sz) p *= 2;
  return round_up(sz, p / 8);
}

// A large block: a piece of one segment, linked to its neighbours in address order.
struct Block {
  char* ptr = nullptr;
  size_t size = 0;
  bool free = false;
  uint8_t pool = 0;  // the pool of its segment (Pool below)
  Block* prev = nullptr;  // nullptr: the first block of its segment (ptr is the cudaMalloc'd one)
  Block* next = nullptr;
};
struct BySize {  // best fit: smallest size first, then lowest address
  bool operator()(const Block* a, const Block* b) const {
    return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
  }
};

// The pools: blocks handed out from one are returned to it and never served from another.
// Ordinary: the default stream's. Graph: while graph_pool_begin() is on (a captured step's
// addresses). Side: the side scope's (side_scope_begin(): work on side_stream()).
// Graph side: the side scope's while a step is captured (the graph's addresses, as kGraph's).
// Branch, graph branch: a side branch's (side_branch_fork .. side_branch_join, e.g. nn/mim.cpp's
// target forward), kept apart from other side work, whose blocks may still be in flight at the
// branch's join.
enum Pool : uint8_t { kOrdinary, kGraph, kSide, kGraphSide, kBranch, kGraphBranch, kPools };
thread_local bool t_side = false;    // this thread is in a side scope
thread_local bool t_branch = false;  // ... opened by side_branch_fork (it borrows the main pool's free memory)

struct Allocator {
  std::mutex mu;
  std::map<size_t, std::vector<void*>> free_lists[kPools];  // small: size class -> cached blocks
  struct Small { size_t size; uint8_t pool; };              // a small block's size class and pool
  std::unordered_map<void*, Small> live;                    // small: block -> {size class, pool}
  std::set<Block*, BySize> free_blocks[kPools];             // large: the free blocks of each pool
  std::unordered_map<void*, Block*> live_large;             // large: pointer -> its block
  bool pool_mode = false;  // graph_pool_begin() .. graph_pool_end()
  size_t in_use = 0, peak = 0, cached = 0, peak_reserved = 0;

  uint8_t current_pool() const {
    if (t_branch) return pool_mode ? kGraphBranch : kBranch;
    if (t_side) return pool_mode ? kGraphSide : kSide;
    return pool_mode ? kGraph : kOrdinary;
  }
  uint8_t main_pool() const { return pool_mode ? kGraph : kOrdinary; }

  // A side branch (side_branch_fork) borrows the main pool's free memory: a whole free segment
  // (the best fitting) of the main pool becomes the branch's. Safe because the side stream waits
  // for the fork event, recorded after every main-stream use of memory freed so far. (Whole
  // segments: a segment stays one pool's, so free blocks merge as before; borrowing any free
  // block measured ~0.2 GB more reserved on the contrastive MIM step, the cuts of both pools
  // then sharing segments without merging.)
  Block* borrow_segment(size_t sz) {  // caller holds mu
    auto& from = free_blocks[main_pool()];
    Block key;
    key.size = sz;
    for (auto it = from.lower_bound(&key); it != from.end(); ++it) {
      Block* b = *it;
      if (b->prev || b->next) continue;  // part of a segment in use
      from.erase(it);
      b->pool = current_pool();
      return b;
    }
    return nullptr;
  }

  // side_branch_join: the main stream has waited for the branch, so what the branch freed is
  // free for main-stream work too: its whole free segments and its small blocks go to the main
  // pool (a free block in a segment still in use stays the branch's until a later join).
  void return_branch_memory(uint8_t side, uint8_t to) {  // caller holds mu
    auto& sb = free_blocks[side];
    for (auto it = sb.begin(); it != sb.end();) {
      Block* b = *it;
      if (b->prev || b->next) {
        ++it;
        continue;
      }
      it = sb.erase(it);
      b->pool = to;
      free_blocks[to].insert(b);
    }
    for (auto& kv : free_lists[side]) {
      auto& dst = free_lists[to][kv.first];
      dst.insert(dst.end(), kv.second.begin(), kv.second.end());
      kv.second.clear();
    }
  }

  // a takes over the block after it in its segment (out of every free set already)
  static void absorb_next(Block* a) {
    Block* n = a->next;
    a->size += n->size;
    a->next = n->next;
    if (n->next) n->next->prev = a;
    delete n;
  }

  void note_peaks() {
    if (in_use > peak) peak = in_use;
    if (in_use + cached > peak_reserved) peak_reserved = in_use + cached;
  }

  void release_cache() {  // caller holds mu
    CUDA_CHECK(cudaDeviceSynchronize());
    // the ordinary pool's only: a graph may still use its blocks, the side stream its own
    for (auto& kv : free_lists[kOrdinary])
      for (void* p : kv.second) {
        CUDA_CHECK(cudaFree(p));
        cached -= kv.first;
      }
    free_lists[kOrdinary].clear();
    auto& free_blocks = this->free_blocks[kOrdinary];
    for (auto it = free_blocks.begin(); it != free_blocks.end();) {
      Block* b = *it;
      if (b->prev || b->next) {  // part of a segment still in use
        ++it;
        continue;
      }
      CUDA_CHECK(cudaFree(b->ptr));
      cached -= b->size;
      it = free_blocks.erase(it);
      delete b;
    }
  }

  void* cuda_malloc_or_throw(size_t sz, size_t asked) {  // caller holds mu
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, sz);
    if (e == cudaErrorMemoryAllocation && cached > 0) {
      cudaGetLastError();
      release_cache();
      e = cudaMalloc(&p, sz);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      char buf[256];
      std::snprintf(buf, sizeof buf, "device_malloc(%zu bytes) failed: %s (in use %zu bytes, peak %zu, cached %zu)",
                    asked, cudaGetErrorString(e), in_use, peak, cached);
      throw std::runtime_error(buf);
    }
    return p;
  }

  void* alloc_small(size_t sz, size_t asked) {  // caller holds mu
    const uint8_t pool = current_pool();
    void* p = nullptr;
    auto take = [&](uint8_t from) {
      auto it = free_lists[from].find(sz);
      if (it == free_lists[from].end() || it->second.empty()) return false;
      p = it->second.back();
      it->second.pop_back();
      cached -= sz;
      return true;
    };
    if (take(pool) || (t_branch && take(main_pool()))) {
    } else {
      p = cuda_malloc_or_throw(sz, asked);
    }
    live[p] = Small{sz, pool};
    in_use += sz;
    note_peaks();
    return p;
  }

  void* alloc_large(size_t sz, size_t asked) {  // caller holds mu
    const uint8_t which = current_pool();
    auto& pool = free_blocks[which];
    Block key;
    key.size = sz;
    auto it = pool.lower_bound(&key);  // the smallest free block of at least sz (ptr nullptr sorts first)
    Block* b = nullptr;
    if (it != pool.end()) {
      b = *it;
      pool.erase(it);
      cached -= b->size;
    } else if (t_branch && (b = borrow_segment(sz))) {
      cached -= b->size;
    } else {
      size_t seg = sz < kSharedSegment / 2 ? kSharedSegment : round_up(sz, kSegmentRound);
      void* p = nullptr;
      try {
        p = cuda_malloc_or_throw(seg, asked);
      } catch (const std::runtime_error&) {
        if (seg == round_up(sz, kSegmentRound)) throw;
        seg = round_up(sz, kSegmentRound);  // no room for a shared segment: just this request
        p = cuda_malloc_or_throw(seg, asked);
      }
      b = new Block;
      b->ptr = static_cast<char*>(p);
      b->size = seg;
      b->pool = which;
    }
    if (b->size - sz >= kMinSplit) {  // cut: the rest stays free in the same segment
      Block* rest = new Block;
      rest->ptr = b->ptr + sz;
      rest->size = b->size - sz;
      rest->free = true;
      rest->pool = b->pool;
      rest->prev = b;
      rest->next = b->next;
      if (b->next) b->next->prev = rest;
      b->next = rest;
      b->size = sz;
      pool.insert(rest);
      cached += rest->size;
    }
    b->free = false;
    live_large[b->ptr] = b;
    in_use += b->size;
    note_peaks();
    return b->ptr;
  }

  void* alloc(size_t bytes) {
    size_t sz = round_size(bytes);
    std::lock_guard<std::mutex> lock(mu);
    return sz < kSmallLimit ? alloc_small(small_class(sz), bytes) : alloc_large(sz, bytes);
  }

  void free(void* p) {
    if (!p) return;
    std::lock_guard<std::mutex> lock(mu);
    auto lit = live_large.find(p);
    if (lit != live_large.end()) {
      Block* b = lit->second;
      live_large.erase(lit);
      in_use -= b->size;
      cached += b->size;
      auto& pool = free_blocks[b->pool];
      b->free = true;
      if (b->next && b->next->free) {  // absorb the free block after it
        pool.erase(b->next);
        absorb_next(b);
      }
      if (b->prev && b->prev->free) {  // and be absorbed by the free block before it
        b = b->prev;
        pool.erase(b);
        absorb_next(b);
      }
      pool.insert(b);
      return;
    }
    auto it = live.find(p);
    if (it == live.end()) throw std::runtime_error("device_free: pointer was not allocated by device_malloc");
    const Small sm = it->second;
    live.erase(it);
    in_use -= sm.size;
    free_lists[sm.pool][sm.size].push_back(p);
    cached += sm.size;
  }
};

Allocator& allocator() {
  // Leaked on purpose: freeing device memory during static destruction races the driver's
  // own teardown.
  static Allocator* a = new Allocator();
  return *a;
}

}  // namespace

void* device_malloc(size_t bytes) { return allocator().alloc(bytes); }
void device_free(void* p) { allocator().free(p); }

size_t bytes_in_use() {
  std::lock_guard<std::mutex> lock(allocator().mu);
  return allocator().in_use;
}
size_t peak_bytes_in_use() {
  std::lock_guard<std::mutex> lock(allocator().mu);
  return allocator().peak;
}
void reset_peak_bytes() {
  std::lock_guard<std::mutex> lock(allocator().mu);
  allocator().peak = allocator().in_use;
  allocator().peak_reserved = allocator().in_use + allocator().cached;
}
size_t bytes_reserved() {
  std::lock_guard<std::mutex> lock(allocator().mu);
  return allocator().in_use + allocator().cached;
}
size_t peak_bytes_reserved() {
  std::lock_guard<std::mutex> lock(allocator().mu);
  return allocator().peak_reserved;
}

void graph_pool_begin() {
  std::lock_guard<std::mutex> lock(allocator().mu);
  allocator().pool_mode = true;
}
void graph_pool_end() {
  std::lock_guard<std::mutex> lock(allocator().mu);
  allocator().pool_mode = false;
}
void release_cached() {
  std::lock_guard<std::mutex> lock(allocator().mu);
  allocator().release_cache();
}

void side_scope_begin() {
  if (t_side) throw std::logic_error("side_scope_begin: already in a side scope");
  t_side = true;
}
void side_scope_end() {
  if (!t_side || t_branch) throw std::logic_error("side_scope_end: not in a side scope (a branch ends by side_branch_end)");
  t_side = false;
}
bool side_scope_active() { return t_side; }

void side_branch_fork(void* fork) {
  if (t_side) throw std::logic_error("side_branch_fork: already in a side scope");
  event_record(fork, main_stream());
  stream_wait_event(side_stream(), fork);
  t_side = t_branch = true;
}
void side_branch_end(void* join) {
  if (!t_branch) throw std::logic_error("side_branch_end: not in a side branch");
  event_record(join, side_stream());
  t_side = t_branch = false;
}
void side_branch_join(void* join) {
  if (t_side) throw std::logic_error("side_branch_join: inside a side scope");
  stream_wait_event(main_stream(), join);
  std::lock_guard<std::mutex> lock(allocator().mu);
  Allocator& a = allocator();
  a.return_branch_memory(a.pool_mode ? kGraphBranch : kBranch, a.main_pool());
}

}  // namespace loom::cuda
