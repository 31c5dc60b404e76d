// decode_stack_table: a stack's weights checked once into the table decode_stack.cpp's ops read
// (stack_table.h).
//
//   decode_stack_table(weights, layout, dtype, hidden, heads, kv_heads, head_dim) -> table
//
// The table's weights, layer after layer: attn_norm, mlp_norm, then wqkv, wo, w_gate_up and w_down
// as the layer's kind reads them. `layout` holds, per layer, the kind and what each linear needs:
//   0, plain weights in the table's dtype (float32, or bfloat16 on a CPU with AVX512_BF16): nothing
//      more; a linear is one tensor, the weight.
//   1, tiles16 blocks (float32 x): the MLP's width F, then per linear its number of parts P (row
//      ranges in different tile kinds, one after another) and each part's tile kind (tile_kinds.h)
//      and rows; three tensors a part: codes, scales, minimums (None where the kind has none).
//   2, K-quant rows (float32 x): F, then per linear its number of parts P and their P formats; P
//      tensors.
//   3, a mix of the two (float32 x; a Q4_K_M file's Q5_0 matrices kept as tiles beside its K-quant
//      rows): F, then per linear its kind (1 or 2) and what that kind reads, as above.
//   4, coded bfloat16 (bfloat16 x; coded_bf16.cpp): nothing more; four tensors a linear: records,
//      bases, raw, raw_start.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <memory>
#include <vector>

#include "stack_table.h"

namespace {

using namespace genfn_kernels::layer;
using namespace genfn_kernels::stack;

constexpr const char* kTableOp = "decode_stack_table";

// Reads the weights and the layout in the order the header above gives them.
struct StackReader {
  const c10::List<c10::optional<at::Tensor>>& weights;
  const std::vector<int64_t>& layout;
  size_t tensor = 0, value = 0;

  bool done() const { return value == layout.size(); }
  int64_t next_value(const char* what) {
    TORCH_CHECK(value < layout.size(), kTableOp, ": the layout ends before ", what);
    return layout[value++];
  }
  c10::optional<at::Tensor> next_optional(const char* what) {
    TORCH_CHECK(tensor < weights.size(), kTableOp, ": the weights end before ", what);
    return weights.get(tensor++);
  }
  at::Tensor next_tensor(const char* what) {
    c10::optional<at::Tensor> t = next_optional(what);
    TORCH_CHECK(t.has_value(), kTableOp, ": ", what, " is None");
    return *t;
  }
};

constexpr const char* kLinearNames[] = {"wqkv", "wo", "w_gate_up", "w_down"};

void read_plain(StackReader& in, const at::Tensor& probe, int64_t N, int64_t HD, TableLayer& l,
                std::vector<at::Tensor>& keep) {
  const int64_t E = probe.size(1);
  at::Tensor w[4];
  for (int i = 0; i < 4; ++i) w[i] = in.next_tensor(kLinearNames[i]).contiguous();
  TORCH_CHECK(w[3].dim() == 2, kTableOp, ": w_down must be [hidden, intermediate], got ", w[3].sizes());
  l.F = w[3].size(1);
  const int64_t rows[] = {N, E, 2 * l.F, E}, cols[] = {E, HD, E, l.F};
  for (int i = 0; i < 4; ++i) {
    check_weight(w[i], probe, rows[i], cols[i], kTableOp, kLinearNames[i]);
    TORCH_CHECK(w[i].device().is_cpu(), kTableOp, ": ", kLinearNames[i], " must be on the CPU");
    l.plain[i] = w[i].data_ptr();
    keep.push_back(w[i]);
  }
}

// A coded bfloat16 layer's four linears (coded_bf16.cpp): four tensors each, records, bases, raw
// and raw_start.
void read_coded(StackReader& in, const at::Tensor& probe, int64_t N, int64_t HD, TableLayer& l,
                std::vector<at::Tensor>& keep) {
  TORCH_CHECK(probe.scalar_type() == at::kBFloat16, kTableOp, ": coded layers (kind 4) take bfloat16 x, not ",
              probe.scalar_type());
  const int64_t E = probe.size(1);
  at::Tensor w[4][4];
  for (int i = 0; i < 4; ++i)
    for (auto& t : w[i]) t = in.next_tensor(kLinearNames[i]).contiguous();
  TORCH_CHECK(w[3][0].dim() == 2, kTableOp, ": w_down's records must be [hidden, intermediate / 64 * 96], got ",
              w[3][0].sizes());
  l.F = w[3][0].size(1) / 96 * 64;
  const int64_t rows[] = {N, E, 2 * l.F, E}, cols[] = {E, HD, E, l.F};
  for (int i = 0; i < 4; ++i) {
    const at::Tensor& records = w[i][0];
    TORCH_CHECK(records.dim() == 2 && records.size(0) == rows[i] && records.size(1) == cols[i] / 64 * 96 &&
                    cols[i] % 64 == 0,
                kTableOp, ": ", kLinearNames[i], "'s records must be [", rows[i], ", ", cols[i] / 64 * 96,
                "] (a coded [", rows[i], ", ", cols[i], "] matrix), got ", records.sizes());
    l.coded[i] = genfn_kernels::coded_weight_of(w[i][0], w[i][1], w[i][2], w[i][3], kTableOp);
    for (auto& t : w[i]) keep.push_back(t);
  }
}

// Linear i of tiles16 blocks: its number of parts P, each part's tile kind and rows, then three
// tensors a part (minimums None where its kind has none).
void read_tiles_linear(StackReader& in, int i, int64_t rows, int64_t cols, TableLayer& l,
                       std::vector<at::Tensor>& keep) {
  const int64_t count = in.next_value(kLinearNames[i]);
  TORCH_CHECK(count >= 1 && count <= QuantLinear::kMaxParts, kTableOp, ": ", kLinearNames[i], " must have 1 to ",
              QuantLinear::kMaxParts, " parts, got ", count);
  int64_t kinds[QuantLinear::kMaxParts], part_rows[QuantLinear::kMaxParts], total = 0;
  for (int64_t p = 0; p < count; ++p) {
    kinds[p] = in.next_value(kLinearNames[i]);
    part_rows[p] = in.next_value(kLinearNames[i]);
    TORCH_CHECK(part_rows[p] >= 1, kTableOp, ": ", kLinearNames[i], "'s parts must have rows, got ", part_rows[p]);
    total += part_rows[p];
  }
  TORCH_CHECK(total == rows, kTableOp, ": ", kLinearNames[i], "'s parts hold ", total, " rows, it needs ", rows);
  for (int64_t p = 0; p < count; ++p) {
    c10::optional<at::Tensor> tensors[3];
    for (auto& tensor : tensors) tensor = in.next_optional(kLinearNames[i]);
    TORCH_CHECK(tensors[0].has_value() && tensors[1].has_value(), kTableOp, ": ", kLinearNames[i],
                "'s codes and scales must be tensors");
    for (const auto& tensor : tensors)
      if (tensor.has_value()) {
        TORCH_CHECK(tensor->device().is_cpu(), kTableOp, ": ", kLinearNames[i], " must be on the CPU");
        keep.push_back(*tensor);
      }
    l.tiles[i][p] = quant_weight(*tensors[0], *tensors[1], tensors[2], kinds[p], part_rows[p], cols, kTableOp,
                                 kLinearNames[i]);
  }
  l.tile_count[i] = count;
}

// Linear i of K-quant rows: its number of parts P, their P formats, P tensors.
void read_kquant_linear(StackReader& in, int i, int64_t rows, int64_t cols, TableLayer& l,
                        std::vector<at::Tensor>& keep) {
  const int64_t count = in.next_value(kLinearNames[i]);
  TORCH_CHECK(count >= 1 && count <= kMaxParts, kTableOp, ": ", kLinearNames[i], " must have 1 to ", kMaxParts,
              " parts, got ", count);
  std::vector<int64_t> formats;
  std::vector<at::Tensor> parts;
  for (int64_t p = 0; p < count; ++p) formats.push_back(in.next_value(kLinearNames[i]));
  for (int64_t p = 0; p < count; ++p) parts.push_back(in.next_tensor(kLinearNames[i]));
  KQuantLinear linear;
  std::vector<at::Tensor> contiguous;
  contiguous.reserve(kMaxParts);  // no reallocation: the linear points into it
  kquant_weight(linear, parts, formats, rows, cols, kTableOp, kLinearNames[i], contiguous);
  l.part_count[i] = linear.shared.count;
  for (int64_t p = 0; p < linear.shared.count; ++p) l.parts[i][p] = linear.shared.parts[p];
  for (auto& part : contiguous) keep.push_back(std::move(part));
}

// A quantized layer's linears after the MLP's width F: every one of the layer's kind, or (kMixed)
// each after its own kind.
void read_quantized(StackReader& in, int64_t E, int64_t N, int64_t HD, TableLayer& l, std::vector<at::Tensor>& keep) {
  l.F = in.next_value("the MLP's width");
  TORCH_CHECK(l.F >= 1, kTableOp, ": the MLP's width must be >= 1, got ", l.F);
  const int64_t rows[] = {N, E, 2 * l.F, E}, cols[] = {E, HD, E, l.F};
  for (int i = 0; i < 4; ++i) {
    int64_t kind = l.kind;
    if (l.kind == kMixed) {
      kind = in.next_value(kLinearNames[i]);
      TORCH_CHECK(kind == kTiles || kind == kKQuant, kTableOp, ": a mixed layer's ", kLinearNames[i],
                  " must be of kind 1 (tiles16) or 2 (K-quant), got ", kind);
      l.linear_kind[i] = kind;
    }
    if (kind == kTiles) read_tiles_linear(in, i, rows[i], cols[i], l, keep);
    else read_kquant_linear(in, i, rows[i], cols[i], l, keep);
  }
}

at::Tensor decode_stack_table(const c10::List<c10::optional<at::Tensor>>& weights, const std::vector<int64_t>& layout,
                              at::ScalarType dtype, int64_t hidden, int64_t heads, int64_t kv_heads,
                              int64_t head_dim) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, kTableOp, ": dtype must be float32 or bfloat16, got ",
              dtype);
  TORCH_CHECK(hidden >= 1 && kv_heads >= 1 && heads % kv_heads == 0 && head_dim % 16 == 0 && head_dim <= 128,
              kTableOp, ": ", heads, " query heads over ", kv_heads, " kv heads of head_dim ", head_dim,
              " (a multiple of 16 up to 128) are not supported");
  auto table = std::make_unique<StackTable>();
  table->dtype = dtype;
  table->E = hidden;
  table->heads = heads;
  table->kv_heads = kv_heads;
  table->D = head_dim;
  const int64_t N = (heads + 2 * kv_heads) * head_dim, HD = heads * head_dim;
  // A row of x as the layers take it: what the checks of x's dtype and width read.
  const at::Tensor probe = at::empty({1, hidden}, at::TensorOptions().dtype(dtype));
  StackReader reader{weights, layout};
  while (!reader.done()) {
    TableLayer l;
    l.kind = reader.next_value("a layer's kind");
    TORCH_CHECK(l.kind >= kPlain && l.kind <= kCoded, kTableOp,
                ": a layer's kind must be 0 (plain), 1 (tiles16), 2 (K-quant), 3 (mixed) or 4 (coded bfloat16), got ",
                l.kind);
    TORCH_CHECK(l.kind != kCoded || genfn_kernels::cpu_has_avx512_bf16(), kTableOp,
                ": coded bfloat16 layers need the AVX-512 decode kernels on a CPU with AVX512_BF16");
    // What x must be for the layer's weights (tiles16, mixed too: float32 and AVX512_VNNI; K-quant:
    // float32).
    check_rows(probe, kTableOp, l.kind == kPlain || l.kind == kCoded ? Weights::kPlain
                                : l.kind == kKQuant                  ? Weights::kKQuant
                                                                     : Weights::kTiles);
    at::Tensor norms[2] = {reader.next_tensor("attn_norm").contiguous(), reader.next_tensor("mlp_norm").contiguous()};
    check_norm(norms[0], probe, kTableOp, "attn_norm");
    check_norm(norms[1], probe, kTableOp, "mlp_norm");
    l.attn_norm = norms[0].data_ptr();
    l.mlp_norm = norms[1].data_ptr();
    for (auto& norm : norms) table->keep.push_back(std::move(norm));
    if (l.kind == kPlain)
      read_plain(reader, probe, N, HD, l, table->keep);
    else if (l.kind == kCoded)
      read_coded(reader, probe, N, HD, l, table->keep);
    else
      read_quantized(reader, hidden, N, HD, l, table->keep);
    table->layers.push_back(l);
  }
  TORCH_CHECK(!table->layers.empty() && reader.tensor == weights.size(), kTableOp,
              ": the layout must describe every weight, one layer at least");
  StackTable* raw = table.release();
  return at::from_blob(&raw->header, {kTableBytes}, [raw](void*) { delete raw; }, at::TensorOptions().dtype(at::kByte));
}

}  // namespace

namespace genfn_kernels::stack {

const StackTable& table_of(const at::Tensor& table, const char* op) {
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == at::kByte && table.dim() == 1 &&
                  table.numel() == kTableBytes && table.is_contiguous(),
              op, ": table must be what decode_stack_table returned, a uint8 [", kTableBytes, "] CPU tensor, got ",
              table.sizes(), " ", table.scalar_type());
  const auto* header = static_cast<const TableHeader*>(table.data_ptr());
  TORCH_CHECK(header->magic == kTableMagic && header->self == header, op,
              ": table is not a stack table decode_stack_table built (a copy of one's bytes is not)");
  return *reinterpret_cast<const StackTable*>(header);  // the header is the table's first member
}

}  // namespace genfn_kernels::stack

TORCH_LIBRARY_FRAGMENT(genfn_kernels, m) {
  m.def("decode_stack_table(Tensor?[] weights, int[] layout, ScalarType dtype, int hidden, int heads, "
        "int kv_heads, int head_dim) -> Tensor");
}

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) { m.impl("decode_stack_table", &decode_stack_table); }
