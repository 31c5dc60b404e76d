// y = x @ dequantize(W).T for the block formats of genfn/quant/weight.py's "tiles16" layout on AVX2
// (tiles_avx2.h's kernels): the product of a CPU that cannot load the decode library (built for
// AVX-512), where those weights would otherwise run the torch reference, which dequantizes every
// weight on every call (SmolLM2's Q4_1 file: 2.5 s a token on such a path).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tiles_avx2.h"

namespace {

using namespace genfn_kernels::tiles_avx2;

at::Tensor tiles_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t kind, int64_t out_features,
                        const c10::optional<at::Tensor>& init) {
  TORCH_CHECK(genfn::kquant::best_isa() != genfn::kquant::kNone,
              "tiles_linear: needs an x86-64 CPU with AVX2, FMA and F16C; this one lacks them");
  TORCH_CHECK(valid_tile_kind(kind), "tiles_linear: kind must be ", kTileKindNames, ", got ", kind);
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte,
              "tiles_linear: codes must be uint8 [tiles, blocks, bytes]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf, "tiles_linear: scales must be float16");
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), "tiles_linear: CPU tensors only");
  const int64_t K = x.size(-1), tiles = codes.size(0), nb = codes.size(1), N = out_features;
  TORCH_CHECK(K == nb * kBlock, "tiles_linear: x has ", K, " features, the weight expects ", nb * kBlock);
  TORCH_CHECK(codes.size(2) == tile_block_bytes(kind), "tiles_linear: codes of ", codes.size(2),
              " bytes a block do not match kind ", kind);
  TORCH_CHECK(N <= tiles * kTile && N > (tiles - 1) * kTile, "tiles_linear: ", N, " output rows do not fit ", tiles,
              " tiles");
  TORCH_CHECK(scales.numel() == tiles * nb * kTile, "tiles_linear: scales do not match the codes");
  const bool has_min = has_minimum(kind);
  TORCH_CHECK(!has_min || (mins.has_value() && mins->numel() == scales.numel() && mins->scalar_type() == at::kHalf),
              "tiles_linear: kinds 1 and 4 (with minimums) need float16 mins shaped like the scales");
  const int64_t M = K == 0 ? 0 : x.numel() / K;
  TORCH_CHECK(!init.has_value() || init->numel() == M * N, "tiles_linear: init must hold the output's ", M, " x ", N,
              " values, got ", init.has_value() ? init->numel() : 0);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return y.view(out_sizes).to(x.scalar_type());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor start = init.has_value() ? init->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor c = codes.contiguous(), s = scales.contiguous();
  const at::Tensor mn = has_min ? mins->contiguous() : at::Tensor();
  const uint8_t* cp = c.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>());
  const uint16_t* mp = has_min ? reinterpret_cast<const uint16_t*>(mn.data_ptr<at::Half>()) : nullptr;
  const float* ip = init.has_value() ? start.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Reused across calls (a decode step makes dozens); the workers read the caller's through this reference.
  thread_local genfn_kernels::QuantActivations buffer;
  genfn_kernels::QuantActivations& a = buffer;
  a.resize(M, K);
  const float* xp = xf.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)),
                   [&](int64_t m0, int64_t m1) { quantize_rows(xp, m0, m1, K, a); });
  // Each thread a run of tiles, every group of rows of x over a tile while it is in cache, so the
  // weight streams from memory once. At least 32 KiB of codes a run.
  const int64_t tile_bytes = nb * tile_block_bytes(kind);
  at::parallel_for(0, tiles, std::max<int64_t>(1, 32768 / std::max<int64_t>(tile_bytes, 1)), [&](int64_t t0, int64_t t1) {
    tiles_rows(t0, t1, M, kind, nb, cp, sp, mp, a, K, N, N, yp, ip);
  });
  return y.view(out_sizes).to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genfn_kquant, m) {
  m.def("tiles_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int kind, int out_features, "
        "Tensor? init=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(genfn_kquant, CPU, m) { m.impl("tiles_linear", &tiles_linear); }
