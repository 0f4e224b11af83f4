// gemm_pick.cpp: LOOM_GEMM_PICK tables (gemm_pick.h).
#include "kernels/gemm_pick.h"

#include <fstream>
#include <sstream>
#include <stdexcept>

namespace loom {

std::vector<GemmPick> parse_gemm_picks(std::istream& in, const std::string& name) {
  std::vector<GemmPick> table;
  std::vector<int> line_of;  // the line each entry came from, for a product named twice
  std::string line;
  int no = 0;
  auto fail = [&](const std::string& what) {
    throw std::runtime_error(name + ":" + std::to_string(no) + ": " + what);
  };
  while (std::getline(in, line)) {
    no++;
    if (const size_t h = line.find('#'); h != std::string::npos) line.resize(h);
    std::istringstream words(line);
    std::vector<long long> v;
    std::string w;
    while (words >> w) {
      size_t used = 0;
      long long x = 0;
      try {
        x = std::stoll(w, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != w.size()) fail("'" + w + "' is not a whole number (want \"M N K ta tb epilogue batch rank\")");
      v.push_back(x);
    }
    if (v.empty()) continue;  // blank or a comment
    if (v.size() != 8)
      fail(std::to_string(v.size()) + " numbers, want 8: \"M N K ta tb epilogue batch rank\"");
    for (long long x : v)
      if (x < 0 || x > 1 << 30) fail("a number out of range (" + std::to_string(x) + "): sizes and ranks are >= 0");
    if (v[3] > 1 || v[4] > 1) fail("ta and tb are 0 or 1");
    GemmPick p{int(v[0]), int(v[1]), int(v[2]), int(v[3]), int(v[4]), int(v[5]), int(v[6]), int(v[7])};
    for (size_t i = 0; i < table.size(); i++) {
      const GemmPick& q = table[i];
      if (q.M == p.M && q.N == p.N && q.K == p.K && q.ta == p.ta && q.tb == p.tb && q.epilogue == p.epilogue &&
          q.batch == p.batch)
        fail("the product of line " + std::to_string(line_of[i]) + " again");
    }
    table.push_back(p);
    line_of.push_back(no);
  }
  return table;
}

std::vector<GemmPick> load_gemm_picks(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("LOOM_GEMM_PICK: cannot open " + path);
  return parse_gemm_picks(f, path);
}

int find_gemm_pick(const std::vector<GemmPick>& table, int M, int N, int K, int ta, int tb, int epilogue,
                   int batch) {
  for (const GemmPick& p : table)
    if (p.M == M && p.N == N && p.K == K && p.ta == ta && p.tb == tb && p.epilogue == epilogue && p.batch == batch)
      return p.rank;
  return -1;
}

}  // namespace loom
