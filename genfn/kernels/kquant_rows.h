// The K-quant library's row-function dispatch, shared by its row kernels' sources
// (kquant_linear.cpp, iq4_linear.cpp, kquant_r8.cpp); apart from kquant.h, which the decode
// library includes too.
#pragma once

// The row function of a kernel template for `rows` rows of x (1..8; 8: any more), returned from
// the enclosing function; arguments after KERNEL follow the row count: GENFN_ROW_CASES(rows, row_avx512, F).
#define GENFN_ROW_CASES(rows, KERNEL, ...)     \
  switch (rows) {                              \
    case 1: return &KERNEL<1, ##__VA_ARGS__>;  \
    case 2: return &KERNEL<2, ##__VA_ARGS__>;  \
    case 3: return &KERNEL<3, ##__VA_ARGS__>;  \
    case 4: return &KERNEL<4, ##__VA_ARGS__>;  \
    case 5: return &KERNEL<5, ##__VA_ARGS__>;  \
    case 6: return &KERNEL<6, ##__VA_ARGS__>;  \
    case 7: return &KERNEL<7, ##__VA_ARGS__>;  \
    default: return &KERNEL<8, ##__VA_ARGS__>; \
  }
