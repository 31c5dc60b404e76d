// A mixture-of-experts MLP's decode step that reads only the experts the router chose.
//
//   moe_decode(x [T, H], experts [T, k] int64, weights [T, k], gate_up [E, 2I, H], down [E, H, I])
//     -> (out [T, H], bytes_read [] int64)
//
// For each row t and each of its k chosen experts e (with weight w):
//   out[t] += w * down[e] @ (silu(gate_up[e][:I] @ x[t]) * gate_up[e][I:] @ x[t])
// accumulated in the order the router listed them, in float32. A decode step has a few rows, so
// the step is bound by streaming weights: torch's dense formulation (every expert on every row,
// zero-weighted where unchosen) reads all E experts, a gather copies the chosen ones first; this
// reads each chosen expert's 3 * I * H weights once per row that chose it and nothing else. The
// rows of an expert's matrices are split over the threads (at::parallel_for), so one row of x
// uses every core. ``bytes_read`` is the weight bytes the call read, so a test can count what a
// token touched. float32 only (the caller falls back to torch otherwise).
//
//   moe_decode_quant(x, experts, weights, gate_up codes/scales/mins/kind/rows, down ...) -> (out, bytes_read)
//
// The same step over experts kept in block formats (genfn/quant/experts.py: each projection a
// stack of E "tiles16" matrices, Q8_0/Q4_0/Q4_1/int8/int4): each chosen (row, expert) pair runs
// quant_linear's arithmetic (quant_linear.cpp's shares: the activation quantized to 8 bits per
// block of 32, integer dot products per block) on that expert's slice of the stack, and nothing
// else of the stack is read. One parallel region: every pair's gate/up product (each a balanced
// queue of its tiles, so a thread that finishes one expert's share takes part of another's),
// the SwiGLUs, every pair's down product, then the weighted sums in the router's order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/Half.h>
#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <memory>
#include <tuple>
#include <vector>

#include "decode_kernels.h"
#include "team_barrier.h"

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  float sum = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

std::tuple<at::Tensor, at::Tensor> moe_decode(const at::Tensor& x, const at::Tensor& experts,
                                              const at::Tensor& weights, const at::Tensor& gate_up,
                                              const at::Tensor& down) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "moe_decode: x must be [T, H] float32");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.scalar_type() == at::kFloat &&
                  down.scalar_type() == at::kFloat,
              "moe_decode: gate_up [E, 2I, H] and down [E, H, I] must be float32");
  TORCH_CHECK(experts.scalar_type() == at::kLong && experts.dim() == 2 && experts.size(0) == x.size(0),
              "moe_decode: experts must be [T, k] int64");
  TORCH_CHECK(weights.sizes() == experts.sizes(), "moe_decode: weights must have experts' shape");
  const int64_t rows = x.size(0), hidden = x.size(1), top_k = experts.size(1);
  const int64_t num_experts = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(2) == hidden && down.size(1) == hidden && down.size(2) == inter &&
                  down.size(0) == num_experts,
              "moe_decode: expert shapes disagree with x");
  auto xc = x.contiguous();
  auto gu = gate_up.contiguous();
  auto dn = down.contiguous();
  auto ex = experts.contiguous();
  auto wt = weights.to(at::kFloat).contiguous();
  auto out = at::zeros({rows, hidden}, x.options());
  std::vector<float> act(inter);
  int64_t read = 0;
  for (int64_t t = 0; t < rows; ++t) {
    const float* xt = xc.data_ptr<float>() + t * hidden;
    float* ot = out.data_ptr<float>() + t * hidden;
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t e = ex.data_ptr<int64_t>()[t * top_k + j];
      TORCH_CHECK(e >= 0 && e < num_experts, "moe_decode: expert index ", e, " out of range");
      const float w = wt.data_ptr<float>()[t * top_k + j];
      const float* g = gu.data_ptr<float>() + e * 2 * inter * hidden;
      const float* u = g + inter * hidden;
      const float* d = dn.data_ptr<float>() + e * hidden * inter;
      float* a = act.data();
      at::parallel_for(0, inter, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const float gate = dot(g + r * hidden, xt, hidden);
          const float up = dot(u + r * hidden, xt, hidden);
          a[r] = gate / (1.0f + std::exp(-gate)) * up;
        }
      });
      at::parallel_for(0, hidden, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) ot[r] += w * dot(d + r * inter, a, inter);
      });
      read += 3 * inter * hidden * static_cast<int64_t>(sizeof(float));
    }
  }
  return {out, at::scalar_tensor(read, x.options().dtype(at::kLong))};
}

// One projection's stacked experts in the tile layout; expert(e) is its slice.
struct ExpertStack {
  const uint8_t* codes;
  const uint16_t* scales;
  const uint16_t* mins;
  int64_t kind, experts, tiles, blocks, rows, code_stride, scale_stride;

  genfn_kernels::QuantWeight expert(int64_t e) const {
    return {codes + e * code_stride, scales + e * scale_stride, mins ? mins + e * scale_stride : nullptr, kind, tiles,
            blocks, rows};
  }
  int64_t expert_bytes() const {
    return code_stride + scale_stride * static_cast<int64_t>(sizeof(uint16_t)) * (mins ? 2 : 1);
  }
};

ExpertStack expert_stack(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                         int64_t kind, int64_t rows, const char* name) {
  TORCH_CHECK(genfn_kernels::valid_tile_kind(kind), "moe_decode_quant: ", name, " kind must be ",
              genfn_kernels::kTileKindNames, ", got ", kind);
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kByte && codes.is_contiguous(), "moe_decode_quant: ",
              name, " codes must be contiguous uint8 [E, tiles, blocks, bytes]");
  const int64_t experts = codes.size(0), tiles = codes.size(1), blocks = codes.size(2);
  TORCH_CHECK(codes.size(3) == genfn_kernels::tile_block_bytes(kind), "moe_decode_quant: ", name, " codes of ", codes.size(3),
              " bytes a block do not match kind ", kind);
  TORCH_CHECK(rows <= tiles * 16 && rows > (tiles - 1) * 16, "moe_decode_quant: ", name, " rows (", rows,
              ") do not fit ", tiles, " tiles");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == experts * tiles * blocks * 16,
              "moe_decode_quant: ", name, " scales must be contiguous float16 [E, tiles, blocks, 16]");
  const bool has_min = genfn_kernels::has_minimum(kind);
  TORCH_CHECK(!has_min || (mins.has_value() && mins->scalar_type() == at::kHalf && mins->is_contiguous() &&
                           mins->numel() == scales.numel()),
              "moe_decode_quant: ", name, " kinds 1 and 4 need float16 mins shaped like the scales");
  const auto half = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); };
  return {codes.data_ptr<uint8_t>(), half(scales), has_min ? half(*mins) : nullptr, kind, experts, tiles, blocks, rows,
          tiles * blocks * codes.size(3), tiles * blocks * 16};
}

std::tuple<at::Tensor, at::Tensor> moe_decode_quant(
    const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights, const at::Tensor& gate_up_codes,
    const at::Tensor& gate_up_scales, const c10::optional<at::Tensor>& gate_up_mins, int64_t gate_up_kind,
    int64_t gate_up_rows, const at::Tensor& down_codes, const at::Tensor& down_scales,
    const c10::optional<at::Tensor>& down_mins, int64_t down_kind, int64_t down_rows) {
  TORCH_CHECK(genfn_kernels::cpu_has_avx512_vnni(), "moe_decode_quant: needs a CPU with AVX512_VNNI");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(0) >= 1 &&
                  x.size(0) <= genfn_kernels::kMaxDecodeRows,
              "moe_decode_quant: x must be [T, H] float32 with 1 <= T <= ", genfn_kernels::kMaxDecodeRows, ", got ",
              x.sizes());
  TORCH_CHECK(experts.scalar_type() == at::kLong && experts.dim() == 2 && experts.size(0) == x.size(0),
              "moe_decode_quant: experts must be [T, k] int64");
  TORCH_CHECK(weights.sizes() == experts.sizes(), "moe_decode_quant: weights must have experts' shape");
  const ExpertStack gu = expert_stack(gate_up_codes, gate_up_scales, gate_up_mins, gate_up_kind, gate_up_rows, "gate_up");
  const ExpertStack dn = expert_stack(down_codes, down_scales, down_mins, down_kind, down_rows, "down");
  const int64_t rows = x.size(0), hidden = x.size(1), top_k = experts.size(1), pairs = rows * top_k;
  const int64_t inter = gu.rows / 2;
  TORCH_CHECK(gu.rows % 2 == 0 && gu.blocks * 32 == hidden && dn.rows == hidden && dn.blocks * 32 == inter &&
                  dn.experts == gu.experts,
              "moe_decode_quant: expert shapes disagree with x (gate_up [E, 2I, H], down [E, H, I])");
  auto ex = experts.contiguous();
  const int64_t* chosen = ex.data_ptr<int64_t>();
  for (int64_t p = 0; p < pairs; ++p)
    TORCH_CHECK(chosen[p] >= 0 && chosen[p] < gu.experts, "moe_decode_quant: expert index ", chosen[p], " out of range");
  auto xc = x.contiguous();
  auto wt = weights.to(at::kFloat).contiguous();
  auto out = at::empty({rows, hidden}, x.options());
  // Buffers reused across calls (a step makes one call per layer); the team reads the calling
  // thread's through these pointers.
  thread_local std::vector<genfn_kernels::QuantActivations> x8, act8;
  thread_local std::vector<float> gate_up, act, down;
  thread_local std::unique_ptr<genfn_kernels::RowQueue[]> queues;
  thread_local int64_t queue_count = 0;
  if (static_cast<int64_t>(x8.size()) < rows) x8.resize(rows);
  if (static_cast<int64_t>(act8.size()) < pairs) act8.resize(pairs);
  if (queue_count < 2 * pairs) {
    queues.reset(new genfn_kernels::RowQueue[2 * pairs]);
    queue_count = 2 * pairs;
  }
  gate_up.resize(pairs * 2 * inter);
  act.resize(pairs * inter);
  down.resize(pairs * hidden);
  const int64_t threads = omp_in_parallel() ? 1 : at::get_num_threads();
  for (int64_t t = 0; t < rows; ++t) x8[t].resize(1, hidden);
  for (int64_t p = 0; p < pairs; ++p) {
    act8[p].resize(1, inter);
    queues[p].prepare_blocks(gu.tiles, threads);
    queues[pairs + p].prepare_blocks(dn.tiles, threads);
  }
  const float* xp = xc.data_ptr<float>();
  const float* wp = wt.data_ptr<float>();
  float* op = out.data_ptr<float>();
  genfn_kernels::QuantActivations* x8p = x8.data();
  genfn_kernels::QuantActivations* act8p = act8.data();
  float *gp = gate_up.data(), *ap = act.data(), *dp = down.data();
  genfn_kernels::RowQueue* qp = queues.get();
  genfn_kernels::TeamBarrier barrier;
#pragma omp parallel num_threads(threads)
  {
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    // A row of x (or of the SwiGLU) is quantized by one thread; rotating which spreads them.
    for (int64_t r = 0; r < rows; ++r) genfn_kernels::quantize_rows_share(xp + r * hidden, 1, hidden, x8p[r], (t + r) % team, team);
    barrier.wait(team);
    for (int64_t p = 0; p < pairs; ++p)
      genfn_kernels::quant_linear_share(1, x8p[p / top_k], hidden, gu.expert(chosen[p]), gp + p * 2 * inter, t, qp[p]);
    barrier.wait(team);
    for (int64_t i = pairs * inter * t / team; i < pairs * inter * (t + 1) / team; ++i) {
      const int64_t p = i / inter, r = i % inter;
      const float gate = gp[p * 2 * inter + r], up = gp[p * 2 * inter + inter + r];
      ap[i] = gate / (1.0f + std::exp(-gate)) * up;
    }
    barrier.wait(team);
    for (int64_t p = 0; p < pairs; ++p) genfn_kernels::quantize_rows_share(ap + p * inter, 1, inter, act8p[p], (t + p) % team, team);
    barrier.wait(team);
    for (int64_t p = 0; p < pairs; ++p)
      genfn_kernels::quant_linear_share(1, act8p[p], inter, dn.expert(chosen[p]), dp + p * hidden, t, qp[pairs + p]);
    barrier.wait(team);
    for (int64_t i = rows * hidden * t / team; i < rows * hidden * (t + 1) / team; ++i) {
      const int64_t r = i / hidden, h = i % hidden;
      float sum = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) sum += wp[r * top_k + j] * dp[(r * top_k + j) * hidden + h];
      op[i] = sum;
    }
  }
  const int64_t read = pairs * (gu.expert_bytes() + dn.expert_bytes());
  return {out, at::scalar_tensor(read, x.options().dtype(at::kLong))};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genfn_kernels, m) {
  m.def("moe_decode(Tensor x, Tensor experts, Tensor weights, Tensor gate_up, Tensor down) -> (Tensor, Tensor)");
  m.def("moe_decode_quant(Tensor x, Tensor experts, Tensor weights, Tensor gate_up_codes, Tensor gate_up_scales, "
        "Tensor? gate_up_mins, int gate_up_kind, int gate_up_rows, Tensor down_codes, Tensor down_scales, "
        "Tensor? down_mins, int down_kind, int down_rows) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) {
  m.impl("moe_decode", &moe_decode);
  m.impl("moe_decode_quant", &moe_decode_quant);
}
