// test_data.cpp: the shapes dataset (determinism, answerability, rendering, balance and
// majority baselines), Fashion-MNIST IDX reading, PNG/JPEG decoding and resize, image
// folders, and LLaVA JSONL validation (each bad case counted; strict mode throws file:line).
#include <catch2/catch.hpp>

#include <unistd.h>
#include <zlib.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <string>
#include <vector>

#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb_image_write.h>

#include "data/fashion_mnist.h"
#include "data/images.h"
#include "data/jsonl.h"
#include "data/shapes.h"
#include "tests/scratch_dir.h"
#include "tests/tolerances.h"

using namespace loom;
namespace fs = std::filesystem;

namespace {

std::string tmp_dir() { return loom_test::scratch_root(); }

// Random 8-bit HWC pixels, seeded.
std::vector<unsigned char> random_pixels(int w, int h, int c, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<unsigned char> px(size_t(w) * h * c);
  for (auto& v : px) v = (unsigned char)(g() & 255);
  return px;
}

void write_png(const std::string& path, int w, int h, int c, uint32_t seed) {
  fs::create_directories(fs::path(path).parent_path());
  auto px = random_pixels(w, h, c, seed);
  REQUIRE(stbi_write_png(path.c_str(), w, h, c, px.data(), w * c) != 0);
}

void write_text(const std::string& path, const std::string& text) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

float norm(unsigned char v) { return (v / 255.0f - 0.5f) / 0.5f; }

}  // namespace

// ---------------------------------------------------------------------------- shapes
TEST_CASE("shapes: deterministic from the seed, sample i independent of n", "[data][shapes]") {
  auto a = make_shapes_dataset(40, 32, 7);
  auto b = make_shapes_dataset(40, 32, 7);
  auto c = make_shapes_dataset(40, 32, 8);
  auto d = make_shapes_dataset(13, 32, 7);
  REQUIRE(a.size() == 40);
  int differ = 0;
  for (size_t i = 0; i < a.size(); i++) {
    CHECK(a[i].image == b[i].image);
    CHECK(a[i].question == b[i].question);
    CHECK(a[i].answer == b[i].answer);
    differ += a[i].image != c[i].image || a[i].question != c[i].question;
    if (i < d.size()) CHECK(a[i].image == d[i].image);
  }
  CHECK(differ > 30);  // another seed gives other samples
  for (const auto& s : a) {
    REQUIRE(s.image.size() == size_t(3 * 32 * 32));
    for (float v : s.image) REQUIRE((v >= -1.0f && v <= 1.0f));
  }
}

TEST_CASE("shapes: every question is answerable and the image shows the scene", "[data][shapes]") {
  for (int S : {8, 32, 33, 64}) {
    auto ds = make_shapes_dataset(400, S, 3);
    std::set<std::string> qtypes;
    for (size_t i = 0; i < ds.size(); i++) {
      const VQASample& s = ds[i];
      INFO("S " << S << " sample " << i << ": " << s.question << " -> " << s.answer);
      qtypes.insert(s.qtype);
      REQUIRE(s.objects.size() >= 1);
      REQUIRE(s.objects.size() <= 4);
      std::set<int> quads;
      for (const auto& o : s.objects) quads.insert(o.quadrant);
      CHECK(quads.size() == s.objects.size());  // one shape per quadrant
      // The answer follows from the question and the scene alone (unique referent).
      CHECK(answer_shapes_question(s.objects, s.question) == s.answer);
      // Answers are one or two words.
      CHECK(std::count(s.answer.begin(), s.answer.end(), ' ') <= 1);
      // Quadrant centres show the shape's colour, empty quadrants the background.
      for (int q = 0; q < 4; q++) {
        int cx = (q % 2) * S / 2 + S / 4, cy = (q / 2) * S / 2 + S / 4;
        float want[3];
        shapes_background_rgb(want);
        for (const auto& o : s.objects)
          if (o.quadrant == q) shapes_colour_rgb(o.colour, want);
        for (int c = 0; c < 3; c++)
          CHECK(s.image[(size_t(c) * S + cy) * S + cx] == Approx((want[c] - 0.5f) / 0.5f));
      }
    }
    CHECK(qtypes == std::set<std::string>{"colour", "shape", "count", "position"});
  }
  // Questions without a unique referent get "".
  std::vector<ShapeObject> two_squares = {{1, 0, 0}, {1, 2, 3}};
  CHECK(answer_shapes_question(two_squares, "What colour is the square?") == "");
  CHECK(answer_shapes_question(two_squares, "What colour is the circle?") == "");
  CHECK(answer_shapes_question(two_squares, "Where is the blue square?") == "bottom right");
  CHECK(answer_shapes_question(two_squares, "How many shapes are there?") == "two");
  CHECK_THROWS(make_shapes_dataset(1, 4, 0));
}

// Reads a caption back into its objects: words, a phrase = count colour shape(s) "in the"
// quadrant ("and" quadrant)*; phrases joined by "," / "and". Unambiguous because quadrants
// start with top/bottom and phrases with a/two/three/four. Fails the test on anything else.
static std::multiset<std::tuple<int, int, int>> parse_caption(const std::string& caption) {
  std::vector<std::string> w;
  std::string cur;
  for (char ch : caption + " ") {
    if (ch == ' ' || ch == ',') {
      if (!cur.empty()) w.push_back(cur);
      cur.clear();
    } else {
      cur += ch;
    }
  }
  auto idx = [](const std::vector<std::string>& v, const std::string& x) {
    return int(std::find(v.begin(), v.end(), x) - v.begin());
  };
  const std::vector<std::string> counts = {"a", "two", "three", "four"};
  std::multiset<std::tuple<int, int, int>> out;
  size_t i = 0;
  while (i < w.size()) {
    if (!out.empty() && w[i] == "and") i++;  // the last join; "," was dropped with the spaces
    REQUIRE(i + 4 < w.size());
    const int n = idx(counts, w[i]) + 1;
    REQUIRE(n <= 4);
    const int colour = idx(shapes_colour_names(), w[i + 1]);
    std::string shape = w[i + 2];
    if (n > 1) {
      REQUIRE(shape.back() == 's');
      shape.pop_back();
    }
    const int sh = idx(shapes_shape_names(), shape);
    REQUIRE(colour < 5);
    REQUIRE(sh < 3);
    REQUIRE(w[i + 3] == "in");
    REQUIRE(w[i + 4] == "the");
    i += 5;
    for (int k = 0; k < n; k++) {
      if (k > 0 && i < w.size() && w[i] == "and") i++;
      REQUIRE(i + 1 < w.size());
      const int q = idx(shapes_quadrant_names(), w[i] + " " + w[i + 1]);
      REQUIRE(q < 4);
      out.insert({sh, colour, q});
      i += 2;
    }
  }
  return out;
}

TEST_CASE("shapes: the caption names every object once, in quadrant order", "[data][shapes]") {
  // hand-made scenes, the exact text
  CHECK(shapes_caption({{0, 0, 0}}) == "a red circle in the top left");
  CHECK(shapes_caption({{1, 2, 3}, {0, 0, 0}, {1, 2, 1}}) ==
        "a red circle in the top left and two blue squares in the top right and bottom right");
  CHECK(shapes_caption({{2, 4, 3}, {0, 1, 2}, {1, 3, 1}, {0, 0, 0}}) ==
        "a red circle in the top left, a yellow square in the top right, a green circle in the bottom left and "
        "a white triangle in the bottom right");
  CHECK(shapes_caption({{2, 3, 0}, {2, 3, 1}, {2, 3, 2}, {2, 3, 3}}) ==
        "four yellow triangles in the top left, top right, bottom left and bottom right");
  CHECK(shapes_caption({}) == "nothing");
  CHECK_THROWS(shapes_caption({{0, 0, 0}, {0, 0, 1}, {0, 0, 2}, {0, 0, 3}, {0, 0, 0}}));
  CHECK_THROWS(shapes_caption({{3, 0, 0}}));
  // every generated scene: the caption reads back into exactly its objects
  std::set<std::string> corpus;
  for (auto& t : shapes_corpus()) corpus.insert(t);
  CHECK(corpus.count(shapes_caption_prompt()) == 1);
  std::set<std::string> distinct;
  for (const auto& s : make_shapes_dataset(3000, 8, 11)) {
    std::string c = shapes_caption(s.objects);
    INFO(c);
    std::multiset<std::tuple<int, int, int>> want;
    for (const auto& o : s.objects) want.insert({o.shape, o.colour, o.quadrant});
    CHECK(parse_caption(c) == want);
    distinct.insert(c);
  }
  CHECK(distinct.size() > 1500);  // captions carry the scene, not a template
}

TEST_CASE("shapes: shapes are told apart by their pixels", "[data][shapes]") {
  // Same colour and quadrant, three shapes: three different images, area circle/square/triangle ordered.
  const int S = 32;
  std::vector<int> area;
  std::vector<std::vector<float>> imgs;
  for (int shape = 0; shape < 3; shape++) {
    imgs.push_back(render_shapes({{shape, 0, 0}}, S));
    int a = 0;
    for (int i = 0; i < S * S; i++) a += imgs.back()[i] > 0.5f;  // red channel lit
    area.push_back(a);
  }
  CHECK(imgs[0] != imgs[1]);
  CHECK(imgs[1] != imgs[2]);
  CHECK(imgs[0] != imgs[2]);
  // cell 16: circle r 5.76 (~104 px), square side 10.24 (~100), triangle ~ half of 12x10.6 (~64)
  CHECK(area[0] > 80);
  CHECK(area[1] > 80);
  CHECK(area[2] > 40);
  CHECK(area[2] < area[1]);
}

TEST_CASE("shapes: answers are balanced; majority baselines", "[data][shapes]") {
  auto ds = make_shapes_dataset(8000, 16, 11);
  std::map<std::string, std::map<std::string, int>> counts;
  for (const auto& s : ds) counts[s.qtype][s.answer]++;
  const std::map<std::string, int> values = {{"colour", 5}, {"shape", 3}, {"count", 4}, {"position", 4}};
  for (const auto& [qt, k] : values) {
    INFO(qt);
    REQUIRE(counts[qt].size() == size_t(k));
    for (const auto& [ans, c] : counts[qt]) {
      INFO(ans << " " << c);
      CHECK(std::abs(double(c) / 2000.0 - 1.0 / k) < 0.035);  // 2000 per type, ~4 sigma
    }
  }
  auto mb = majority_baseline(ds);
  REQUIRE(mb.size() == 5);
  std::printf("%s", format_majority_baseline(mb).c_str());
  for (const auto& b : mb) {
    if (b.qtype == "all") {
      CHECK(b.count == 8000);
      CHECK(b.accuracy < 0.32);
      continue;
    }
    INFO(b.qtype);
    CHECK(b.count == 2000);
    CHECK(b.accuracy == Approx(1.0 / values.at(b.qtype)).margin(0.035));
    CHECK(counts[b.qtype][b.answer] == b.correct);
  }
  // A hand-made set: 3 colour questions (2 red), 1 count question.
  std::vector<VQASample> hand(4);
  hand[0].qtype = hand[1].qtype = hand[2].qtype = "colour";
  hand[0].answer = "red", hand[1].answer = "blue", hand[2].answer = "red";
  hand[3].qtype = "count", hand[3].answer = "two";
  auto hb = majority_baseline(hand);
  REQUIRE(hb.size() == 3);
  CHECK(hb[0].qtype == "colour");
  CHECK(hb[0].answer == "red");
  CHECK(hb[0].accuracy == Approx(2.0 / 3.0));
  CHECK(hb[1].accuracy == 1.0);
  CHECK(hb[2].qtype == "all");
  CHECK(hb[2].accuracy == Approx(0.75));
}

TEST_CASE("shapes: the corpus holds every question and answer", "[data][shapes]") {
  auto corpus = shapes_corpus();
  std::set<std::string> all(corpus.begin(), corpus.end());
  for (const auto& s : make_shapes_dataset(2000, 8, 5)) {
    CHECK(all.count(s.question) == 1);
    CHECK(all.count(s.answer) == 1);
  }
  CHECK(shapes_corpus(make_shapes_dataset(3, 8, 5)).size() == 6);
}

// ---------------------------------------------------------------------------- Fashion-MNIST
TEST_CASE("fashion-mnist: loads 60000/10000 with labels 0..9", "[data][fmnist]") {
  const std::string dir = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(dir + "/train-images-idx3-ubyte.gz")) {
    WARN("Fashion-MNIST not installed (Debian package dataset-fashion-mnist): skipping the full load");
    return;
  }
  for (auto [split, n] : {std::pair<std::string, int>{"train", 60000}, {"test", 10000}}) {
    ImageSet s = load_fashion_mnist(split, dir);
    INFO(split);
    CHECK(s.n == n);
    CHECK(s.c == 1);
    CHECK(s.h == 28);
    CHECK(s.w == 28);
    REQUIRE(s.pixels.size() == size_t(n) * 784);
    REQUIRE(s.labels.size() == size_t(n));
    std::vector<int> per(10, 0);
    for (int32_t l : s.labels) {
      REQUIRE((l >= 0 && l <= 9));
      per[l]++;
    }
    for (int c = 0; c < 10; c++) CHECK(per[c] == n / 10);  // Fashion-MNIST is exactly balanced
    float lo = 1e9f, hi = -1e9f;
    double mean = 0;
    for (float v : s.pixels) lo = std::min(lo, v), hi = std::max(hi, v), mean += v;
    CHECK(lo == -1.0f);
    CHECK(hi == 1.0f);
    mean /= double(s.pixels.size());
    CHECK(mean > -0.6);  // raw mean is ~0.286 -> ~-0.43 normalized
    CHECK(mean < -0.3);
  }
  ImageSet few = load_fashion_mnist("test", dir, 17);
  CHECK(few.n == 17);
  CHECK(few.pixels.size() == size_t(17 * 784));
  CHECK_THROWS_WITH(load_fashion_mnist("val", dir), Catch::Contains("train or test"));
}

TEST_CASE("fashion-mnist: errors name the file (and the package when missing)", "[data][fmnist]") {
  std::string d = tmp_dir() + "/fmnist";
  fs::create_directories(d);
  CHECK_THROWS_WITH(load_fashion_mnist("train", d),
                    Catch::Contains("dataset-fashion-mnist") && Catch::Contains(d + "/train-images-idx3-ubyte.gz"));
  // A tiny valid pair (3 images of 2x2), written gzip-compressed, then a bad magic.
  auto write_gz = [](const std::string& p, const std::vector<unsigned char>& bytes) {
    gzFile f = gzopen(p.c_str(), "wb");
    REQUIRE(f);
    gzwrite(f, bytes.data(), unsigned(bytes.size()));
    gzclose(f);
  };
  std::vector<unsigned char> img = {0, 0, 8, 3, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 2};
  for (int i = 0; i < 12; i++) img.push_back((unsigned char)(i * 20));
  std::vector<unsigned char> lab = {0, 0, 8, 1, 0, 0, 0, 3, 4, 0, 9};
  write_gz(d + "/t10k-images-idx3-ubyte.gz", img);
  write_gz(d + "/t10k-labels-idx1-ubyte.gz", lab);
  ImageSet s = load_fashion_mnist("test", d);
  CHECK(s.n == 3);
  CHECK(s.h == 2);
  CHECK(s.labels == std::vector<int32_t>{4, 0, 9});
  CHECK(s.pixels[5] == Approx(norm(100)));
  // Bad magic.
  auto bad = img;
  bad[3] = 1;
  write_gz(d + "/t10k-images-idx3-ubyte.gz", bad);
  CHECK_THROWS_WITH(load_fashion_mnist("test", d),
                    Catch::Contains(d + "/t10k-images-idx3-ubyte.gz") && Catch::Contains("bad magic"));
  // Truncated data.
  auto shortimg = img;
  shortimg.resize(shortimg.size() - 3);
  write_gz(d + "/t10k-images-idx3-ubyte.gz", shortimg);
  CHECK_THROWS_WITH(load_fashion_mnist("test", d), Catch::Contains("truncated"));
  // Counts that disagree.
  write_gz(d + "/t10k-images-idx3-ubyte.gz", img);
  auto lab2 = lab;
  lab2[7] = 2;
  lab2.pop_back();
  write_gz(d + "/t10k-labels-idx1-ubyte.gz", lab2);
  CHECK_THROWS_WITH(load_fashion_mnist("test", d), Catch::Contains("3 images but"));
}

// ---------------------------------------------------------------------------- images
TEST_CASE("images: PNG round trip, same size and 2x down", "[data][images]") {
  const int W = 16;
  std::string p = tmp_dir() + "/img/rgb16.png";
  write_png(p, W, W, 3, 42);
  auto px = random_pixels(W, W, 3, 42);
  std::vector<float> out(3 * W * W, NAN);
  std::string err;
  REQUIRE(load_image_chw(p, W, 3, out, &err) == ImageStatus::Ok);
  std::vector<float> want(3 * W * W);
  for (int c = 0; c < 3; c++)
    for (int y = 0; y < W; y++)
      for (int x = 0; x < W; x++) want[(c * W + y) * W + x] = norm(px[(y * W + x) * 3 + c]);
  LOOM_CHECK_CLOSE(tol::compare(out, want, tol::kImageF32, "png same size"));

  // Half size with half-pixel centres: each output is the mean of a 2x2 block.
  const int H = W / 2;
  std::vector<float> half(3 * H * H, NAN), want_half(3 * H * H);
  REQUIRE(load_image_chw(p, H, 3, half) == ImageStatus::Ok);
  for (int c = 0; c < 3; c++)
    for (int y = 0; y < H; y++)
      for (int x = 0; x < H; x++) {
        float s = 0;
        for (int dy = 0; dy < 2; dy++)
          for (int dx = 0; dx < 2; dx++) s += px[((2 * y + dy) * W + 2 * x + dx) * 3 + c] / 255.0f;
        want_half[(c * H + y) * H + x] = (s / 4 - 0.5f) / 0.5f;
      }
  LOOM_CHECK_CLOSE(tol::compare(half, want_half, tol::kImageF32, "png 2x down"));

  // Grey PNG asked for as RGB: three equal channels; non-square upscale stays in range.
  std::string g = tmp_dir() + "/img/grey.png";
  write_png(g, 7, 5, 1, 3);
  std::vector<float> rgb;
  REQUIRE(load_image_chw(g, 11, 3, rgb) == ImageStatus::Ok);
  REQUIRE(rgb.size() == size_t(3 * 11 * 11));
  for (int i = 0; i < 121; i++) {
    CHECK(rgb[i] == rgb[121 + i]);
    CHECK(rgb[i] == rgb[242 + i]);
    CHECK((rgb[i] >= -1.0f && rgb[i] <= 1.0f));
  }
  // Corners of an upscale are the corner pixels (the clamp at 0 / w-1).
  auto gp = random_pixels(7, 5, 1, 3);
  CHECK(rgb[0] == Approx(norm(gp[0])).margin(1e-6));
  CHECK(rgb[120] == Approx(norm(gp[34])).margin(1e-6));
}

TEST_CASE("images: JPEG decodes close to its source", "[data][images]") {
  const int W = 24;
  // Smooth content (JPEG is poor on noise): a gradient per channel.
  std::vector<unsigned char> px(W * W * 3);
  for (int y = 0; y < W; y++)
    for (int x = 0; x < W; x++)
      for (int c = 0; c < 3; c++) px[(y * W + x) * 3 + c] = (unsigned char)((x * 9 + y * 3 + c * 40) % 256 / 2 + 40);
  std::string p = tmp_dir() + "/img/grad.JPG";
  REQUIRE(stbi_write_jpg(p.c_str(), W, W, 3, px.data(), 100) != 0);
  std::vector<float> out(3 * W * W, NAN), want(3 * W * W);
  REQUIRE(load_image_chw(p, W, 3, out) == ImageStatus::Ok);
  for (int c = 0; c < 3; c++)
    for (int i = 0; i < W * W; i++) want[c * W * W + i] = norm(px[i * 3 + c]);
  LOOM_CHECK_CLOSE(tol::compare(out, want, tol::kJpegQ100, "jpeg q100"));
}

TEST_CASE("images: failures are statuses, not crashes", "[data][images]") {
  std::vector<float> out;
  std::string err;
  CHECK(load_image_chw(tmp_dir() + "/img/none.png", 8, 3, out, &err) == ImageStatus::Missing);
  CHECK(err.find("none.png") != std::string::npos);
  std::string junk = tmp_dir() + "/img/junk.png";
  write_text(junk, "this is not an image at all, just text");
  CHECK(load_image_chw(junk, 8, 3, out, &err) == ImageStatus::DecodeError);
  // A valid header with the data cut off.
  std::string full = tmp_dir() + "/img/full.png";
  write_png(full, 20, 20, 3, 9);
  std::ifstream in(full, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string cut = tmp_dir() + "/img/cut.png";
  write_text(cut, bytes.substr(0, bytes.size() / 2));
  CHECK(load_image_chw(cut, 8, 3, out, &err) == ImageStatus::DecodeError);
  // Over the pixel limit (from the header, no decode).
  CHECK(load_image_chw(full, 8, 3, out, &err, 399) == ImageStatus::TooLarge);
  CHECK(err.find("20x20") != std::string::npos);
  CHECK(load_image_chw(full, 8, 3, out, &err, 400) == ImageStatus::Ok);
  CHECK(std::string(to_string(ImageStatus::DecodeError)) == "corrupt_image");
}

TEST_CASE("images: folder listing and labelled image folders", "[data][images]") {
  std::string d = tmp_dir() + "/folder";
  write_png(d + "/b_cat/2.png", 6, 6, 3, 1);
  write_png(d + "/b_cat/1.PNG", 6, 6, 3, 2);
  write_png(d + "/a_dog/x/deep.png", 9, 4, 3, 3);
  write_text(d + "/a_dog/broken.jpg", "not a jpeg");
  write_text(d + "/a_dog/readme.txt", "ignored");
  write_png(d + "/top.png", 5, 5, 1, 4);
  auto files = list_images(d);
  std::vector<std::string> want = {d + "/a_dog/broken.jpg", d + "/a_dog/x/deep.png", d + "/b_cat/1.PNG",
                                   d + "/b_cat/2.png", d + "/top.png"};
  CHECK(files == want);
  DataStats st;
  ImageSet s = load_image_folder(d, 8, 3, &st);
  CHECK(s.n == 4);
  CHECK(s.pixels.size() == size_t(4 * 3 * 64));
  CHECK(s.class_names == std::vector<std::string>{"a_dog", "b_cat"});
  CHECK(s.labels == std::vector<int32_t>{0, 1, 1, -1});
  CHECK(st.ok == 4);
  CHECK(st.count("corrupt_image") == 1);
  CHECK(st.summary().find("broken.jpg") != std::string::npos);
  CHECK_THROWS_WITH(list_images(d + "/nope"), Catch::Contains("not a directory"));
}

// ---------------------------------------------------------------------------- JSONL
TEST_CASE("jsonl: every bad case is counted by reason; strict mode names file:line", "[data][jsonl]") {
  std::string d = tmp_dir() + "/jsonl";
  write_png(d + "/imgs/a.png", 12, 12, 3, 10);
  write_png(d + "/imgs/b.png", 10, 14, 3, 11);
  write_png(d + "/imgs/huge.png", 64, 64, 3, 12);
  write_text(d + "/imgs/corrupt.png", "\x89PNG\r\n\x1a\n garbage");
  const std::string good_conv =
      R"([{"from":"human","value":"<image>\nWhat colour?"},{"from":"gpt","value":"red"},)"
      R"({"from":"human","value":"And the shape?"},{"from":"gpt","value":"circle"}])";
  std::vector<std::string> lines = {
      R"({"image":"imgs/a.png","conversations":)" + good_conv + "}",                       // 1 ok
      R"({"image":"imgs/a.png","conversations":[{"from":"human","value":"<image> hi"})",  // 2 bad_json
      R"({"image":"imgs/missing.png","conversations":)" + good_conv + "}",                // 3 missing_image
      R"({"image":"imgs/corrupt.png","conversations":)" + good_conv + "}",                // 4 corrupt_image
      R"({"image":"imgs/a.png","conversations":[{"from":"human","value":"no tag"},{"from":"gpt","value":"x"}]})",  // 5
      R"({"image":"imgs/a.png","conversations":[{"from":"human","value":"<image><image>"},{"from":"gpt","value":"x"}]})",  // 6
      R"({"image":"imgs/a.png","conversations":[{"from":"human","value":"<image>"},{"from":"human","value":"x"}]})",  // 7
      "",                                                                                  // 8 blank: ignored
      R"({"image":"imgs/b.png","conversations":[{"from":"human","value":"<image>\nQ"},{"from":"gpt","value":"A"}]})",  // 9 ok
      R"({"conversations":[{"from":"human","value":"<image>"},{"from":"gpt","value":"x"}]})",  // 10 bad_schema
      R"({"image":"imgs/a.png","conversations":[{"from":"human","value":"<image>"}]})",      // 11 bad_roles (no answer)
      R"({"image":"imgs/huge.png","conversations":)" + good_conv + "}",                   // 12 image_too_large
      R"({"image":"imgs/a.png","conversations":[{"from":"gpt","value":"<image>"},{"from":"human","value":"x"}]})",  // 13 bad_roles
  };
  std::string text;
  for (const auto& l : lines) text += l + "\n";
  std::string path = d + "/train.jsonl";
  write_text(path, text);

  JsonlOptions opt;
  opt.image_size = 8;
  opt.max_pixels = 1000;  // huge.png is 64x64 = 4096
  DataStats st;
  auto samples = load_llava_jsonl(path, opt, &st);
  INFO(st.summary());
  REQUIRE(samples.size() == 2);
  CHECK(st.ok == 2);
  CHECK(st.count("bad_json") == 1);
  CHECK(st.count("missing_image") == 1);
  CHECK(st.count("corrupt_image") == 1);
  CHECK(st.count("no_image_tag") == 1);
  CHECK(st.count("multiple_image_tags") == 1);
  CHECK(st.count("bad_roles") == 3);
  CHECK(st.count("bad_schema") == 1);
  CHECK(st.count("image_too_large") == 1);
  CHECK(st.total_skipped() == 10);
  CHECK(st.summary().find("2 samples ok, 10 skipped") == 0);

  CHECK(samples[0].line == 1);
  CHECK(samples[1].line == 9);
  CHECK(samples[0].image_path == d + "/imgs/a.png");  // relative to the JSONL's folder
  REQUIRE(samples[0].turns.size() == 4);
  CHECK(samples[0].turns[0].from == "human");
  CHECK(samples[0].turns[0].value == "<image>\nWhat colour?");
  CHECK(samples[0].turns[3].value == "circle");
  REQUIRE(samples[1].image.size() == size_t(3 * 8 * 8));
  std::vector<float> direct;
  REQUIRE(load_image_chw(d + "/imgs/b.png", 8, 3, direct) == ImageStatus::Ok);
  CHECK(samples[1].image == direct);

  // Header-only mode: no pixels, same verdicts.
  JsonlOptions probe = opt;
  probe.image_size = 0;
  DataStats st2;
  auto s2 = load_llava_jsonl(path, probe, &st2);
  CHECK(s2.size() == 2);
  CHECK(s2[0].image.empty());
  CHECK(st2.total_skipped() == 10);
  CHECK(st2.count("corrupt_image") == 1);

  // limit
  JsonlOptions lim = opt;
  lim.limit = 1;
  CHECK(load_llava_jsonl(path, lim).size() == 1);

  // Strict: the first bad line, by file:line and reason.
  JsonlOptions strict = opt;
  strict.strict = true;
  CHECK_THROWS_WITH(load_llava_jsonl(path, strict), Catch::Contains(path + ":2: bad_json"));
  // With the JSON fixed, the first error is an image error on line 3 (decoded in parallel).
  lines[1] = lines[0];
  text.clear();
  for (const auto& l : lines) text += l + "\n";
  write_text(path, text);
  CHECK_THROWS_WITH(load_llava_jsonl(path, strict), Catch::Contains(path + ":3: missing_image"));
  CHECK_THROWS_WITH(load_llava_jsonl(d + "/nope.jsonl"), Catch::Contains("nope.jsonl"));
}
