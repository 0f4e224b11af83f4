// data_parallel.cpp: the collectives' side of data parallel (see distributed.h): DataParallel
// (the gradient average, its buckets beside the backward, ZeRO-1's gathers, start-up checks),
// and the differentiable gather over the ranks. How the ranks start and find each other is in
// distributed.cpp.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "autograd/autograd.h"
#include "autograd/ops.h"
#include "optim/optimizer.h"
#include "tensor/dispatch.h"
#include "trainer/comm.h"
#include "trainer/config.h"
#include "trainer/distributed.h"

namespace loom {

// ------------------------------------------------------------------ data parallel
DataParallel::DataParallel(const DistEnv& env, const Config& cfg, Device device) : env_(env), device_(device) {
  const bool cpu = device == Device::CPU;
  const double join_s = cfg.get_float("train.dist_join_timeout"), stall_s = cfg.get_float("train.dist_timeout");
  if (!cpu) LOOM_CHECK(nccl::available(), "%s: %s", env.describe().c_str(), nccl::version().c_str());
  bucket_mb_ = cfg.get_float("train.dist_bucket_mb");
  zero_stage_ = cfg.get_int("train.zero_stage");
  std::string payload;
  if (env.rank == 0 && cpu) {
    tcp_ = tcp::Comm::listen(env.world, join_s);
    payload = tcp_.payload();
  } else if (env.rank == 0) {
    payload = nccl::unique_id();
  }
  rv_ = std::make_unique<Rendezvous>(env, payload, join_s, config_fingerprint(cfg));
  // the watchdog is up before the collectives' own start, which waits for every rank
  int rank = env.rank;
  rv_->start_monitor(
      [this, rank](const std::string& why) {
        std::fprintf(stderr, "error: rank %d: %s; stopping (checkpoints already written are complete)\n", rank,
                     why.c_str());
        std::fflush(stderr);
        std::fflush(stdout);
        if (device_ == Device::CUDA) {
          // ncclCommAbort can wait on a peer that is gone: give it a few seconds, then leave
          void* c = comm_;
          std::thread([c] { nccl::abort(c); }).detach();
          usleep(3000000);
        }
        std::_Exit(3);
      },
      [this] {
        void* c = comm_;
        return c ? nccl::async_error(c) : std::string();
      },
      stall_s);
  rv_->set_busy(true);  // the setup, until the first step's heartbeat: data, model, rank 0's baselines
  if (!cpu) {
    LOOM_CHECK(rv_->payload().rfind("loom-tcp ", 0) != 0, "%s trains on CUDA, but rank 0 trains on the CPU: is "
               "train.device the same on every rank?", env.describe().c_str());
    comm_ = nccl::init(rv_->payload(), env.world, env.rank);
    return;
  }
  if (env.rank == 0) tcp_.accept_ranks();
  else tcp_ = tcp::Comm::connect(env.master_addr, rv_->payload(), env.rank, env.world, join_s);
  tcp_.set_timeout(stall_s);  // a peer silent that long: the watchdog stops the run too
  tcp_.set_alive(rv_->alive());  // unless it is busy alone and says so (Rendezvous::set_busy)
  if (bucket_mb_ <= 0) return;  // one average after the backward, on the training thread
  worker_ = std::thread([this] {
    std::unique_lock<std::mutex> l(mu_);
    while (true) {
      cv_.wait(l, [this] { return stopping_ || !jobs_.empty(); });
      if (stopping_) return;  // the run ends (reduce() has joined) or fails (what is queued no longer matters)
      Job j = jobs_.front();
      jobs_.pop_front();
      working_ = true;
      l.unlock();
      try {
        if (!error_) tcp_.all_reduce_avg(j.data, j.count, j.dtype);
      } catch (...) {
        error_ = std::current_exception();  // reported by join() on the training thread
      }
      l.lock();
      working_ = false;
      cv_.notify_all();
    }
  });
}

// The communicator is left to the process's exit: ncclCommDestroy can wait on peers that
// have already gone, and every rank ends (or fails) right after this.
DataParallel::~DataParallel() {
  if (worker_.joinable()) {
    {
      std::lock_guard<std::mutex> l(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  rv_.reset();
}

void DataParallel::begin_backward(Optimizer& opt) {
  if (bucket_mb_ <= 0) return;
  if (!buckets_) {
    bucket_opt_ = &opt;
    buckets_ = std::make_unique<GradBuckets>(opt.grad_buffers(), opt.grad_offsets(), size_t(bucket_mb_ * (1 << 20)),
                                             [this](const Tensor& buf, const GradBuckets::Bucket& b) {
                                               launch(buf, b.offset, b.numel);
                                             });
  }
  LOOM_CHECK(bucket_opt_ == &opt, "DataParallel::begin_backward: one optimizer per run");
  next_event_ = 0;
  buckets_->begin();
  in_backward_ = true;
}

void DataParallel::launch(const Tensor& buffer, int64_t offset, int64_t numel) {
  void* data = static_cast<char*>(buffer.raw()) + offset * int64_t(dtype_size(buffer.dtype()));
  if (device_ == Device::CPU) {
    {
      std::lock_guard<std::mutex> l(mu_);
      jobs_.push_back({data, size_t(numel), buffer.dtype()});
    }
    cv_.notify_all();
    return;
  }
  // the comm stream starts once the compute stream and the weight-gradient branches have
  // written the bucket
  if (next_event_ == events_.size()) events_.push_back(cuda::event_create(false));
  wait_for_gradient_writes(cuda::comm_stream(), events_[next_event_++]);
  nccl::all_reduce_avg(comm_, data, size_t(numel), buffer.dtype(), cuda::comm_stream());
}

void DataParallel::join() {
  if (device_ == Device::CPU) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [this] { return jobs_.empty() && !working_; });
    if (error_) std::rethrow_exception(error_);
    return;
  }
  if (!joined_) joined_ = cuda::event_create(false);
  cuda::event_record(joined_, cuda::comm_stream());
  cuda::stream_wait_event(cuda::default_stream(), joined_);
}

void DataParallel::reduce(Optimizer& opt, Tensor& loss) {
  if (loss.defined())
    LOOM_CHECK(loss.numel() == 1 && loss.is_contiguous(), "DataParallel::reduce: the loss must be one value, got %s",
               loss.desc().c_str());
  if (in_backward_) {  // the buckets: what the backward did not send yet, then wait for all
    LOOM_CHECK(bucket_opt_ == &opt, "DataParallel::reduce: not the optimizer of begin_backward");
    in_backward_ = false;
    const bool learned = buckets_->learned();
    buckets_->finish();
    join();
    if (!learned) {
      // the launch order the first backward taught: the same on every rank, or the index order
      // on all (grad_buckets.h)
      if (!same_on_all_ranks(buckets_->order_fingerprint())) {
        buckets_->use_index_order();
        std::printf("data parallel: the ranks' first backwards completed the gradient buckets in different orders: "
                    "the buckets launch in index order\n");
      }
    }
    if (!learned_logged_ && learned) {  // the first backward that could launch early
      learned_logged_ = true;
      std::printf("data parallel: %zu gradient buckets, %d of them averaged while the backward ran\n",
                  buckets_->buckets().size(), buckets_->launched_early());
    }
    if (loss.defined()) all_reduce_avg(loss);
    return;
  }
  if (device_ == Device::CPU) {
    for (Tensor& g : opt.grad_buffers()) tcp_.all_reduce_avg(g.raw(), size_t(g.numel()), g.dtype());
    if (loss.defined()) tcp_.all_reduce_avg(loss.raw(), 1, loss.dtype());
    return;
  }
  nccl::Group group;
  for (Tensor& g : opt.grad_buffers()) nccl::all_reduce_avg(comm_, g.raw(), size_t(g.numel()), g.dtype(), cuda::default_stream());
  if (loss.defined()) nccl::all_reduce_avg(comm_, loss.raw(), 1, loss.dtype(), cuda::default_stream());
}

void DataParallel::all_reduce_avg(Tensor& t) {
  LOOM_CHECK(t.is_contiguous(), "all_reduce_avg: %s is not contiguous", t.desc().c_str());
  if (device_ == Device::CPU) tcp_.all_reduce_avg(t.raw(), size_t(t.numel()), t.dtype());
  else nccl::all_reduce_avg(comm_, t.raw(), size_t(t.numel()), t.dtype(), cuda::default_stream());
}

Tensor gather_over_ranks(const Tensor& x, int rank, int world,
                         const std::function<void(const Tensor& x, Tensor& out)>& gather) {
  LOOM_CHECK(x.dim() >= 1 && world >= 1 && rank >= 0 && rank < world, "gather_over_ranks: x %s, rank %d of %d",
             x.desc().c_str(), rank, world);
  Tensor xc = x.contiguous();
  Shape s = xc.shape();
  const int64_t n = s[0];
  s[0] = n * world;
  Tensor out = Tensor::empty(s, xc.dtype(), xc.device());
  gather(xc, out);
  if (any_requires_grad({x}))
    record("gather_over_ranks", {out}, [x, out, rank, world, n]() {
      Tensor g = grad_of(out);
      if (!g.defined()) return;
      NoGradGuard ng;
      accumulate_grad(x, scale(g.narrow(0, int64_t(rank) * n, n), double(world)), true);
    });
  return out;
}

Tensor DataParallel::all_gather_rows(const Tensor& x) {
  LOOM_CHECK(!in_backward_, "DataParallel::all_gather_rows: not while a backward's gradient buckets are in flight");
  return gather_over_ranks(x, env_.rank, env_.world, [this](const Tensor& in, Tensor& out) {
    if (device_ == Device::CPU)
      tcp_.all_gather(in.raw(), out.raw(), size_t(in.numel()) * dtype_size(in.dtype()));
    else
      nccl::all_gather(comm_, in.raw(), out.raw(), size_t(in.numel()), in.dtype(), cuda::default_stream());
  });
}

bool DataParallel::same_on_all_ranks(double value, std::string* values) {
  // every rank's value, copied (a mean would round: NCCL's average of 3 equal values need not be
  // the value), so that every rank sees the same list and decides alike
  const std::vector<double> all =
      all_gather_rows(Tensor::from_vector(std::vector<double>{value}, {1}, device_)).to_vector<double>();
  bool same = true;
  for (size_t r = 0; r < all.size(); r++) {
    same = same && all[r] == all[0];
    if (values) *values += strformat("%srank %zu: %g", r ? ", " : "", r, all[r]);
  }
  return same;
}

void DataParallel::check_same(const std::string& what, double value, const std::string& hint) {
  std::string values;
  const bool same = same_on_all_ranks(value, &values);
  LOOM_CHECK(same, "data parallel: %s differs between the ranks (%s): %s", what.c_str(), values.c_str(), hint.c_str());
}

void DataParallel::shard_optimizer(Optimizer& opt) {
  if (zero_stage_ != 1) return;
  opt.shard(env_.rank, env_.world, [this](Tensor& flat, const std::vector<int64_t>& bounds) {
    LOOM_CHECK(flat.is_contiguous() && bounds.size() == size_t(env_.world) + 1 && bounds.back() <= flat.numel(),
               "DataParallel: a gather of parts of %s over %zu bounds", flat.desc().c_str(), bounds.size());
    const size_t es = dtype_size(flat.dtype());
    if (device_ == Device::CPU) {
      std::vector<size_t> b(bounds.size());
      for (size_t i = 0; i < b.size(); i++) b[i] = size_t(bounds[i]) * es;
      tcp_.all_gather_parts(flat.raw(), b);
      return;
    }
    char* p = static_cast<char*>(flat.raw());
    nccl::Group group;
    for (int r = 0; r < env_.world; r++) {
      const int64_t n = bounds[size_t(r) + 1] - bounds[size_t(r)];
      if (n > 0) nccl::broadcast(comm_, p + size_t(bounds[size_t(r)]) * es, size_t(n), flat.dtype(), r, cuda::default_stream());
    }
  });
  std::printf("data parallel: ZeRO stage 1 (train.zero_stage = 1): this rank holds the optimizer moments of %.2fM of "
              "%.2fM parameters and updates those; the master weights gathered after every update\n",
              opt.owned_parameters() / 1e6, opt.num_parameters() / 1e6);
}

void DataParallel::finish() {
  if (finished_) return;
  finished_ = true;
  if (device_ == Device::CUDA) cuda::synchronize();
  rv_->goodbye();
}

void DataParallel::fail(const std::string& why) {
  if (rv_) rv_->tell_abort(strformat("rank %d failed: %s", env_.rank, why.c_str()));
}

std::string DataParallel::backend() const {
  const std::string when =
      bucket_mb_ > 0 ? strformat("in buckets of about %g MB, each as soon as the backward has written it "
                                 "(train.dist_bucket_mb)", bucket_mb_)
                     : std::string("after the backward (train.dist_bucket_mb = 0)");
  if (device_ == Device::CPU)
    return strformat("data parallel: %s; CPU, gradients averaged over TCP, each rank summing its part of them (in "
                     "rank order, in double precision) %s", env_.describe().c_str(), when.c_str());
  return strformat("data parallel: %s; NCCL %s, gradients averaged %s", env_.describe().c_str(),
                   nccl::version().c_str(), when.c_str());
}

}  // namespace loom
