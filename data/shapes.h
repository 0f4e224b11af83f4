// shapes.h: the built-in VLM dataset, generated in-process and deterministic from a seed.
//
// Each image (RGB, image_size x image_size, CHW float normalized as (x - 0.5) / 0.5) holds
// 1-4 flat shapes (circle, square, triangle) in 5 well separated colours on a plain dark
// background, one per quadrant. Each image comes with one question of four types:
//   colour    "What colour is the square?"           -> "red"
//   shape     "What shape is the red object?"        -> "circle"
//   count     "How many shapes are there?"           -> "three"
//   position  "Where is the blue circle?"            -> "top left"
// The scene is built around the answer, so every question has a unique referent, and each
// answer value is equally likely within its type (the majority-answer baseline is 1/5,
// 1/3, 1/4, 1/4). Small enough to be learned by a tiny VLM on a CPU in minutes.
//
// Every scene also has a caption, the whole scene in words (the stage-1 data of the
// two-stage VLM recipe, configs/vlm_pretrain.cfg):
//   "a red circle in the top left and two blue squares in the top right and bottom right"
// Objects of the same colour and shape form one phrase, phrases in the order of their first
// quadrant (top left, top right, bottom left, bottom right); see shapes_caption().
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace loom {

// One shape of a scene: indices into shapes_shape_names() / shapes_colour_names() and the
// quadrant 0 top left, 1 top right, 2 bottom left, 3 bottom right.
struct ShapeObject {
  int shape = 0, colour = 0, quadrant = 0;
};

struct VQASample {
  std::vector<float> image;  // [3, image_size, image_size], (x - 0.5) / 0.5
  std::string question, answer, qtype;
  std::vector<ShapeObject> objects;  // the scene, for tests and debugging
};

const std::vector<std::string>& shapes_shape_names();   // circle, square, triangle
const std::vector<std::string>& shapes_colour_names();  // red, green, blue, yellow, white
const std::vector<std::string>& shapes_quadrant_names();  // top left, ...
const std::vector<std::string>& shapes_qtypes();        // colour, shape, count, position
// The RGB (0..1) of a colour index, and of the background.
void shapes_colour_rgb(int colour, float rgb[3]);
void shapes_background_rgb(float rgb[3]);

// Sample `index` of the dataset with this seed (sample i does not depend on n).
VQASample make_shapes_sample(int64_t index, int image_size, uint64_t seed);
// Samples 0..n-1. Question types cycle colour, shape, count, position.
std::vector<VQASample> make_shapes_dataset(int n, int image_size, uint64_t seed);
// Render a scene (used by the generator; exposed for tests): CHW normalized.
std::vector<float> render_shapes(const std::vector<ShapeObject>& objects, int image_size);
// The answer to `question` about `objects`, derived from the question text alone, or ""
// when the question has no unique referent. The generator's answers must agree.
std::string answer_shapes_question(const std::vector<ShapeObject>& objects, const std::string& question);

// The caption of a scene (above), and the user prompt that asks for it.
std::string shapes_caption(const std::vector<ShapeObject>& objects);
const std::string& shapes_caption_prompt();  // "Describe the image."

// Text for training the tokenizer: every question and answer the generator can emit, the
// caption prompt and every word and phrase a caption is made of.
std::vector<std::string> shapes_corpus();
// The questions and answers of these samples.
std::vector<std::string> shapes_corpus(const std::vector<VQASample>& samples);

// Accuracy of always giving the most frequent answer of each question type.
struct MajorityBaseline {
  std::string qtype, answer;  // qtype "all" = the per-type majorities combined
  int64_t count = 0, correct = 0;
  double accuracy = 0;
};
std::vector<MajorityBaseline> majority_baseline(const std::vector<VQASample>& samples);
// One line per type: "majority baseline colour: 20.4% ("red", 102/500)".
std::string format_majority_baseline(const std::vector<MajorityBaseline>& b);

}  // namespace loom
