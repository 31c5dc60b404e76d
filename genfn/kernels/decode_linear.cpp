// y = x @ w.T for a few rows of x as one op (decode_linear), and for any number of rows each summed as
// it is alone (invariant_linear, the batch-invariant mode's float linear): plain_rows.h's blocks,
// shared out to torch's threads here (the decode stack shares them out in plain_linear.cpp). Built
// into both decode libraries: an LM head gets the same bits from the AVX2 build as from the AVX-512 one.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <atomic>

#include "decode_kernels.h"
#include "plain_rows.h"

namespace {

using genfn_kernels::kMaxDecodeRows;
using genfn_kernels::with_rows;
using namespace genfn_kernels::plain_rows;

// Row blocks [b0, b1) of w against the M rows of x, as one sequential stream: the window ahead of
// the block being summed is fetched (stream_window), and blocks within a window of b1 fetch nothing (past
// it lies another thread's share).
template <typename Dot, int M, typename Out>
void stream_blocks(const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K, int64_t N, Out* y,
                   int64_t b0, int64_t b1) {
  constexpr int R = rows_per_block<typename Dot::Weight>(M);
  const int64_t block_bytes = R * K * static_cast<int64_t>(sizeof(typename Dot::Weight));
  const int64_t length = (b1 - b0) * block_bytes;
  const genfn_kernels::StreamWindow window = stream_window<M>();
  fetch_first_window(w + b0 * R * K, length, window);
  for (int64_t b = b0; b < b1; ++b) {
    const bool ahead = window.bytes > 0 && (b - b0 + 1) * block_bytes + window.bytes <= length;
    row_block<Dot, M, R>(x, w, K, N, b * R,
                         stream_ahead(w, K, b * R, R, ahead ? window : genfn_kernels::StreamWindow{}), y);
  }
}

template <typename Dot, int M, typename Out>
void rows_of_x(const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K, int64_t N, Out* y) {
  constexpr int R = rows_per_block<typename Dot::Weight>(M);
  const int64_t blocks = N / R;
  // Each thread takes a contiguous run of row blocks, one sequential stream through the weight.
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) { stream_blocks<Dot, M>(x, w, K, N, y, b0, b1); });
  for (int64_t n = blocks * R; n < N; ++n) row_block<Dot, M, 1>(x, w, K, N, n, {}, y);
}

template <typename Dot, typename Out>
void dispatch_rows(int64_t M, const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K, int64_t N,
                   Out* y) {
  with_rows(M, [&](auto rows) { rows_of_x<Dot, decltype(rows)::value>(x, w, K, N, y); });
}

constexpr int64_t kPanelBytes = 64 * 1024;

// The register tile of a pass: up to kRows rows of x by block(M) weight rows, an accumulator each.
// Every multiply-add loads a chunk of x or of a weight row, so loads per multiply-add are
// 1/block + 1/rows: 8 x 2 (the decode kernel's blocks) loads 0.63 a multiply-add, 6 x 4 0.42,
// within the 32 vector registers (24 accumulators, 4 weight chunks, x from memory). Float32 at 32
// rows, SmolLM2's shapes, one thread, best of 9 interleaved rounds against the packed GEMM
// (oneDNN), 8 x 2 -> 6 x 4: gate/up 1.47x -> 1.07x, q/k/v 1.34x -> 1.15x, down 1.30x -> 1.22x
// (benchmarks/results/determinism-cost-wave3.log). A tile holds as many rows as fit in
// kTileBytes, so that it stays in L1 while the panel's weight rows pass (SmolLM2's down
// projection, 1536 inputs: 8 float32 rows of x are 48 KiB, and read from L2 the product ran at
// half the speed of oneDNN's). Past kGroupBytes of x (a prefill's hundreds of rows) the rows go
// in groups that stay in L2, each streaming the weight again. AVX2's 16 registers hold 6 x 1 (each
// accumulator two of them): the library built for it takes this kernel up to kMaxDecodeRows rows
// (genfn.kernels._linear_rows), where the panels run only the batch-invariant mode's longer products.
template <typename Dot>
struct TileShape {
  static constexpr int kRows = 6;
#if defined(__AVX512F__)
  static constexpr int block(int) { return 4; }
#else
  static constexpr int block(int) { return 1; }
#endif
  static constexpr int64_t kTileBytes = 24 * 1024;
  static constexpr int64_t kGroupBytes = 256 * 1024;
};
#if defined(__AVX512F__)
// vdpbf16ps does twice an FMA's work per load, so bfloat16 tiles read x from L2 at full speed:
// a tile is not cut to fit L1, where the 1B model's down projection (8192 inputs: 16 KiB a row
// of x) ran one row of x at a time, 1 x 1, at ~40 GFLOP/s a thread (6 x 4 tiles: 125-155), and
// a group holds a decode step's rows at the 1B shapes (33 x 8192 inputs: 528 KiB of x beside two
// panels in a 1 MiB L2). 6 x 4 against 8 x 2 and 4 x 4 at 16 and 32 rows of the 1B shapes, one
// thread: 8 x 2 0.8-0.85x at 2048 inputs, 4 x 4 alike within the noise (0.9-1.1x) and behind at
// 8192 (docs/guides/k-quants-and-scale.md, *bfloat16 decode at 9-33 rows*).
template <>
struct TileShape<Bfloat16Dot> {
  static constexpr int kRows = 6;
  static constexpr int block(int) { return 4; }
  static constexpr int64_t kTileBytes = 640 * 1024;
  static constexpr int64_t kGroupBytes = 640 * 1024;
};
#endif

// Weight rows [n0, n1) against the M rows of x; results to y[m * N + n]. Blocks of R weight rows
// (n0 is a multiple of 4), the odd rows at N one at a time. `next`: the lines this pass fetches
// for a later one, shared out evenly over its blocks.
template <typename Dot, int M, int R, typename Out>
void panel_pass(const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K, int64_t N, Out* y,
                int64_t n0, int64_t n1, Fetch next) {
  const int64_t blocks = (n1 - n0) / R + (n1 - n0) % R;
  const int64_t per_block = (next.lines + blocks - 1) / blocks;
  auto share = [&]() {
    const Fetch part{next.at, std::min(per_block, next.lines)};
    next.at += 64 * part.lines;
    next.lines -= part.lines;
    return part;
  };
  int64_t n = n0;
  for (; n + R <= n1; n += R) row_block<Dot, M, R>(x, w, K, N, n, share(), y);
  for (; n < n1; ++n) row_block<Dot, M, 1>(x, w, K, N, n, share(), y);
}

template <typename Dot, typename Out>
void dispatch_panel(int64_t M, const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K, int64_t N,
                    Out* y, int64_t n0, int64_t n1, Fetch next) {
  using Shape = TileShape<Dot>;
  static_assert(Shape::kRows <= 8, "tiles of up to 8 rows of x");
  TORCH_CHECK(M >= 1 && M <= Shape::kRows, "invariant_linear: a tile of ", M, " rows of x (at most ", Shape::kRows,
              ")");
  with_rows(M, [&](auto rows) {
    if constexpr (decltype(rows)::value <= Shape::kRows)
      panel_pass<Dot, decltype(rows)::value, Shape::block(decltype(rows)::value)>(x, w, K, N, y, n0, n1, next);
  });
}

// Any number of rows of x, each output element summed exactly as one row alone is summed above
// (one float32 accumulator of 16 lanes along k in steps of Dot::Step, then the same lane tree),
// whatever the row count, the row's place or the thread count: the batch-invariant mode's float
// linear (genfn/kernels/invariant.py), and decode_linear's past kMaxDecodeRows. Where the mode
// once ran tiles of 8 rows through the decode kernel one after another, each streaming the whole
// weight from memory, the weight here streams once: the output columns are cut into panels of
// weight rows small enough to stay in L2, each thread takes a contiguous run of panels (columns,
// never k), and every tile of rows of x passes over a panel before the next. The tiles' passes
// over a panel fetch the next panel of the run into L2, each pass a share: the weight's read
// then overlaps all of the panel's arithmetic, where a window ahead of the first pass alone
// (as stream_blocks fetches) left the memory idle while the other tiles summed from L2.
template <typename Dot, typename Out>
void panels_of_rows(int64_t M, const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K, int64_t N,
                    Out* y) {
  if (M <= kMaxDecodeRows) return dispatch_rows<Dot>(M, x, w, K, N, y);
  using Shape = TileShape<Dot>;
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(typename Dot::Weight));
  // A multiple of 4 weight rows, so that every block size the tiles take (1, 2, 4) divides it.
  const int64_t panel = std::max<int64_t>(4, kPanelBytes / std::max<int64_t>(row_bytes, 1) / 4 * 4);
  const int64_t panels = (N + panel - 1) / panel;
  const int64_t x_row_bytes = K * static_cast<int64_t>(sizeof(typename Dot::Input));
  const int64_t tile = std::clamp<int64_t>(Shape::kTileBytes / x_row_bytes, 1, Shape::kRows);
  const int64_t group = std::max<int64_t>(1, Shape::kGroupBytes / x_row_bytes / tile) * tile;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    const int64_t stream_end = std::min(N, p1 * panel);
    for (int64_t g0 = 0; g0 < M; g0 += group) {
      const int64_t rows = std::min(M, g0 + group) - g0;
      // Tiles as even as the rows split (32 rows as 6, 6, 5, 5, 5, 5, not 6 x 5 and 2).
      const int64_t tiles = (rows + tile - 1) / tile;
      fetch_first_window(w + p0 * panel * K, std::min(panel, stream_end - p0 * panel) * row_bytes,
                         {kPanelBytes, false});
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * panel, n1 = std::min(N, n0 + panel);
        const int64_t next_lines = (std::min(stream_end, n1 + panel) - n1) * row_bytes / 64;
        const char* next = reinterpret_cast<const char*>(w + n1 * K);
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t m0 = g0 + rows * t / tiles, m1 = g0 + rows * (t + 1) / tiles;
          const int64_t l0 = next_lines * t / tiles, l1 = next_lines * (t + 1) / tiles;
          dispatch_panel<Dot>(m1 - m0, x + m0 * K, w, K, N, y + m0 * N, n0, n1, Fetch{next + 64 * l0, l1 - l0});
        }
      }
    }
  });
}

// The library built for AVX2 has no vdpbf16ps path, whatever the CPU has.
bool has_avx512_bf16() {
#if defined(__AVX512F__)
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
}

// The bfloat16 path the linears take, set by the op bf16_linear_path (tests and benchmarks of the
// widening path on a CPU with vdpbf16ps): 0 the best this CPU has, 1 widening, 2 vdpbf16ps.
std::atomic<int64_t> forced_bf16_path{0};

int64_t set_bf16_path(int64_t path) {
  TORCH_CHECK(path >= 0 && path <= 2, "bf16_linear_path: path must be 0, 1 or 2, got ", path);
  TORCH_CHECK(path != 2 || has_avx512_bf16(), "bf16_linear_path: this CPU has no AVX512_BF16 (vdpbf16ps)");
  forced_bf16_path.store(path, std::memory_order_relaxed);
  return genfn_kernels::bf16_dot_in_use() ? 2 : 1;
}

at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& weight);

// Up to kMaxDecodeRows rows of x the decode kernel's blocks, past them every tile of rows over one
// L2-sized panel of the weight before the next, so the weight still streams from memory once
// (genfn.kernels.MAX_LINEAR_ROWS says up to where that beats the library's GEMM): invariant_linear,
// which does both, for what it takes.
at::Tensor decode_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "decode_linear: weight must be 2-D, got ", weight.dim(), "-D");
  TORCH_CHECK(x.size(-1) == weight.size(1), "decode_linear: x has ", x.size(-1),
              " features, weight expects ", weight.size(1));
  const int64_t K = weight.size(1);
  const int64_t M = K == 0 ? 0 : x.numel() / K;
  const auto dtype = weight.scalar_type();
  const bool supported = (dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype &&
                         M >= 1 && x.device().is_cpu() && weight.device().is_cpu();
  return supported ? invariant_linear(x, weight) : at::linear(x, weight);
}

// decode_linear for any number of rows, each summed as it is alone (panels_of_rows); float32 or
// bfloat16 only: it refuses what it cannot sum that way rather than hand it to another kernel.
at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "invariant_linear: weight must be 2-D, got ", weight.dim(), "-D");
  TORCH_CHECK(x.size(-1) == weight.size(1), "invariant_linear: x has ", x.size(-1),
              " features, weight expects ", weight.size(1));
  const auto dtype = weight.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype,
              "invariant_linear: float32 or bfloat16 x and weight of one dtype, got ", x.scalar_type(), " and ", dtype);
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "invariant_linear: CPU tensors only");
  const int64_t K = weight.size(1);
  const int64_t N = weight.size(0);
  const int64_t M = K == 0 ? 0 : x.numel() / K;
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  if (M == 0 || K == 0) return at::zeros(out_sizes, weight.options());
  const at::Tensor w = weight.contiguous();
  const at::Tensor rows = x.contiguous();
  at::Tensor y = at::empty({M, N}, weight.options());
  if (dtype == at::kFloat) {
    panels_of_rows<Float32Fma>(M, rows.data_ptr<float>(), w.data_ptr<float>(), K, N, y.data_ptr<float>());
#if defined(__AVX512F__)
  } else if (genfn_kernels::bf16_dot_in_use()) {
    panels_of_rows<Bfloat16Dot>(M, rows.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), K, N,
                                y.data_ptr<c10::BFloat16>());
#endif
  } else {
    panels_of_rows<Bfloat16Widen>(M, widened(rows.data_ptr<c10::BFloat16>(), M * K), w.data_ptr<c10::BFloat16>(), K,
                                  N, y.data_ptr<c10::BFloat16>());
  }
  return y.view(out_sizes);
}

}  // namespace

namespace genfn_kernels {

bool cpu_has_avx512_bf16() { return has_avx512_bf16(); }

bool bf16_dot_in_use() { return has_avx512_bf16() && forced_bf16_path.load(std::memory_order_relaxed) != 1; }

}  // namespace genfn_kernels

TORCH_LIBRARY(genfn_kernels, m) {
  m.def("decode_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("invariant_linear(Tensor x, Tensor weight) -> Tensor");
  // The bfloat16 path of both (0: the best this CPU has, 1: widening, 2: vdpbf16ps); returns the one in force.
  m.def("bf16_linear_path", &set_bf16_path);
}

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) {
  m.impl("decode_linear", &decode_linear);
  m.impl("invariant_linear", &invariant_linear);
}
