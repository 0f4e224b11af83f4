// cuda_stub.cpp: the CUDA runtime entry points of kernels.h for CPU-only builds (compiled
// instead of kernels/cuda/*.cu). available() is false and device_count() is 0, so callers
// can probe; every other call throws. No kernels are defined here: calling a CUDA kernel in
// a CPU-only build is a link error, never a runtime surprise.
#include <stdexcept>

#include "kernels/kernels.h"

namespace loom::cuda {

namespace {
[[noreturn]] void no_cuda() {
  throw std::runtime_error("loom was built without CUDA: rebuild with `make CUDA=1` on a machine with nvcc");
}
}  // namespace

bool available() { return false; }
int device_count() { return 0; }
void* device_malloc(size_t) { no_cuda(); }
void device_free(void*) { no_cuda(); }
void memcpy_h2d(void*, const void*, size_t, Stream) { no_cuda(); }
void memcpy_d2h(void*, const void*, size_t, Stream) { no_cuda(); }
void memcpy_d2d(void*, const void*, size_t, Stream) { no_cuda(); }
void memcpy_2d(void*, size_t, const void*, size_t, size_t, size_t, Stream) { no_cuda(); }
void memset_zero(void*, size_t, Stream) { no_cuda(); }
void* pinned_malloc(size_t) { no_cuda(); }
void pinned_free(void*) { no_cuda(); }
void synchronize() { no_cuda(); }
Stream default_stream() { no_cuda(); }
Stream main_stream() { no_cuda(); }
Stream side_stream() { no_cuda(); }
void side_scope_begin() { no_cuda(); }
void side_branch_fork(void*) { no_cuda(); }
void side_branch_end(void*) { no_cuda(); }
void side_branch_join(void*) { no_cuda(); }
void side_scope_end() { no_cuda(); }
bool side_scope_active() { return false; }
size_t bytes_in_use() { no_cuda(); }
size_t peak_bytes_in_use() { no_cuda(); }
void reset_peak_bytes() { no_cuda(); }
size_t bytes_reserved() { no_cuda(); }
size_t peak_bytes_reserved() { no_cuda(); }
double device_energy_joules() { return -1.0; }
Stream copy_stream() { no_cuda(); }
Stream comm_stream() { no_cuda(); }
void* event_create(bool) { no_cuda(); }
void event_destroy(void*) { no_cuda(); }
void event_record(void*, Stream) { no_cuda(); }
void stream_wait_event(Stream, void*) { no_cuda(); }
void event_synchronize(void*) { no_cuda(); }
bool event_done(void*) { no_cuda(); }
float event_elapsed_ms(void*, void*) { no_cuda(); }
void memcpy_h2d_async(void*, const void*, size_t, Stream) { no_cuda(); }
void range_push(const char*) {}  // no timeline without CUDA: nothing to mark
void range_pop() {}
void graph_pool_begin() { no_cuda(); }
void graph_pool_end() { no_cuda(); }
void release_cached() { no_cuda(); }
void graph_capture_begin(Stream) { no_cuda(); }
void* graph_capture_end(Stream) { no_cuda(); }
void graph_launch(void*, Stream) { no_cuda(); }
void graph_destroy(void* g) {  // called by destructors: nothing was captured without CUDA
  if (g) no_cuda();
}
void memcpy_d2h_async(void*, const void*, size_t, Stream) { no_cuda(); }
void set_deterministic_attention(bool) { no_cuda(); }
bool deterministic_attention() { no_cuda(); }
// The attention backend is a setting the trainer writes whatever the device: kept, unused.
namespace {
AttentionBackend g_backend = AttentionBackend::Loom;
}
void set_attention_backend(AttentionBackend b) { g_backend = b; }
AttentionBackend attention_backend() { return g_backend; }
const char* attention_backend_name(AttentionBackend b) {
  return b == AttentionBackend::Auto ? "auto" : b == AttentionBackend::Cudnn ? "cudnn" : "loom";
}
void reset_attention_choices() {}
int attention_cudnn_dense_plans() { return 0; }

}  // namespace loom::cuda
