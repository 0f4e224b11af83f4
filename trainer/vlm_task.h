// vlm_task.h: the VLM data pipeline and model for the vlm_sft / vlm_pretrain trainers and the
// chat command: conversations -> chat template -> expanded image tokens -> packed batches.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "data/packing.h"
#include "data/tokenizer.h"
#include "nn/vlm.h"
#include "trainer/run.h"
#include "trainer/staging.h"

namespace loom {

struct QA {
  std::string question, answer, qtype;
  int image = -1;  // index into the image list
};

struct VLMData {
  std::shared_ptr<Tokenizer> tok;
  int32_t image_token = -1, pad_id = 0, end_id = -1;  // <image>, <|endoftext|>, <|im_end|>
  int image_size = 0, channels = 3, image_tokens = 0;
  std::vector<std::vector<float>> images;  // train and validation images
  std::vector<Sample> train;               // tokenized, image tokens expanded
  std::vector<QA> val;                     // held-out questions (generation eval)
  std::vector<Sample> val_samples;         // the same, tokenized (validation loss)
  std::vector<std::vector<int>> rows;      // packing plan of `train`
  PackingStats stats;
  std::string baseline_text;               // majority-answer baseline per question type
  std::map<std::string, double> baseline;  // qtype -> accuracy
};

// Builds the dataset named by data.dataset (shapes | fashion_mnist | jsonl) with its
// tokenizer (given, or trained on the corpus and cached in the run folder).
VLMData build_vlm_data(const RunContext& ctx, int image_tokens);
VLMConfig vlm_config_from(const Config& cfg, int vocab, int image_token);

// Encodes one conversation (user asks about the image, assistant answers) into a Sample.
Sample encode_qa(const VLMData& d, const std::string& question, const std::string& answer, int image);
// The generation prompt for a question (image tokens expanded), ending in "assistant\n".
std::vector<int32_t> qa_prompt(const VLMData& d, const std::string& question);

// A packed batch on the device: images [Bi, C, H, W] in `dtype`, indices int32.
VLMBatch to_device(const VLMData& d, const PackedBatch& pb, Device dev, DType dtype);

// The same batch laid out in page-locked memory by a loader thread (staging.h): fields
// images (in `dtype`), ids, pos, targets, image_positions, cu_seqlens; meta nseq,
// max_seqlen, images, real_tokens. from_staged() gives the VLMBatch of its uploaded tensors.
// loss_multiple > 1 pads the loss rows to a multiple of it (loss_rows_of).
StagedBatch stage_batch(const VLMData& d, const PackedBatch& pb, const std::shared_ptr<PinnedPool>& pool, DType dtype,
                        int64_t loss_multiple = 1);
VLMBatch from_staged(const StagedBatch& b, const std::map<std::string, Tensor>& t);

// How the next token is picked, as HF's generate does it: temperature 0 is greedy (argmax);
// otherwise the logits are divided by the temperature, only the top_k largest kept (0: all),
// then only the smallest set of the most likely tokens whose probabilities add up to at least
// top_p (1: all; at least one token is always kept), and one is drawn from what is left.
struct Sampling {
  double temperature = 0;
  int top_k = 0;
  double top_p = 1.0;
};
// Throws naming the option when a value is out of range (temperature < 0, top_k < 0,
// top_p outside (0, 1], or any of them not finite).
void check_sampling(const Sampling& s);
// The next token for one position's logits; ties of the argmax go to the lowest id. Exposed
// for the tests.
int32_t sample_next(std::vector<double> logits, const Sampling& s, Rng& rng);

// Generation with a KV cache from the prompt; stops at stop_id or after max_new tokens.
std::vector<int32_t> generate(const VLM& m, const Tensor& image, const std::vector<int32_t>& prompt, int max_new,
                              int32_t stop_id, const Sampling& s, Rng& rng);

}  // namespace loom
