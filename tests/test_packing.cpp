// test_packing.cpp: invariants of best-fit packing and of the packed-batch layout on random
// lengths, the reference's target rule (torch_ref.golden_vlm, written with doc ids), and the
// statistics line.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "data/packing.h"
#include "nn/vlm.h"
#include "tests/scratch_dir.h"

using namespace loom;

namespace {

constexpr int32_t kImg = 999, kPad = 0;

// A random sample: `ti` image tokens (when it has an image), a prompt, an answer; labels
// -100 over image and prompt, == ids over the answer.
Sample random_sample(std::mt19937& g, int len, int ti, int image_index) {
  Sample s;
  s.image = image_index;
  std::uniform_int_distribution<int> tok(1, 500);
  int img = image_index >= 0 ? std::min(ti, len) : 0;
  int prompt = std::uniform_int_distribution<int>(0, std::max(0, len - img))(g);
  for (int t = 0; t < len; t++) {
    int32_t id = t < img ? kImg : tok(g);
    s.ids.push_back(id);
    s.labels.push_back(t < img + prompt ? -100 : id);
  }
  return s;
}

}  // namespace

TEST_CASE("pack_best_fit: every sample once, no row over max_len, tight", "[packing]") {
  std::mt19937 g(1234);
  for (int trial = 0; trial < 40; trial++) {
    const int max_len = std::uniform_int_distribution<int>(1, 300)(g);
    const int n = std::uniform_int_distribution<int>(0, 400)(g);
    std::vector<int> lengths(n);
    std::lognormal_distribution<double> ln(std::log(std::max(2.0, max_len / 5.0)), 0.8);
    for (int& L : lengths) L = std::max(0, int(ln(g)));  // some 0, some > max_len
    auto rows = pack_best_fit(lengths, max_len);
    std::vector<int> seen(n, 0);
    int64_t placed_tokens = 0;
    for (const auto& r : rows) {
      REQUIRE_FALSE(r.empty());
      int used = 0;
      for (int i : r) {
        REQUIRE(i >= 0);
        REQUIRE(i < n);
        seen[i]++;
        used += lengths[i];
      }
      INFO("trial " << trial << " max_len " << max_len);
      CHECK(used <= max_len);
      placed_tokens += used;
    }
    int64_t want_tokens = 0;
    for (int i = 0; i < n; i++) {
      bool fits = lengths[i] > 0 && lengths[i] <= max_len;
      INFO("sample " << i << " length " << lengths[i] << " max_len " << max_len);
      CHECK(seen[i] == (fits ? 1 : 0));
      if (fits) want_tokens += lengths[i];
    }
    CHECK(placed_tokens == want_tokens);
    // Volume lower bound; and any-fit packing (best fit is one) leaves at most one row half
    // full or less: two such rows would have been merged.
    int64_t lb = (want_tokens + max_len - 1) / max_len;
    CHECK(int64_t(rows.size()) >= lb);
    int half_empty = 0;
    for (const auto& r : rows) {
      int used = 0;
      for (int i : r) used += lengths[i];
      half_empty += 2 * used <= max_len;
    }
    CHECK(half_empty <= 1);
  }
}

TEST_CASE("pack_best_fit: best fit picks the tightest row", "[packing]") {
  // Decreasing: 6 -> row0 (free 4), 5 -> row1 (free 5), 4 -> row0 (tightest, free 0), 3 -> row1.
  auto rows = pack_best_fit({3, 5, 4, 6}, 10);
  REQUIRE(rows.size() == 2);
  CHECK(rows[0] == std::vector<int>{3, 2});
  CHECK(rows[1] == std::vector<int>{1, 0});
  CHECK(pack_best_fit({}, 10).empty());
  CHECK_THROWS(pack_best_fit({1}, 0));
}

TEST_CASE("build_batch: layout invariants on random packs", "[packing]") {
  std::mt19937 g(99);
  for (int trial = 0; trial < 30; trial++) {
    const int row_len = std::uniform_int_distribution<int>(17, 257)(g);
    const int ti = std::uniform_int_distribution<int>(1, 16)(g);
    const int n = std::uniform_int_distribution<int>(1, 60)(g);
    std::vector<Sample> samples;
    int next_image = 0;
    for (int i = 0; i < n; i++) {
      int len = std::uniform_int_distribution<int>(1, row_len + 10)(g);  // some too long
      bool has_image = std::uniform_int_distribution<int>(0, 3)(g) != 0;
      samples.push_back(random_sample(g, len, ti, has_image ? next_image++ : -1));
    }
    for (bool packing : {true, false}) {
      PackingStats st;
      auto rows = plan_rows(samples, row_len, packing, false, &st);
      PackedBatch b = build_batch(samples, rows, row_len, kPad, kImg);
      INFO("trial " << trial << " row_len " << row_len << " packing " << packing);
      REQUIRE(b.rows == int(rows.size()));
      REQUIRE(b.ids.size() == size_t(b.rows) * row_len);
      REQUIRE(b.targets.size() == b.ids.size());
      REQUIRE(b.pos.size() == b.ids.size());
      if (!packing)
        for (const auto& r : rows) CHECK(r.size() == 1);
      int64_t too_long = 0;
      for (const Sample& s : samples) too_long += int(s.ids.size()) > row_len;
      CHECK(st.too_long == too_long);
      CHECK(st.samples == int64_t(samples.size()) - too_long);

      // Segments tile every row: cu_seqlens strictly increasing, every row boundary present.
      REQUIRE(b.cu_seqlens.front() == 0);
      REQUIRE(b.cu_seqlens.back() == b.rows * row_len);
      int max_seg = 0;
      for (size_t k = 1; k < b.cu_seqlens.size(); k++) {
        REQUIRE(b.cu_seqlens[k] > b.cu_seqlens[k - 1]);
        // no segment crosses a row boundary
        CHECK(b.cu_seqlens[k - 1] / row_len == (b.cu_seqlens[k] - 1) / row_len);
        max_seg = std::max(max_seg, b.cu_seqlens[k] - b.cu_seqlens[k - 1]);
      }
      for (int r = 1; r < b.rows; r++)
        CHECK(std::binary_search(b.cu_seqlens.begin(), b.cu_seqlens.end(), r * row_len));
      CHECK(b.max_seqlen == max_seg);

      // Walk the rows sample by sample and check every token against its sample.
      std::vector<int32_t> want_images, want_img_pos;
      int64_t real = 0, tgt = 0;
      size_t seg = 0;
      for (int r = 0; r < b.rows; r++) {
        int off = 0;
        for (int i : rows[r]) {
          const Sample& s = samples[i];
          const int L = int(s.ids.size());
          const int64_t base = int64_t(r) * row_len + off;
          // this sample is exactly one segment
          REQUIRE(b.cu_seqlens[seg] == base);
          REQUIRE(b.cu_seqlens[seg + 1] == base + L);
          seg++;
          if (s.image >= 0) want_images.push_back(s.image);
          for (int t = 0; t < L; t++) {
            CHECK(b.ids[base + t] == s.ids[t]);
            CHECK(b.pos[base + t] == t);  // positions restart
            int32_t want = (t + 1 < L && s.labels[t + 1] != -100) ? s.ids[t + 1] : -100;
            CHECK(b.targets[base + t] == want);  // never across the end (t = L-1 is -100)
            if (s.ids[t] == kImg) want_img_pos.push_back(int32_t(base + t));
            tgt += want != -100;
          }
          real += L;
          off += L;
        }
        for (int t = off; t < row_len; t++) {  // padding
          const int64_t p = int64_t(r) * row_len + t;
          CHECK(b.ids[p] == kPad);
          CHECK(b.targets[p] == -100);
          CHECK(b.pos[p] == 0);
        }
        if (off < row_len) seg++;  // the padding segment
      }
      CHECK(seg + 1 == b.cu_seqlens.size());
      CHECK(b.images == want_images);
      CHECK(b.image_positions == want_img_pos);
      CHECK(b.real_tokens == real);
      CHECK(b.target_tokens == tgt);
      CHECK(st.real_tokens == real);
      // The last token of every sample has no target: a target never crosses a boundary.
      for (size_t k = 1; k < b.cu_seqlens.size(); k++) CHECK(b.targets[b.cu_seqlens[k] - 1] == -100);
    }
  }
}

TEST_CASE("build_batch: the reference's target rule (doc ids, golden_vlm layout)", "[packing]") {
  // golden_vlm: rows of 64 tokens holding documents (30, 34) and (20, 25, 19), 16 image
  // tokens each, labels -100 over the image and 3 prompt tokens. Targets per the reference:
  //   tgt[t] = ids[t+1] if doc_id[t+1] == doc_id[t] >= 0 and labels[t+1] != -100 else -100.
  const int row = 64, ti = 16;
  std::vector<std::vector<int>> docs = {{30, 34}, {20, 25, 19}};
  std::mt19937 g(7);
  std::uniform_int_distribution<int> tok(0, 298);
  std::vector<Sample> samples;
  std::vector<std::vector<int>> rows;
  std::vector<int32_t> ids, labels, doc_id, want_cu = {0};
  int image = 0;
  for (size_t b = 0; b < docs.size(); b++) {
    rows.emplace_back();
    int o = 0;
    for (size_t j = 0; j < docs[b].size(); j++) {
      int L = docs[b][j];
      Sample s;
      s.image = image++;
      for (int t = 0; t < L; t++) {
        int32_t id = t < ti ? kImg : tok(g);
        s.ids.push_back(id);
        s.labels.push_back(t < ti + 3 ? -100 : id);
        ids.push_back(id);
        labels.push_back(s.labels.back());
        doc_id.push_back(int(j));
      }
      rows.back().push_back(int(samples.size()));
      samples.push_back(s);
      o += L;
      want_cu.push_back(int32_t(b * row + o));
    }
    REQUIRE(o == row);  // these documents fill their rows: no padding segment
  }
  PackedBatch pb = build_batch(samples, rows, row, kPad, kImg);
  CHECK(pb.cu_seqlens == want_cu);
  for (int b = 0; b < 2; b++)
    for (int t = 0; t < row; t++) {
      int p = b * row + t;
      int32_t want = -100;
      if (t + 1 < row && doc_id[p + 1] == doc_id[p] && labels[p + 1] != -100) want = ids[p + 1];
      CHECK(pb.targets[p] == want);
    }
  CHECK(pb.images == std::vector<int32_t>{0, 1, 2, 3, 4});
  CHECK(pb.image_positions.size() == size_t(5 * ti));
  CHECK(pb.max_seqlen == 34);
}

TEST_CASE("build_batch: preconditions throw", "[packing]") {
  Sample a;
  a.ids = {1, 2, 3};
  a.labels = {-100, 2, 3};
  Sample bad = a;
  bad.labels.pop_back();
  CHECK_THROWS_WITH(build_batch({{&a, &a}}, 5, kPad, kImg), Catch::Contains("over row_len 5"));
  CHECK_THROWS_WITH(build_batch({{&bad}}, 5, kPad, kImg), Catch::Contains("labels of length 3"));
  Sample img = a;
  img.ids[0] = kImg;  // image token in a sample without an image
  CHECK_THROWS_WITH(build_batch({{&img}}, 5, kPad, kImg), Catch::Contains("no image"));
  // An empty row is one padding segment.
  PackedBatch e = build_batch({{}}, 4, kPad, kImg);
  CHECK(e.cu_seqlens == std::vector<int32_t>{0, 4});
  CHECK(e.max_seqlen == 4);
}

TEST_CASE("plan_rows: too-long samples are counted, or an error in strict mode", "[packing]") {
  std::mt19937 g(5);
  std::vector<Sample> s = {random_sample(g, 10, 2, 0), random_sample(g, 40, 2, 1), random_sample(g, 20, 2, -1)};
  PackingStats st;
  auto rows = plan_rows(s, 32, true, false, &st);
  CHECK(st.too_long == 1);
  CHECK(st.samples == 2);
  CHECK(rows.size() == 1);
  CHECK_THROWS_WITH(plan_rows(s, 32, true, true), Catch::Contains("sample 1 has 40 tokens"));
}

TEST_CASE("PackingStats: the epoch log lines", "[packing]") {
  PackingStats st;
  st.samples = 10000;
  st.rows = 5500;
  st.max_len = 1000;
  st.real_tokens = 4770000;  // waste before 1 - 4.77M/10M = 52.3%, after 1 - 4.77M/5.5M = 13.3%
  CHECK(st.log_lines() ==
        "Sequence packing: 10000 \u2192 5500 sequences\nCompression: 1.82x, Padding waste: 52.3% \u2192 13.3%");
  st.too_long = 3;
  CHECK_THAT(st.log_lines(), Catch::EndsWith("Skipped 3 samples longer than 1000 tokens"));

  // On real packing the numbers follow the definitions.
  std::mt19937 g(11);
  std::vector<Sample> s;
  for (int i = 0; i < 500; i++) s.push_back(random_sample(g, std::uniform_int_distribution<int>(5, 120)(g), 4, i));
  PackingStats p, u;
  plan_rows(s, 256, true, false, &p);
  plan_rows(s, 256, false, false, &u);
  CHECK(u.rows == 500);
  CHECK(p.rows < u.rows / 2);
  CHECK(p.waste_before() == Approx(u.waste_after()));
  CHECK(p.waste_after() < 0.1);
  CHECK(p.compression() == Approx(500.0 / p.rows));
  std::printf("%s\n", p.log_lines().c_str());
}

TEST_CASE("read_row_lengths: rows as written, errors name the file and line", "[packing]") {
  std::mt19937 g(std::random_device{}());
  const std::string path = loom_test::scratch_path("rows.txt");
  auto write = [&](const std::string& text) {
    FILE* f = std::fopen(path.c_str(), "w");
    REQUIRE(f);
    std::fputs(text.c_str(), f);
    std::fclose(f);
  };
  // random rows, written with the separators and comments the format allows
  std::vector<std::vector<int>> want;
  std::string text = "# a comment line\n\n";
  const int row_len = 2048, min_len = 49;
  for (int r = 0; r < 8; r++) {
    std::vector<int> row;
    int left = row_len;
    while (left > min_len + 1 && (row.empty() || g() % 5)) {
      const int L = std::uniform_int_distribution<int>(min_len + 1, std::min(left, 700))(g);
      row.push_back(L);
      left -= L;
    }
    want.push_back(row);
    for (size_t i = 0; i < row.size(); i++) text += (i ? (g() % 2 ? ", " : "\t") : "") + std::to_string(row[i]);
    text += (g() % 2 ? "  # row " + std::to_string(r) : std::string()) + (g() % 2 ? "\r\n" : "\n");
  }
  write(text);
  CHECK(read_row_lengths(path, min_len, row_len) == want);

  auto error_of = [&](const std::string& body) -> std::string {
    write(body);
    try {
      read_row_lengths(path, min_len, row_len);
    } catch (const std::runtime_error& e) {
      return e.what();
    }
    return "no error";
  };
  using Catch::Matchers::Contains;
  CHECK_THAT(error_of("100 200\n300 x7\n"), Contains(path + ":2:") && Contains("'x7' is not a sample length"));
  CHECK_THAT(error_of("100 -5\n"), Contains(path + ":1:") && Contains("'-5'"));
  CHECK_THAT(error_of("100 1e3\n"), Contains("'1e3'"));
  CHECK_THAT(error_of("100 99999999999999999999\n"), Contains("is not a sample length"));
  CHECK_THAT(error_of("# c\n100 49\n"), Contains(path + ":2:") && Contains("longer than 49"));
  CHECK_THAT(error_of("1000 1000\n1000 1000 100\n"), Contains(path + ":2:") && Contains("2100 tokens"));
  CHECK_THAT(error_of("# nothing\n\n"), Contains("no rows"));
  std::remove(path.c_str());
  CHECK_THAT(error_of(""), Contains("no rows"));
  std::remove(path.c_str());
  try {
    read_row_lengths(path, min_len, row_len);
    FAIL("a missing file must throw");
  } catch (const std::runtime_error& e) {
    CHECK_THAT(e.what(), Contains(path) && Contains("cannot open"));
  }
}

TEST_CASE("round_batch_shapes: sequences in multiples, max_seqlen rounded up to at most the row", "[packing]") {
  std::mt19937 g(uint32_t(std::random_device{}()));
  for (int trial = 0; trial < 40; trial++) {
    const int row_len = std::uniform_int_distribution<int>(20, 300)(g);
    std::vector<Sample> samples;
    const int n = std::uniform_int_distribution<int>(1, 30)(g);
    for (int i = 0; i < n; i++) samples.push_back(random_sample(g, std::uniform_int_distribution<int>(1, row_len)(g), 4, i));
    auto rows = plan_rows(samples, row_len, true, false, nullptr);
    PackedBatch b = build_batch(samples, rows, row_len, kPad, kImg), r = b;
    const int sm = std::uniform_int_distribution<int>(1, 16)(g), lm = std::uniform_int_distribution<int>(1, 512)(g);
    round_batch_shapes(r, sm, lm);
    INFO("trial " << trial << " row_len " << row_len << " multiples " << sm << ", " << lm);
    const size_t nseq = b.cu_seqlens.size() - 1, rseq = r.cu_seqlens.size() - 1;
    CHECK(rseq % size_t(sm) == 0);
    CHECK(rseq >= nseq);
    CHECK(rseq < nseq + size_t(sm));
    for (size_t k = 0; k <= rseq; k++) CHECK(r.cu_seqlens[k] == b.cu_seqlens[std::min(k, nseq)]);
    CHECK(r.max_seqlen >= b.max_seqlen);
    CHECK(r.max_seqlen <= std::max(b.max_seqlen, row_len));
    CHECK((r.max_seqlen % lm == 0 || r.max_seqlen == row_len));
    CHECK(r.ids == b.ids);
    CHECK(r.targets == b.targets);
    CHECK(r.image_positions == b.image_positions);
  }
  PackedBatch empty;
  CHECK_THROWS_WITH(round_batch_shapes(empty, 8, 256), Catch::Matchers::Contains("cu_seqlens"));
  PackedBatch one = build_batch(std::vector<std::vector<const Sample*>>{}, 8, kPad, kImg);
  CHECK_THROWS_WITH(round_batch_shapes(one, 0, 256), Catch::Matchers::Contains("multiples 0, 256"));
}

TEST_CASE("loss_rows_of: the target rows in order, padded with rows without one", "[packing]") {
  std::mt19937 g(uint32_t(std::random_device{}()));
  for (int trial = 0; trial < 40; trial++) {
    const int n = std::uniform_int_distribution<int>(0, 400)(g);
    std::vector<int32_t> targets(static_cast<size_t>(n));
    for (auto& t : targets) t = std::uniform_int_distribution<int>(0, 2)(g) == 0 ? -100 : std::uniform_int_distribution<int>(0, 99)(g);
    const int64_t m = std::uniform_int_distribution<int>(1, 64)(g);
    std::vector<int32_t> rows{-7}, kept{-7}, plain_rows, plain_kept;  // poisoned: must be replaced
    loss_rows_of(targets, rows, kept, m);
    loss_rows_of(targets, plain_rows, plain_kept);
    INFO("trial " << trial << " n " << n << " multiple " << m);
    int64_t with = 0;
    for (int32_t t : targets) with += t >= 0;
    REQUIRE(int64_t(plain_rows.size()) == with);
    REQUIRE(rows.size() == kept.size());
    CHECK(int64_t(rows.size()) == std::min<int64_t>(n, (with + m - 1) / m * m));
    for (size_t i = 1; i < rows.size(); i++) CHECK(rows[i] > rows[i - 1]);  // ascending, distinct
    size_t j = 0;
    for (size_t i = 0; i < rows.size(); i++) {
      REQUIRE(rows[i] >= 0);
      REQUIRE(rows[i] < n);
      const int32_t t = targets[size_t(rows[i])];
      CHECK(kept[i] == (t >= 0 ? t : -1));
      if (t >= 0) CHECK(rows[i] == plain_rows[j++]);  // every target row, in order
    }
    CHECK(j == plain_rows.size());
  }
}
