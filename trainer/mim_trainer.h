// mim_trainer.h: the vit_mim trainer (LatentMIM / ContrastiveLatentMIM) and its evaluation,
// a linear (ridge) or k-NN probe on frozen encoder features beside raw pixels.
#pragma once
#include "data/images.h"
#include "nn/mim.h"
#include "trainer/run.h"

namespace loom {

int train_mim(const RunContext& ctx);
MIMConfig mim_config_from(const Config& cfg);

// The images of data.dataset: the training set, the probe's test split, and the probe's
// training set (the first 10k training images).
struct MIMData {
  ImageSet train, test, probe_train;
};
MIMData load_mim_data(const Config& cfg, const ViTConfig& vit);

// The probe on frozen mean-pooled encoder features (eval.probe: ridge or knn) beside the
// baselines recorded at the start of the run (probe_raw_pixels, probe_random_init): the eval
// line of metrics.jsonl and its text. The trainer's evaluations and ./train eval call this.
EvalReport evaluate_mim(const ViT& encoder, const MIMData& d, const RunContext& ctx,
                        const std::map<std::string, double>& baselines, int64_t step);

// Probe accuracy of features [n, d] (row-major) with labels, trained on the train split.
double ridge_probe(const std::vector<float>& xtr, const std::vector<int32_t>& ytr, const std::vector<float>& xte,
                   const std::vector<int32_t>& yte, int d, int classes);
double knn_probe(const std::vector<float>& xtr, const std::vector<int32_t>& ytr, const std::vector<float>& xte,
                 const std::vector<int32_t>& yte, int d, int classes, int k);

}  // namespace loom
