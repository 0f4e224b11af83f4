// shapes.cpp: the procedural shapes VQA dataset. See shapes.h for what it contains.
// Randomness is our own splitmix64 (std:: distributions differ between standard libraries,
// and the dataset must be the same everywhere for a seed).
#include "data/shapes.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <stdexcept>

#include "kernels/cpu/parallel.h"

namespace loom {

namespace {

struct Rng {
  uint64_t s;
  uint64_t next() {  // splitmix64
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int below(int n) { return int(next() % uint64_t(n)); }  // bias < n / 2^64
};

const char* kCountWords[] = {"zero", "one", "two", "three", "four"};

// Colours are far apart in RGB (min pairwise distance ~0.8) and from the background.
const float kColours[][3] = {
    {0.90f, 0.10f, 0.10f},  // red
    {0.10f, 0.75f, 0.15f},  // green
    {0.15f, 0.30f, 0.95f},  // blue
    {0.95f, 0.85f, 0.10f},  // yellow
    {0.95f, 0.95f, 0.95f},  // white
};
const float kBackground[3] = {0.20f, 0.20f, 0.20f};

int index_of(const std::vector<std::string>& v, const std::string& s) {
  for (size_t i = 0; i < v.size(); i++)
    if (v[i] == s) return int(i);
  return -1;
}

std::string colour_question(int shape) { return "What colour is the " + shapes_shape_names()[shape] + "?"; }
std::string shape_question(int colour) { return "What shape is the " + shapes_colour_names()[colour] + " object?"; }
std::string count_question() { return "How many shapes are there?"; }
std::string position_question(int shape, int colour) {
  return "Where is the " + shapes_colour_names()[colour] + " " + shapes_shape_names()[shape] + "?";
}

}  // namespace

const std::vector<std::string>& shapes_shape_names() {
  static const std::vector<std::string> v = {"circle", "square", "triangle"};
  return v;
}
const std::vector<std::string>& shapes_colour_names() {
  static const std::vector<std::string> v = {"red", "green", "blue", "yellow", "white"};
  return v;
}
const std::vector<std::string>& shapes_quadrant_names() {
  static const std::vector<std::string> v = {"top left", "top right", "bottom left", "bottom right"};
  return v;
}
const std::vector<std::string>& shapes_qtypes() {
  static const std::vector<std::string> v = {"colour", "shape", "count", "position"};
  return v;
}

void shapes_colour_rgb(int colour, float rgb[3]) {
  if (colour < 0 || colour >= int(shapes_colour_names().size()))
    throw std::runtime_error("shapes: colour index " + std::to_string(colour) + " out of range");
  for (int c = 0; c < 3; c++) rgb[c] = kColours[colour][c];
}
void shapes_background_rgb(float rgb[3]) {
  for (int c = 0; c < 3; c++) rgb[c] = kBackground[c];
}

std::vector<float> render_shapes(const std::vector<ShapeObject>& objects, int S) {
  if (S < 8) throw std::runtime_error("shapes: image_size must be >= 8, got " + std::to_string(S));
  std::vector<float> img(size_t(3) * S * S);
  for (int c = 0; c < 3; c++) std::fill(img.begin() + size_t(c) * S * S, img.begin() + size_t(c + 1) * S * S, kBackground[c]);
  const float cell = S / 2.0f;
  for (const ShapeObject& o : objects) {
    const float cx = (o.quadrant % 2) * cell + cell / 2, cy = (o.quadrant / 2) * cell + cell / 2;
    // Sizes relative to the quadrant: each shape covers the cell centre and stays inside it.
    const float r = 0.36f * cell, half = 0.32f * cell;
    const float apex = cy - 0.36f * cell, base = cy + 0.30f * cell, base_half = 0.38f * cell;
    int x0 = int((o.quadrant % 2) * cell), y0 = int((o.quadrant / 2) * cell);
    for (int y = y0; y < std::min(S, int(y0 + cell + 1)); y++)
      for (int x = x0; x < std::min(S, int(x0 + cell + 1)); x++) {
        float px = x + 0.5f - cx, py = y + 0.5f - cy;  // pixel centre relative to the shape centre
        bool in = false;
        if (o.shape == 0) in = px * px + py * py <= r * r;
        else if (o.shape == 1) in = std::abs(px) <= half && std::abs(py) <= half;
        else {
          float yy = py + cy;  // absolute y
          in = yy >= apex && yy <= base && std::abs(px) <= base_half * (yy - apex) / (base - apex);
        }
        if (!in) continue;
        for (int c = 0; c < 3; c++) img[(size_t(c) * S + y) * S + x] = kColours[o.colour][c];
      }
  }
  for (float& v : img) v = (v - 0.5f) / 0.5f;
  return img;
}

VQASample make_shapes_sample(int64_t index, int image_size, uint64_t seed) {
  const int NS = int(shapes_shape_names().size()), NC = int(shapes_colour_names().size());
  Rng rng{seed * 0x9E3779B97F4A7C15ull ^ (uint64_t(index) + 0x632BE59BD9B4E019ull)};
  rng.next();
  VQASample s;
  const int qtype = int(index % 4);
  s.qtype = shapes_qtypes()[qtype];
  const int n = 1 + rng.below(4);  // 1..4 shapes, uniform: the count answer is balanced
  int quads[4] = {0, 1, 2, 3};
  for (int i = 3; i > 0; i--) std::swap(quads[i], quads[rng.below(i + 1)]);
  // The referent is objects[0]; the others are drawn so that it stays unique.
  ShapeObject t{rng.below(NS), rng.below(NC), quads[0]};
  s.objects.push_back(t);
  for (int i = 1; i < n; i++) {
    ShapeObject o{0, 0, quads[i]};
    switch (qtype) {
      case 0:  // colour of the <shape>: no other object has that shape
        o.shape = (t.shape + 1 + rng.below(NS - 1)) % NS;
        o.colour = rng.below(NC);
        break;
      case 1:  // shape of the <colour> object: no other object has that colour
        o.shape = rng.below(NS);
        o.colour = (t.colour + 1 + rng.below(NC - 1)) % NC;
        break;
      case 2:  // count: anything
        o.shape = rng.below(NS);
        o.colour = rng.below(NC);
        break;
      default: {  // position of the <colour> <shape>: no other object with both
        int k = (t.shape * NC + t.colour + 1 + rng.below(NS * NC - 1)) % (NS * NC);
        o.shape = k / NC;
        o.colour = k % NC;
      }
    }
    s.objects.push_back(o);
  }
  switch (qtype) {
    case 0: s.question = colour_question(t.shape); s.answer = shapes_colour_names()[t.colour]; break;
    case 1: s.question = shape_question(t.colour); s.answer = shapes_shape_names()[t.shape]; break;
    case 2: s.question = count_question(); s.answer = kCountWords[n]; break;
    default: s.question = position_question(t.shape, t.colour); s.answer = shapes_quadrant_names()[t.quadrant];
  }
  // Draw order must not reveal the referent: sort by quadrant.
  std::sort(s.objects.begin(), s.objects.end(),
            [](const ShapeObject& a, const ShapeObject& b) { return a.quadrant < b.quadrant; });
  s.image = render_shapes(s.objects, image_size);
  return s;
}

std::vector<VQASample> make_shapes_dataset(int n, int image_size, uint64_t seed) {
  if (n < 0) throw std::runtime_error("shapes: n must be >= 0, got " + std::to_string(n));
  if (image_size < 8) throw std::runtime_error("shapes: image_size must be >= 8, got " + std::to_string(image_size));
  std::vector<VQASample> out(n);  // no throw inside the parallel loop: sizes are checked above
  cpu::parallel_for(n, [&](int64_t i) { out[i] = make_shapes_sample(i, image_size, seed); });
  return out;
}

std::string answer_shapes_question(const std::vector<ShapeObject>& objects, const std::string& q) {
  const auto& shapes = shapes_shape_names();
  const auto& colours = shapes_colour_names();
  auto unique = [&](auto pred) -> const ShapeObject* {
    const ShapeObject* hit = nullptr;
    for (const ShapeObject& o : objects)
      if (pred(o)) {
        if (hit) return nullptr;
        hit = &o;
      }
    return hit;
  };
  const std::string pc = "What colour is the ", ps = "What shape is the ", pw = "Where is the ";
  if (q == count_question()) return objects.size() <= 4 ? kCountWords[objects.size()] : "";
  if (q.rfind(pc, 0) == 0 && q.back() == '?') {
    int sh = index_of(shapes, q.substr(pc.size(), q.size() - pc.size() - 1));
    const ShapeObject* o = sh < 0 ? nullptr : unique([&](const ShapeObject& x) { return x.shape == sh; });
    return o ? colours[o->colour] : "";
  }
  if (q.rfind(ps, 0) == 0 && q.size() > ps.size() + 8 && q.substr(q.size() - 8) == " object?") {
    int co = index_of(colours, q.substr(ps.size(), q.size() - ps.size() - 8));
    const ShapeObject* o = co < 0 ? nullptr : unique([&](const ShapeObject& x) { return x.colour == co; });
    return o ? shapes[o->shape] : "";
  }
  if (q.rfind(pw, 0) == 0 && q.back() == '?') {
    std::string rest = q.substr(pw.size(), q.size() - pw.size() - 1);
    size_t sp = rest.find(' ');
    if (sp == std::string::npos) return "";
    int co = index_of(colours, rest.substr(0, sp)), sh = index_of(shapes, rest.substr(sp + 1));
    if (co < 0 || sh < 0) return "";
    const ShapeObject* o = unique([&](const ShapeObject& x) { return x.colour == co && x.shape == sh; });
    return o ? shapes_quadrant_names()[o->quadrant] : "";
  }
  return "";
}

const std::string& shapes_caption_prompt() {
  static const std::string p = "Describe the image.";
  return p;
}

// Phrases in the order of their first quadrant: "a red circle in the top left", "two blue
// squares in the top right and bottom right"; lists joined by ", " and a final " and ".
std::string shapes_caption(const std::vector<ShapeObject>& objects) {
  const auto& shapes = shapes_shape_names();
  const auto& colours = shapes_colour_names();
  const auto& quads = shapes_quadrant_names();
  if (objects.size() > 4)
    throw std::runtime_error("shapes: a scene holds at most 4 objects, one per quadrant; got " +
                             std::to_string(objects.size()));
  std::vector<ShapeObject> sorted = objects;
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const ShapeObject& a, const ShapeObject& b) { return a.quadrant < b.quadrant; });
  struct Group {
    int shape, colour;
    std::vector<int> quadrants;
  };
  std::vector<Group> groups;
  for (const ShapeObject& o : sorted) {
    if (o.shape < 0 || o.shape >= int(shapes.size()) || o.colour < 0 || o.colour >= int(colours.size()) ||
        o.quadrant < 0 || o.quadrant >= int(quads.size()))
      throw std::runtime_error("shapes: caption of an object out of range (shape " + std::to_string(o.shape) +
                               ", colour " + std::to_string(o.colour) + ", quadrant " + std::to_string(o.quadrant) + ")");
    auto g = std::find_if(groups.begin(), groups.end(),
                          [&](const Group& x) { return x.shape == o.shape && x.colour == o.colour; });
    if (g == groups.end()) groups.push_back({o.shape, o.colour, {o.quadrant}});
    else g->quadrants.push_back(o.quadrant);
  }
  if (groups.empty()) return "nothing";
  auto join = [](const std::vector<std::string>& parts) {
    std::string out;
    for (size_t i = 0; i < parts.size(); i++) {
      if (i > 0) out += i + 1 == parts.size() ? " and " : ", ";
      out += parts[i];
    }
    return out;
  };
  std::vector<std::string> phrases;
  for (const Group& g : groups) {
    const size_t n = g.quadrants.size();
    std::string p = (n == 1 ? std::string("a") : std::string(kCountWords[n])) + " " +
                    colours[size_t(g.colour)] + " " + shapes[size_t(g.shape)] + (n == 1 ? "" : "s") + " in the ";
    std::vector<std::string> where;
    for (int q : g.quadrants) where.push_back(quads[size_t(q)]);
    phrases.push_back(p + join(where));
  }
  return join(phrases);
}

std::vector<std::string> shapes_corpus() {
  std::vector<std::string> out;
  const int NS = int(shapes_shape_names().size()), NC = int(shapes_colour_names().size());
  out.push_back(count_question());
  for (int s = 0; s < NS; s++) out.push_back(colour_question(s));
  for (int c = 0; c < NC; c++) out.push_back(shape_question(c));
  for (int s = 0; s < NS; s++)
    for (int c = 0; c < NC; c++) out.push_back(position_question(s, c));
  for (const std::string& a : shapes_colour_names()) out.push_back(a);
  for (const std::string& a : shapes_shape_names()) out.push_back(a);
  for (const std::string& a : shapes_quadrant_names()) out.push_back(a);
  for (int k = 1; k <= 4; k++) out.push_back(kCountWords[k]);
  out.push_back(shapes_caption_prompt());
  for (int c = 0; c < NC; c++)  // caption phrases: "a red circle", "two red circles", ...
    for (int s = 0; s < NS; s++)
      for (int k = 1; k <= 4; k++)
        out.push_back(std::string(k == 1 ? "a" : kCountWords[k]) + " " + shapes_colour_names()[size_t(c)] + " " +
                      shapes_shape_names()[size_t(s)] + (k == 1 ? "" : "s"));
  for (const std::string& q : shapes_quadrant_names()) out.push_back("in the " + q + " and");
  return out;
}

std::vector<std::string> shapes_corpus(const std::vector<VQASample>& samples) {
  std::vector<std::string> out;
  out.reserve(samples.size() * 2);
  for (const VQASample& s : samples) {
    out.push_back(s.question);
    out.push_back(s.answer);
  }
  return out;
}

std::vector<MajorityBaseline> majority_baseline(const std::vector<VQASample>& samples) {
  std::map<std::string, std::map<std::string, int64_t>> counts;  // qtype -> answer -> count
  for (const VQASample& s : samples) counts[s.qtype][s.answer]++;
  std::vector<MajorityBaseline> out;
  MajorityBaseline all;
  all.qtype = "all";
  for (const std::string& qt : shapes_qtypes()) {
    auto it = counts.find(qt);
    if (it == counts.end()) continue;
    MajorityBaseline b;
    b.qtype = qt;
    for (const auto& [ans, c] : it->second) {  // ties: the alphabetically first answer
      b.count += c;
      if (c > b.correct) b.correct = c, b.answer = ans;
    }
    b.accuracy = double(b.correct) / double(b.count);
    all.count += b.count;
    all.correct += b.correct;
    out.push_back(b);
  }
  all.accuracy = all.count ? double(all.correct) / double(all.count) : 0.0;
  out.push_back(all);
  return out;
}

std::string format_majority_baseline(const std::vector<MajorityBaseline>& bs) {
  std::string out;
  char buf[160];
  for (const MajorityBaseline& b : bs) {
    if (b.qtype == "all")
      std::snprintf(buf, sizeof buf, "majority baseline %-8s: %5.1f%% (%lld/%lld)\n", b.qtype.c_str(),
                    100.0 * b.accuracy, (long long)b.correct, (long long)b.count);
    else
      std::snprintf(buf, sizeof buf, "majority baseline %-8s: %5.1f%% (\"%s\", %lld/%lld)\n", b.qtype.c_str(),
                    100.0 * b.accuracy, b.answer.c_str(), (long long)b.correct, (long long)b.count);
    out += buf;
  }
  return out;
}

}  // namespace loom
