// The table of a step's stack of layers: what decode_stack.cpp's ops read, built once by
// stack_table.cpp's decode_stack_table from a stack's weights.
//
// The table holds a stack's weights, checked once, as the call reads them: each layer's kind, its
// norms and its linears' data pointers, with references that keep the weights alive. It is a
// uint8 tensor of kTableBytes whose bytes are the table's header (the rest of it lives beside),
// so a step passes its whole stack as one tensor. Passed as ~180 (1B) to ~440 (SmolLM2) tensors,
// the weights cost a compiled step ~0.16-0.3 ms of inductor's wrapper and dynamo's bytecode turning
// each into an argument, and an eager step the conversion of the list. A copy of the bytes is
// refused: its header points at the table it was copied from (`self`), not at itself.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "decode_layer.h"

namespace genfn_kernels::stack {

using genfn_kernels::layer::QuantLinear;

// A layer's kind, as the layout numbers it (stack_table.cpp).
constexpr int64_t kPlain = 0, kTiles = 1, kKQuant = 2, kMixed = 3, kCoded = 4;
constexpr int64_t kMaxParts = genfn::kquant::SharedLinear::kMaxParts;

// One layer of the table: its kind, its norms and, for its four linears (wqkv [N, E], wo [E, HD],
// w_gate_up [2F, E], w_down [E, F]), what that kind's linear reads.
struct TableLayer {
  int64_t kind = kPlain, F = 0;
  const void* attn_norm = nullptr;
  const void* mlp_norm = nullptr;
  const void* plain[4] = {};                              // kPlain: the weights' rows
  genfn_kernels::CodedWeight coded[4] = {};               // kCoded: the coded matrices
  genfn_kernels::QuantWeight tiles[4][QuantLinear::kMaxParts] = {};  // kTiles: each linear's parts
  int64_t tile_count[4] = {};
  genfn::kquant::MatrixPart parts[4][kMaxParts] = {};     // kKQuant: each linear's parts
  int64_t part_count[4] = {};
  int64_t linear_kind[4] = {};                            // kMixed: kTiles or kKQuant, each linear's
};

constexpr uint64_t kTableMagic = 0x67656e666e535442ull;  // "genfnSTB"

// The header the table tensor's bytes are; kTableBytes of them.
struct TableHeader {
  uint64_t magic;
  const TableHeader* self;  // where this header was built: a copy of the bytes points elsewhere
};
constexpr int64_t kTableBytes = sizeof(TableHeader);

struct StackTable {
  TableHeader header{kTableMagic, &header};
  at::ScalarType dtype = at::kFloat;
  int64_t E = 0, heads = 0, kv_heads = 0, D = 0;
  std::vector<TableLayer> layers;
  std::vector<at::Tensor> keep;  // the tensors the layers point into, alive as long as the table
};

// The table a decode_stack call was handed, checked (`op` names the call in errors).
const StackTable& table_of(const at::Tensor& table, const char* op);

}  // namespace genfn_kernels::stack
