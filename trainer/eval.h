// eval.h: the evaluations of the trainers and `./train eval`, which re-runs the evaluation of
// a finished (or interrupted) run from its checkpoint, without training.
//
//   VLM (vlm_sft, vlm_pretrain): validation loss on packed held-out samples, then exact-match
//       answer accuracy by greedy generation per question type beside the majority-answer
//       baseline of that type (evaluate_vlm).
//   MIM (vit_mim): the probe on frozen encoder features beside the raw-pixel and random-init
//       baselines the run recorded at its start (mim_trainer.h: evaluate_mim).
//
// The trainers call the same functions at every train.eval_every and at the last step, so
// `./train eval RUN` on the last checkpoint prints the table the run printed at its end (on
// the CPU the numbers are bit-identical; tests/test_eval_export.cpp).
#pragma once
#include <string>
#include <vector>

#include "nn/vlm.h"
#include "trainer/run.h"
#include "trainer/vlm_task.h"

namespace loom {

// The first max_samples held-out questions; metrics: step, val_loss, accuracy, acc_<qtype>.
EvalReport evaluate_vlm(const VLM& m, const VLMData& d, const RunContext& ctx, int max_samples, int64_t step);

// RUN_OR_CHECKPOINT: a checkpoint folder (step_NNNNNNNN/ with trainer.json) or a run folder (its
// newest checkpoint). The config is the checkpoint's (trainer.json), `overrides`
// ("--section.key=value") on top; the run folder is only read.
EvalReport run_eval(const std::string& run_or_checkpoint, const std::vector<std::string>& overrides);
int eval_command(int argc, char** argv);  // ./train eval RUN_OR_CHECKPOINT [--section.key=value ...]

}  // namespace loom
