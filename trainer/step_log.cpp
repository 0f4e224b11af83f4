// step_log.cpp: see step_log.h.
#include "trainer/step_log.h"

namespace loom {

AsyncStepLog::AsyncStepLog(const RunContext& ctx, RunLog& log, NanGuard& guard, const char* items_unit,
                           const Tensor& loss_scale)
    : ctx_(ctx), log_(log), guard_(guard), unit_(items_unit), rb_(ctx.device, loss_scale.defined() ? 4 : 3),
      scale_(loss_scale) {
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
    // read with the step's values, once its end event has passed (one step late, like them): a
    // difference over n steps, divided by n, is their energy per step
    st.energy_j = gpu ? cuda::device_energy_joules() : -1;
    st.loss_scale = scale;
    st.skipped = !applied;
    log_.step(st);
  }
}

}  // namespace loom
