// The activations' Q8_K quantization in spans of a row (kquant_quantize.cpp), so that the threads
// of a parallel region can share out one row's blocks: a decode step's single row of x would
// otherwise be quantized by one thread while the others wait at the barrier that follows.
#pragma once

#include "kquant.h"

namespace genfn::kquant {

// Spans start at multiples of this many inputs: whole blocks, and whole runs of 128 that an order
// (kquant.h) permutes.
constexpr int64_t quantize_unit(int64_t block) { return block < 128 ? 128 : block; }

// Inputs [k0, k1) of row m of x [M, a.K] into a, as quantize_rows_k quantizes the whole row (k0 a
// multiple of quantize_unit(block); k1 one too, or a.K). avx512: the AVX-512 form, which the CPU
// must have (the same bits as the plain C++ one).
void quantize_span_k(const float* x, int64_t m, int64_t k0, int64_t k1, int64_t block, Order order, bool avx512,
                     ActivationsK& a);

// Whether this CPU runs quantize_span_k's AVX-512 form (kquant_linear.cpp, from its ISA detection;
// quantize_rows_k and the shared quantization take it where it can).
bool quantize_avx512();

}  // namespace genfn::kquant
