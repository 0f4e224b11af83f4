// test_fixtures.cpp: whole-model checks against the PyTorch / HF goldens in tests/fixtures/
// (how they were made: tests/fixtures/README.md).
//
// run_check (trainer/check.h) rebuilds each model from the fixture, runs forward and backward
// in f64 on the CPU and measures every output's and gradient's relative error
// ||got - ref|| / ||ref||; each must be <= tol::kFixtureRelF64 (1e-6). Then the check is shown
// to be able to fail: copies of a fixture with one gradient (or the loss) perturbed, written
// with save_safetensors into a temporary directory, must fail it, and name the perturbed row.
//
// Paths are relative to the repository root (ctest's working directory).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <fstream>
#include <string>
#include <vector>

#include "tensor/safetensors.h"
#include "tests/scratch_dir.h"
#include "tests/tolerances.h"
#include "trainer/check.h"

using namespace loom;
using std::string;

namespace {

const string kDir = "tests/fixtures/";

void print(const string& path, const CheckResult& r) {
  std::printf("\ncheck %s (%s): %zu rows, worst rel err %.3e (tolerance %.0e)\n", path.c_str(), r.kind.c_str(),
              r.rows.size(), r.worst, r.tolerance);
  int shown = 0;
  for (auto& row : r.rows)
    if (row.rel_err > 1e-9 && shown++ < 8)
      std::printf("  %-52s %9lld %.3e%s\n", row.name.c_str(), row.numel, row.rel_err,
                  row.vs_largest ? " (ref ~0: vs largest)" : "");
}

const CheckRow* worst_row(const CheckResult& r) {
  const CheckRow* w = nullptr;
  for (auto& row : r.rows)
    if (!w || !(row.rel_err <= w->rel_err)) w = &row;
  return w;
}

void require_passes(const string& path) {
  CheckResult r = run_check(path, "cpu");
  print(path, r);
  INFO(path << " (" << r.kind << "): worst " << r.worst);
  REQUIRE(r.rows.size() > 3);
  CHECK(r.tolerance == tol::kFixtureRelF64);
  CHECK(r.worst <= tol::kFixtureRelF64);
  CHECK(r.ok());
  for (auto& row : r.rows) {
    INFO(row.name);
    CHECK(std::isfinite(row.rel_err));
    CHECK(row.ref_norm > 0);
  }
}

void copy_file(const string& from, const string& to) {
  std::ifstream in(from, std::ios::binary);
  REQUIRE(in.good());
  std::ofstream out(to, std::ios::binary);
  out << in.rdbuf();
  REQUIRE(out.good());
}

// st's tensors with tensor `name` replaced by a copy whose element `at` moves by
// `rel` times the tensor's norm
std::map<string, Tensor> perturbed(const SafeTensors& st, const string& name, int64_t at, double rel) {
  std::map<string, Tensor> m = st.tensors;
  Tensor t = st.at(name).clone();
  auto v = t.to_vector<double>();
  double norm = 0;
  for (double x : v) norm += x * x;
  norm = std::sqrt(norm);
  REQUIRE(norm > 0);
  v[size_t(at)] += rel * norm;
  m[name] = Tensor::from_vector(v, t.shape()).to(t.dtype());
  return m;
}

}  // namespace

TEST_CASE("fixtures pass the f64 check at 1e-6", "[fixtures]") {
  SECTION("LatentMIM (contrastive)") { require_passes(kDir + "mim_tiny_s0.safetensors"); }
  SECTION("VLM on a packed batch") { require_passes(kDir + "vlm_tiny_s0.safetensors"); }
  SECTION("HF Llama folder") { require_passes(kDir + "llama_tiny_s0"); }
  SECTION("HF SigLIP vision folder") { require_passes(kDir + "siglip_tiny_s0"); }
  // other seeds and shapes than the tests were written against (torch_ref.py --holdout):
  // image 48 / 5 heads / 3 layers / batch 3 for MIM; rows of 80 with padding for the VLM
  SECTION("holdout LatentMIM, other shapes") { require_passes(kDir + "holdout/mim_tiny_s100.safetensors"); }
  SECTION("holdout VLM, padded rows") { require_passes(kDir + "holdout/vlm_tiny_s100.safetensors"); }
}

TEST_CASE("a corrupted fixture fails the check", "[fixtures]") {
  const string dir = loom_test::scratch_subdir("corrupted");  // emptied for each section

  SECTION("MIM: one gradient element moved by 1e-5 of the gradient's norm") {
    SafeTensors st = load_safetensors(kDir + "mim_tiny_s0.safetensors");
    const string name = "grad.encoder.blocks.1.fc1.weight";
    REQUIRE(st.has(name));
    string path = dir + "/mim_grad.safetensors";
    save_safetensors(path, perturbed(st, name, 17, 1e-5), st.metadata);
    CheckResult r = run_check(path, "cpu");
    print(path, r);
    CHECK_FALSE(r.ok());
    CHECK(r.worst > 5e-6);  // ~1e-5: the perturbation, seen through ||.|| / ||ref||
    REQUIRE(worst_row(r));
    CHECK(worst_row(r)->name == "encoder.blocks.1.fc1.weight");
  }
  SECTION("VLM: the loss moved by 1e-4") {
    SafeTensors st = load_safetensors(kDir + "vlm_tiny_s0.safetensors");
    string path = dir + "/vlm_loss.safetensors";
    save_safetensors(path, perturbed(st, "output.loss", 0, 1e-4), st.metadata);
    CheckResult r = run_check(path, "cpu");
    print(path, r);
    CHECK_FALSE(r.ok());
    REQUIRE(worst_row(r));
    CHECK(worst_row(r)->name == "loss");
  }
  SECTION("Llama folder: one gradient of the golden perturbed") {
    const string src = kDir + "llama_tiny_s0";
    const string out = dir + "/llama";
    std::filesystem::create_directory(out);
    copy_file(src + "/config.json", out + "/config.json");
    copy_file(src + "/model.safetensors", out + "/model.safetensors");
    SafeTensors golden = load_safetensors(src + "/golden.safetensors");
    const string name = "grad.model.layers.1.mlp.down_proj.weight";
    REQUIRE(golden.has(name));
    save_safetensors(out + "/golden.safetensors", perturbed(golden, name, 3, 1e-3), golden.metadata);
    CheckResult r = run_check(out, "cpu");
    print(out, r);
    CHECK_FALSE(r.ok());
    REQUIRE(worst_row(r));
    CHECK(worst_row(r)->name.find("down_proj") != string::npos);
  }
  SECTION("a NaN in a gradient fails") {
    SafeTensors st = load_safetensors(kDir + "mim_tiny_s0.safetensors");
    const string name = "grad.encoder.pos_embed";
    REQUIRE(st.has(name));
    auto m = perturbed(st, name, 0, NAN);
    string path = dir + "/mim_nan.safetensors";
    save_safetensors(path, m, st.metadata);
    CheckResult r = run_check(path, "cpu");
    CHECK_FALSE(r.ok());
  }
  SECTION("bad numbers in the metadata are errors naming the file and the key") {
    // a float where an integer goes was converted to int with undefined behaviour past its range
    SafeTensors st = load_safetensors(kDir + "vlm_tiny_s0.safetensors");
    auto meta = st.metadata;
    meta["shuffle"] = "1e100";
    string path = dir + "/vlm_meta.safetensors";
    save_safetensors(path, st.tensors, meta);
    CHECK_THROWS_WITH(run_check(path, "cpu"), Catch::Contains(path) && Catch::Contains("\"shuffle\" = 1e+100"));
    SafeTensors mim = load_safetensors(kDir + "mim_tiny_s0.safetensors");
    auto mmeta = mim.metadata;
    mmeta["config"] = "{\"vit\": {\"dim\": \"wide\"}}";
    string mpath = dir + "/mim_meta.safetensors";
    save_safetensors(mpath, mim.tensors, mmeta);
    CHECK_THROWS_WITH(run_check(mpath, "cpu"), Catch::Contains(mpath) && Catch::Contains("\"dim\" = \"wide\""));
  }
}
