// packing.cpp: best-fit-decreasing packing and the packed-batch layout (see packing.h).
#include "data/packing.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <set>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace loom {

std::vector<std::vector<int>> pack_best_fit(const std::vector<int>& lengths, int max_len) {
  if (max_len <= 0) throw std::runtime_error("pack_best_fit: max_len must be > 0, got " + std::to_string(max_len));
  std::vector<int> order(lengths.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return lengths[a] > lengths[b]; });
  std::vector<std::vector<int>> rows;
  // Open rows keyed by (free tokens, row index): lower_bound({L, 0}) is the tightest fit,
  // the oldest row among equals. O(n log n) overall.
  std::set<std::pair<int, int>> open;
  for (int i : order) {
    const int L = lengths[i];
    if (L <= 0 || L > max_len) continue;
    auto it = open.lower_bound({L, 0});
    if (it == open.end()) {
      rows.push_back({i});
      if (max_len - L > 0) open.insert({max_len - L, int(rows.size()) - 1});
    } else {
      auto [free, r] = *it;
      open.erase(it);
      rows[r].push_back(i);
      if (free - L > 0) open.insert({free - L, r});
    }
  }
  return rows;
}

PackedBatch build_batch(const std::vector<std::vector<const Sample*>>& rows, int row_len, int32_t pad_id,
                        int32_t image_token) {
  if (row_len <= 0) throw std::runtime_error("build_batch: row_len must be > 0, got " + std::to_string(row_len));
  PackedBatch b;
  b.rows = int(rows.size());
  b.row_len = row_len;
  const size_t n = size_t(b.rows) * row_len;
  b.ids.assign(n, pad_id);
  b.targets.assign(n, -100);
  b.pos.assign(n, 0);
  b.cu_seqlens.push_back(0);
  for (int r = 0; r < b.rows; r++) {
    const int64_t base = int64_t(r) * row_len;
    int off = 0;
    for (size_t k = 0; k < rows[r].size(); k++) {
      const Sample& s = *rows[r][k];
      const int L = int(s.ids.size());
      if (s.labels.size() != s.ids.size())
        throw std::runtime_error("build_batch: row " + std::to_string(r) + " sample " + std::to_string(k) +
                                 ": expected labels of length " + std::to_string(L) + ", got " +
                                 std::to_string(s.labels.size()));
      if (L == 0) continue;
      if (off + L > row_len)
        throw std::runtime_error("build_batch: row " + std::to_string(r) + " holds " + std::to_string(off + L) +
                                 "+ tokens, over row_len " + std::to_string(row_len));
      if (s.image >= 0) b.images.push_back(s.image);
      for (int t = 0; t < L; t++) {
        const int64_t p = base + off + t;
        b.ids[p] = s.ids[t];
        b.pos[p] = t;  // positions restart in every sample
        // Next-token target, never across the sample's end.
        if (t + 1 < L && s.labels[t + 1] != -100) {
          b.targets[p] = s.ids[t + 1];
          b.target_tokens++;
        }
        if (s.ids[t] == image_token) {
          if (s.image < 0)
            throw std::runtime_error("build_batch: row " + std::to_string(r) + " sample " + std::to_string(k) +
                                     " has no image but holds the image token at position " + std::to_string(t));
          b.image_positions.push_back(int32_t(p));
        }
      }
      off += L;
      b.real_tokens += L;
      b.cu_seqlens.push_back(int32_t(base + off));
      b.max_seqlen = std::max(b.max_seqlen, L);
    }
    if (off < row_len) {  // the padding run: its own segment
      b.cu_seqlens.push_back(int32_t(base + row_len));
      b.max_seqlen = std::max(b.max_seqlen, row_len - off);
    }
  }
  return b;
}

void round_batch_shapes(PackedBatch& b, int seq_multiple, int len_multiple) {
  if (seq_multiple < 1 || len_multiple < 1 || b.cu_seqlens.empty())
    throw std::runtime_error("round_batch_shapes: multiples " + std::to_string(seq_multiple) + ", " +
                             std::to_string(len_multiple) + " (>= 1) of a batch with " +
                             std::to_string(b.cu_seqlens.size()) + " cu_seqlens entries");
  const size_t nseq = b.cu_seqlens.size() - 1;
  const size_t want = (nseq + size_t(seq_multiple) - 1) / size_t(seq_multiple) * size_t(seq_multiple);
  b.cu_seqlens.resize(std::max<size_t>(want, 1) + 1, b.cu_seqlens.back());
  const int up = (b.max_seqlen + len_multiple - 1) / len_multiple * len_multiple;
  b.max_seqlen = std::max(b.max_seqlen, b.row_len > 0 ? std::min(up, b.row_len) : up);
}

PackedBatch build_batch(const std::vector<Sample>& samples, const std::vector<std::vector<int>>& rows, int row_len,
                        int32_t pad_id, int32_t image_token) {
  std::vector<std::vector<const Sample*>> ptrs(rows.size());
  for (size_t r = 0; r < rows.size(); r++)
    for (int i : rows[r]) {
      if (i < 0 || size_t(i) >= samples.size())
        throw std::runtime_error("build_batch: sample index " + std::to_string(i) + " out of range [0, " +
                                 std::to_string(samples.size()) + ")");
      ptrs[r].push_back(&samples[i]);
    }
  return build_batch(ptrs, row_len, pad_id, image_token);
}

std::vector<std::vector<int>> read_row_lengths(const std::string& path, int min_len, int row_len) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(path + ": cannot open the file of packed rows");
  std::ostringstream text;
  text << f.rdbuf();
  if (f.bad()) throw std::runtime_error(path + ": read error");
  return parse_row_lengths(text.str(), path, min_len, row_len);
}

std::vector<std::vector<int>> parse_row_lengths(const std::string& text, const std::string& path, int min_len,
                                                int row_len) {
  std::istringstream f(text);
  auto shown = [](const std::string& field) {  // a field as the errors quote it: at most 40 bytes
    return field.size() <= 40 ? field : field.substr(0, 37) + "...";
  };
  std::vector<std::vector<int>> rows;
  std::string line;
  for (int ln = 1; std::getline(f, line); ln++) {
    const std::string where = path + ":" + std::to_string(ln) + ": ";
    line = line.substr(0, line.find('#'));
    for (char& c : line)
      if (c == ',' || c == '\t' || c == '\r') c = ' ';
    std::istringstream in(line);
    std::vector<int> row;
    int64_t total = 0;
    for (std::string field; in >> field;) {
      size_t used = 0;
      long long v = 0;
      try {
        v = std::stoll(field, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != field.size() || field[0] == '+' || field[0] == '-' || v > row_len)
        throw std::runtime_error(where + "'" + shown(field) + "' is not a sample length (a whole number of tokens up to " +
                                 std::to_string(row_len) + ")");
      if (v <= min_len)
        throw std::runtime_error(where + "a sample of " + shown(field) + " tokens: samples here must be longer than " +
                                 std::to_string(min_len));
      total += v;
      row.push_back(int(v));
    }
    if (total > row_len)
      throw std::runtime_error(where + "the row's samples hold " + std::to_string(total) + " tokens, more than a row's " +
                               std::to_string(row_len));
    if (!row.empty()) rows.push_back(std::move(row));
  }
  if (rows.empty()) throw std::runtime_error(path + ": no rows (one row a line, its sample lengths in tokens)");
  return rows;
}

std::string PackingStats::log_lines() const {
  char buf[256];
  std::snprintf(buf, sizeof buf, "Sequence packing: %lld \u2192 %lld sequences\nCompression: %.2fx, Padding waste: %.1f%% \u2192 %.1f%%",
                (long long)samples, (long long)rows, compression(), 100.0 * waste_before(), 100.0 * waste_after());
  std::string s = buf;
  if (too_long > 0) s += "\nSkipped " + std::to_string(too_long) + " samples longer than " + std::to_string(max_len) + " tokens";
  return s;
}

std::vector<std::vector<int>> plan_rows(const std::vector<Sample>& samples, int row_len, bool packing, bool strict,
                                        PackingStats* stats) {
  if (row_len <= 0) throw std::runtime_error("plan_rows: row_len must be > 0, got " + std::to_string(row_len));
  std::vector<int> lengths(samples.size());
  PackingStats st;
  st.max_len = row_len;
  for (size_t i = 0; i < samples.size(); i++) {
    lengths[i] = int(samples[i].ids.size());
    if (lengths[i] > row_len) {
      if (strict)
        throw std::runtime_error("sample " + std::to_string(i) + " has " + std::to_string(lengths[i]) +
                                 " tokens, more than data.pack_max_length = " + std::to_string(row_len));
      st.too_long++;
    }
  }
  std::vector<std::vector<int>> rows;
  if (packing) {
    rows = pack_best_fit(lengths, row_len);
  } else {
    for (size_t i = 0; i < samples.size(); i++)
      if (lengths[i] > 0 && lengths[i] <= row_len) rows.push_back({int(i)});
  }
  st.rows = int64_t(rows.size());
  for (const auto& r : rows)
    for (int i : r) {
      st.samples++;
      st.real_tokens += lengths[i];
    }
  if (stats) *stats = st;
  return rows;
}

}  // namespace loom
