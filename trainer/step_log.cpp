// step_log.cpp: see step_log.h.
#include "trainer/step_log.h"

#include <cstdlib>
#include <limits>

namespace loom {

namespace {
// How many milliseconds of steps pass between two reads of the GPU's energy counter
// (metrics.jsonl's energy_j): 1000 unless LOOM_ENERGY_READ_MS says otherwise (0: after every
// step, as bench/e2e.sh and bench/ab.sh run, to place the counter's moves within a step).
// The read is a driver call on the host thread that enqueues the steps, and NVML's counter
// moves only about every 100 ms anyway. Read after every step (171f652 to be8cb59), it held
// the default vlm_sft.cfg at ~3 ms steps on an H100: 16.8 s for its 3500 steps and
// evaluations, against 4.1 s on 3a15a95 (before the read) and 5.0 s with this once-a-second
// read (bench/RESULTS.md 2026-12-07 "be8cb59" and "d36d9c7"). The SPEC steps, 20-50 ms of GPU
// work each, hide it.
double energy_read_ms() {
  const char* v = std::getenv("LOOM_ENERGY_READ_MS");
  if (!v || !*v) return 1000.0;
  char* end = nullptr;
  const double ms = std::strtod(v, &end);
  LOOM_CHECK(end && !*end && ms >= 0, "LOOM_ENERGY_READ_MS=%s: a number of milliseconds >= 0", v);
  return ms;
}
}  // namespace

AsyncStepLog::AsyncStepLog(const RunContext& ctx, RunLog& log, NanGuard& guard, const char* items_unit,
                           const Tensor& loss_scale)
    : ctx_(ctx), log_(log), guard_(guard), unit_(items_unit), rb_(ctx.device, loss_scale.defined() ? 4 : 3),
      scale_(loss_scale),
      energy_every_ms_(energy_read_ms()),
      energy_ms_(std::numeric_limits<double>::infinity()) {
  if (scale_.defined()) scale_at_start_ = Tensor::empty(scale_.shape(), scale_.dtype(), scale_.device());
}

void AsyncStepLog::begin_step() {
  rb_.begin_step();
  // 4 bytes, device to device, into one buffer: the previous step's readback of it was
  // enqueued before this copy on the same stream
  if (scale_.defined()) scale_at_start_.copy_(scale_);
}

void AsyncStepLog::post(const Step& s, const Tensor& loss, const Tensor& norm, const Tensor& applied) {
  if (scale_.defined()) rb_.post(s.step, {loss, norm, applied, scale_at_start_});
  else rb_.post(s.step, {loss, norm, applied});
  pending_.push_back(s);
}

void AsyncStepLog::flush(bool all) {
  while (!pending_.empty() && (all || pending_.size() > 1)) {
    Step s = pending_.front();
    pending_.pop_front();
    int64_t step = 0;
    double ms = 0;
    std::vector<double> v = rb_.take(&step, &ms);
    const double loss = v[0], norm = v[1];
    const bool applied = v[2] != 0.0;
    const double scale = v.size() > 3 ? v[3] : -1.0;
    last_loss_ = loss;
    guard_.ok(step, loss, norm, scale);  // reports a non-finite step; stops the run after too many in a row
    const bool gpu = ctx_.device == Device::CUDA;
    StepStats st;
    st.step = step;
    st.total = s.total;
    st.loss = loss;
    st.lr = s.lr;
    st.grad_norm = norm;
    st.ms = ms;
    st.data_ms = s.data_ms;
    st.items_per_s = s.items / (ms / 1e3);
    st.items = unit_;
    st.mfu = gpu ? s.flops / (ms / 1e3) / 989e12 : -1;
    st.mem_mb = (gpu ? double(cuda::peak_bytes_in_use()) : double(cpu_peak_bytes())) / 1048576.0;
    st.reserved_mb = gpu ? double(cuda::bytes_reserved()) / 1048576.0 : -1;
    // read with the step's values, once its end event has passed (one step late, like them), when
    // energy_every_ms_ of steps have passed since the last read (-1: not read at this step, no
    // energy_j in its line); tools/energy_counter.py takes the power between the counter's moves
    energy_ms_ += ms;
    st.energy_j = -1;
    if (gpu && energy_ms_ >= energy_every_ms_) {
      st.energy_j = cuda::device_energy_joules();
      energy_ms_ = 0;
    }
    st.loss_scale = scale;
    st.skipped = !applied;
    log_.step(st);
  }
}

}  // namespace loom
