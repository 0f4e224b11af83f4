// gemm_pick.h: LOOM_GEMM_PICK tables, which of cuBLASLt's heuristic candidates named products
// take instead of its first (kernels/cuda/matmul.cu reads one at its first plan; bench/gemm_pick.py
// writes them from bench_gemm_shapes' ranked lines). Plain C++, so that the CPU tests check it.
//
// A table is text, one product a line: "M N K ta tb epilogue batch rank" in matmul.cu's plan
// terms (row-major C[M, N] = op(A) op(B) over K, transposes 0/1, cuBLASLt's epilogue number, the
// batch count), then the rank, 0 being the heuristic's first; '#' starts a comment, blank lines
// are skipped. A line with other words, a negative size or rank, or a product named twice is an
// error naming the file and line.
#pragma once
#include <istream>
#include <string>
#include <vector>

namespace loom {

struct GemmPick {
  int M, N, K, ta, tb, epilogue, batch, rank;
};

// the table in `in`; `name` (the file's path) heads each error: "name:line: ..."
std::vector<GemmPick> parse_gemm_picks(std::istream& in, const std::string& name);
// the table in the file at `path` (an error if it cannot be opened)
std::vector<GemmPick> load_gemm_picks(const std::string& path);
// the rank the table gives this product, -1 if it names none
int find_gemm_pick(const std::vector<GemmPick>& table, int M, int N, int K, int ta, int tb, int epilogue,
                   int batch);

}  // namespace loom
