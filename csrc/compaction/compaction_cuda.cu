// CUDA backends of kvops::compaction_compact_layers_ (every layer, plane and head of a batch in one launch) and
// kvops::compaction_fill_lists_ (one warp per list row; at the end of this file).
//
// One warp owns one stream (request, layer, plane, head) and walks its move list in chunks of
// whole token rows. Within a chunk all lanes load before any lane stores (__syncwarp), and
// chunks go in ascending order. Because destination_bases[r] + m <= source[m] and sources
// ascend, a store can only land on the source of an earlier token of the same stream, which has
// been read already, so the move is safe in place without a temporary. Rows move as 16-byte
// vectors; the page-table lookups for the next chunk are issued before this chunk's stores.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../cuda_utils.cuh"
#include "compaction.h"

namespace kvops {
namespace compaction {

namespace {

constexpr int kWarps = 8;             // streams per CTA
constexpr int kVecsPerLane = 8;       // 16-byte vectors a lane holds per chunk: a 4 KiB chunk per warp
// Three CTAs per SM (80 registers) moved 90% of copy bandwidth on the H200; two (96 registers) gave
// 64% and four (64 registers, spilling) 78%: the loads in flight per SM are what matter.
constexpr int kMinBlocks = 3;
constexpr int kLayersPerLaunch = 512;  // layer slots in the kernel parameters (8 KiB of the 32 KiB limit)

struct LayerSlot {
  char* base;
  int32_t row_base, head_stride;  // this layer's list row for head h: row_base + head_stride * h
};

struct CompactParams {
  MovePlan plan;
  int32_t layers;
  int32_t chunk_tokens;  // token rows per chunk: min(32, 32 * kVecsPerLane / row_vecs)
  FastDiv row_vecs;      // 16-byte vectors per token row
  LayerSlot layer[kLayersPerLaunch];
};

// Byte offsets of the lane's token in this chunk, both -1 when it is past the list, out of range,
// or already in place.
__device__ __forceinline__ void resolve(const MovePlan& plan, const int32_t* list, const int32_t* pt_row, int32_t base,
                                        int32_t n, int32_t m, int64_t& src, int64_t& dst) {  // m: a list index, n for none
  src = dst = -1;
  if (m < n) {
    src = plan.token_offset(pt_row, __ldg(list + m));
    dst = plan.token_offset(pt_row, base + m);
    if (src < 0 || dst < 0 || src == dst) src = dst = -1;
  }
}

__global__ void __launch_bounds__(kWarps * 32, kMinBlocks) compact_layers_kernel(const __grid_constant__ CompactParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t stream = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const MovePlan& plan = p.plan;
  const int H = plan.pool.heads;
  if (stream >= int64_t(plan.requests) * p.layers * 2 * H) return;
  // layer-major: the grid's first CTAs walk the launch's first layer slots (the longest walks: see the host)
  const int h = int(stream % H), plane = int(stream / H % 2);
  const int r = int(stream / (2 * H) % plan.requests), l = int(stream / (2 * H * plan.requests));
  const LayerSlot& layer = p.layer[l];
  const int64_t row = (int64_t(r) * plan.list_rows + layer.row_base + layer.head_stride * h) * plan.list_capacity;
  const int32_t *list = plan.sources + row, *walk = plan.moves + (plan.moves ? row : 0);
  const int32_t* pt_row = plan.page_table + r * plan.page_table_stride;
  char* head = layer.base + plane * plan.pool.stride_plane + h * plan.pool.stride_head;
  const int32_t base = __ldg(plan.destination_bases + r), n = plan.list_length(r);
  const int C = p.chunk_tokens, V = int(p.row_vecs.d);

  int64_t src, dst;
  int32_t m = plan.walk_index(walk, lane < C ? lane : n, n);
  resolve(plan, list, pt_row, base, n, m, src, dst);
  // A walk of moves ends early: at the first chunk none of whose lanes has a list index left.
  for (int32_t start = 0; start < n && __any_sync(0xffffffffu, m < n); start += C) {
    uint4 v[kVecsPerLane];
#pragma unroll
    for (int k = 0; k < kVecsPerLane; ++k) {  // vector k of a lane: token row t of the chunk, 16-byte column i - t * V
      const int i = lane + 32 * k, t = int(p.row_vecs.div(uint32_t(i)));
      const int64_t s = __shfl_sync(0xffffffffu, src, t < 32 ? t : 0);
      if (i < C * V && s >= 0) v[k] = __ldcs(reinterpret_cast<const uint4*>(head + s + (i - t * V) * 16));
    }
    int64_t next_src, next_dst;  // the next chunk's lookups overlap this chunk's loads
    m = plan.walk_index(walk, lane < C ? start + C + lane : n, n);
    resolve(plan, list, pt_row, base, n, m, next_src, next_dst);
    __syncwarp();  // every source of this chunk is read before any lane stores
#pragma unroll
    for (int k = 0; k < kVecsPerLane; ++k) {
      const int i = lane + 32 * k, t = int(p.row_vecs.div(uint32_t(i)));
      const int64_t d = __shfl_sync(0xffffffffu, dst, t < 32 ? t : 0);
      if (i < C * V && d >= 0) __stcs(reinterpret_cast<uint4*>(head + d + (i - t * V) * 16), v[k]);
    }
    src = next_src;
    dst = next_dst;
  }
}

void compact_layers_cuda(at::TensorList pools, const at::Tensor& page_table, const at::Tensor& sources,
                         const at::Tensor& new_lengths, const at::Tensor& destination_bases,
                         at::IntArrayRef layer_row_base, at::IntArrayRef head_row_stride,
                         const std::optional<at::Tensor>& moves) {
  const MovePlan plan = check_compact_args(pools, page_table, sources, new_lengths, destination_bases, layer_row_base,
                                           head_row_stride, moves);
  const c10::cuda::CUDAGuard guard(pools[0].device());
  prepare_kernel(compact_layers_kernel, "compaction_compact_layers_");
  CompactParams p{};
  p.plan = plan;
  const int row_vecs = plan.pool.row_bytes / 16;
  p.row_vecs = FastDiv(uint32_t(row_vecs));
  p.chunk_tokens = std::min(32, 32 * kVecsPerLane / row_vecs);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t L = int64_t(pools.size());
  // Layers whose heads share the last list row first: a window row (the layers that keep their newest tokens)
  // moves every kept token each round, tens of times a decision row's moves, and a walk is one warp's chain of
  // chunks. Started first, those walks overlap the short ones instead of trailing them (a stable order, so
  // nothing changes where no layer has such a row).
  std::vector<int64_t> order(L);
  for (int64_t i = 0; i < L; ++i) order[i] = i;
  const auto window = [&](int64_t l) {
    return plan.list_rows > 1 && head_row_stride[l] == 0 && layer_row_base[l] == plan.list_rows - 1;
  };
  std::stable_partition(order.begin(), order.end(), window);
  for (int64_t first = 0; first < L; first += kLayersPerLaunch) {  // layers are independent
    p.layers = int32_t(std::min<int64_t>(kLayersPerLaunch, L - first));
    for (int i = 0; i < p.layers; ++i) {
      const int64_t l = order[first + i];
      p.layer[i] = LayerSlot{static_cast<char*>(pools[l].data_ptr()), int32_t(layer_row_base[l]),
                             int32_t(head_row_stride[l])};
    }
    const int64_t streams = int64_t(plan.requests) * p.layers * 2 * plan.pool.heads;
    if (streams == 0) continue;
    compact_layers_kernel<<<unsigned((streams + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

constexpr int kFillWarps = 8;  // warps per CTA
constexpr int kFillStage = 2048;  // the widest decision row a warp stages in shared memory (8 KB; 64 KB a CTA)

// The first i in [0, hi) with U(i) >= value (hi when none), U ascending: 32 probes a step, one per lane, so
// rows of up to 32k entries take at most three dependent loads. Warp-uniform; any U gives a result in [0, hi].
__device__ int32_t lower_bound(const FillRow& f, int32_t hi, int64_t value, int lane) {
  int32_t lo = 0;
  while (lo < hi) {
    const int32_t step = (hi - lo + 31) / 32, i = lo + lane * step;
    const int c = __popc(__ballot_sync(~0u, i < hi && f.U(i) < value));  // the probes below value: a prefix
    if (c == 0) break;
    hi = min(hi, lo + c * step);
    lo += (c - 1) * step + 1;
  }
  return lo;
}

// One warp writes one segment of one list row, 32 positions a step. Two searches place the segment: s = #U below
// the new length, and the stays below its first position (the free slots below it follow). The positions then
// merge with U[0..s): the stays that land in this step's 32 slots are the next U entries below its end, one
// OR-reduction makes them a slot mask, and the free slots take ranks by ballot, so sources and moves are written
// in order and coalesced. A row splits into segments only when there are too few rows to fill the GPU (one
// request's union row: 68 steps in one warp would be the whole latency). Unsplit rows of at most kFillStage kept
// entries are first staged in shared memory (`stage`: entries a warp stages, 0 for none): each step's reads of U
// depend on the previous step's ballots, and from global memory that chain of loads was the kernel's time.
__global__ void __launch_bounds__(kFillWarps * 32)
    fill_lists_kernel(const FillPlan p, int32_t segment, int32_t segments, int32_t stage) {
  extern __shared__ int32_t staged[];
  const int lane = threadIdx.x % 32;
  const int64_t warp = int64_t(blockIdx.x) * kFillWarps + threadIdx.x / 32, item = warp / segments;
  if (item >= int64_t(p.requests) * p.list_rows) return;
  const int32_t r = int32_t(item / p.list_rows), row = int32_t(item % p.list_rows), C = p.capacity;
  const int32_t begin = int32_t(warp % segments) * segment, stop = min(C, begin + segment);
  FillRow f = p.row(r, row);
  int32_t *src = p.sources + item * C, *mv = p.moves + item * C;
  if (row == 0 && begin == 0 && lane == 0) p.new_lengths[r] = f.new_length();
  if (f.refused || row >= p.rows) {
    for (int32_t m = begin + lane; m < stop; m += 32) {
      src[m] = f.refused ? -1 : f.window_source(m);
      mv[m] = f.refused ? -1 : f.window_move(m);
    }
    return;
  }
  if (stage > 0) {
    int32_t* mine = staged + threadIdx.x / 32 * stage;
#pragma unroll 8
    for (int32_t i = lane; i < f.K; i += 32) mine[i] = __ldg(f.kept + i);
    __syncwarp();
    f.kept = mine;
  }
  const uint32_t below = (1u << lane) - 1;
  const int32_t s = lower_bound(f, f.n, int64_t(f.base) + f.n, lane);
  int32_t a = begin < f.n ? lower_bound(f, s, int64_t(f.base) + begin, lane) : s;  // stays below the segment
  int32_t j = min(begin, f.n) - a;  // free slots below it (a malformed decision can make this negative)
  for (int32_t p0 = begin; p0 < stop; p0 += 32) {
    const int32_t m = p0 + lane;
    uint32_t slots = 0;  // bit t: slot p0 + t holds a stay
    if (p0 < f.n) {
      const int32_t i = a + lane;
      const int64_t t = i < s ? int64_t(f.U(i)) - f.base - p0 : 32;
      slots = __reduce_or_sync(~0u, t >= 0 && t < 32 ? 1u << t : 0u);
      a += __popc(__ballot_sync(~0u, t < 32));
    }
    const bool stay = m < f.n && (slots >> lane & 1);
    const bool free = m < f.n && !stay;
    const uint32_t frees = __ballot_sync(~0u, free);
    const int32_t rank = j + __popc(frees & below);
    int32_t v = stay ? f.base + m : -1;
    if (free && rank >= 0 && rank < C) {  // always, for a decision that keeps the contract
      mv[rank] = m;
      v = s + rank < f.n ? f.U(s + rank) : -1;
    }
    if (m < stop) src[m] = v;
    j += __popc(frees);
  }
  for (int32_t i = begin + lane; i < stop; i += 32)  // the ranks end at n - s: -1 from there on
    if (i >= f.n - s) mv[i] = -1;
}

void fill_lists_cuda(const at::Tensor& kept, const at::Tensor& scored_lengths, const at::Tensor& tail_lengths,
                     const at::Tensor& destination_bases, at::Tensor sources, at::Tensor new_lengths, at::Tensor moves,
                     const std::optional<at::Tensor>& window_offsets) {
  const FillPlan plan =
      check_fill_args(kept, scored_lengths, tail_lengths, destination_bases, sources, new_lengths, moves, window_offsets);
  const int64_t items = int64_t(plan.requests) * plan.list_rows;
  if (items == 0) return;
  const c10::cuda::CUDAGuard guard(kept.device());
  // Segments of whole 32-position steps, as many per row as it takes to have about 32 warps per SM in flight.
  const int64_t steps = std::max<int64_t>(1, (plan.capacity + 31) / 32);
  const int64_t wanted = int64_t(sm_count()) * 32;
  const int64_t split = std::clamp<int64_t>((wanted + items - 1) / items, 1, steps);
  const int32_t segment = int32_t((steps + split - 1) / split * 32);
  const int32_t segments = int32_t(std::max<int64_t>(1, (plan.capacity + segment - 1) / segment));
  const int32_t stage = segments == 1 && plan.K <= kFillStage ? plan.K : 0;
  const int smem = kFillWarps * stage * int(sizeof(int32_t));
  prepare_kernel(fill_lists_kernel, "compaction_fill_lists_", smem);
  const int64_t warps = items * segments;
  fill_lists_kernel<<<unsigned((warps + kFillWarps - 1) / kFillWarps), kFillWarps * 32, smem,
                      c10::cuda::getCurrentCUDAStream()>>>(plan, segment, segments, stage);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(kvops, CUDA, m) {
  m.impl("compaction_compact_layers_", &compact_layers_cuda);
  m.impl("compaction_fill_lists_", &fill_lists_cuda);
}

}  // namespace compaction
}  // namespace kvops
