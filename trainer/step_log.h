// step_log.h: the per-step log line without a host synchronization per step.
//
// A trainer posts each step's device scalars (loss, gradient norm, the optimizer's applied
// flag) right after enqueuing the step; they are copied to page-locked memory behind it
// (StepReadback) and logged when the next step has been enqueued, by which time they have
// arrived. The step time is the GPU's own (events: end of the previous step to the end of
// this one), so it counts any time the GPU waited for the host. The NaN guard sees the values
// one step late: the skip itself happens on the device, in the same step (optimizer.h).
#pragma once
#include <deque>

#include "trainer/run.h"
#include "trainer/staging.h"

namespace loom {

class AsyncStepLog {
 public:
  struct Step {
    int64_t step = 0, total = 0;
    double lr = 0, data_ms = 0, items = 0, flops = 0;  // items: images or real tokens of the step
  };
  // loss_scale: the optimizer's loss scale (fp16, Optimizer::loss_scale_value), logged with each
  // step; undefined when the run does not scale.
  AsyncStepLog(const RunContext& ctx, RunLog& log, NanGuard& guard, const char* items_unit,
               const Tensor& loss_scale = Tensor());
  // Before the step is enqueued (copies the loss scale the step runs with, on the device).
  void begin_step();
  // After the step is enqueued: its loss and norm (f32 device scalars) and applied flag.
  void post(const Step& s, const Tensor& loss, const Tensor& norm, const Tensor& applied);
  // Logs the posted steps whose values are needed now: all of them (`all`, before an
  // evaluation or a checkpoint), else all but the newest (which the GPU may still run).
  void flush(bool all);
  // After work outside the steps (evaluation, checkpoint): the next step is timed from its start.
  void restart_timing() { rb_.restart_timing(); }
  double last_loss() const { return last_loss_; }

 private:
  const RunContext& ctx_;
  RunLog& log_;
  NanGuard& guard_;
  const char* unit_;
  StepReadback rb_;
  Tensor scale_, scale_at_start_;  // the optimizer's scale; its value when the step began
  std::deque<Step> pending_;
  double last_loss_ = 0;
  // the GPU's energy counter is read once energy_every_ms_ of steps have passed since the last
  // read (energy_ms_: the steps' ms since then; LOOM_ENERGY_READ_MS, step_log.cpp)
  double energy_every_ms_, energy_ms_;
};

}  // namespace loom
