// mim_trainer.h: the vit_mim trainer (LatentMIM / ContrastiveLatentMIM) and its evaluation,
// a linear (ridge) or k-NN probe on frozen encoder features beside raw pixels.
#pragma once
#include "trainer/run.h"

namespace loom {

int train_mim(const RunContext& ctx);

// Probe accuracy of features [n, d] (row-major) with labels, trained on the train split.
double ridge_probe(const std::vector<float>& xtr, const std::vector<int32_t>& ytr, const std::vector<float>& xte,
                   const std::vector<int32_t>& yte, int d, int classes);
double knn_probe(const std::vector<float>& xtr, const std::vector<int32_t>& ytr, const std::vector<float>& xte,
                 const std::vector<int32_t>& yte, int d, int classes, int k);

}  // namespace loom
