// comm_nccl.cpp: NCCL behind comm.h. Compiled in every build; the NCCL part only when CMake
// found nccl.h and libnccl (LOOM_HAVE_NCCL=1, CUDA builds).
#include "trainer/comm.h"

#include <cstring>

#if LOOM_HAVE_NCCL
#include <nccl.h>
#endif

namespace loom::nccl {

#if LOOM_HAVE_NCCL

#define NCCL_CHECK(call)                                                                     \
  do {                                                                                       \
    ncclResult_t r_ = (call);                                                                \
    LOOM_CHECK(r_ == ncclSuccess, "NCCL: %s failed: %s (%s)", #call, ncclGetErrorString(r_), \
               ncclGetLastError(nullptr) ? ncclGetLastError(nullptr) : "");                  \
  } while (0)

bool available() { return true; }

std::string version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  return strformat("%d.%d.%d", v / 10000, (v / 100) % 100, v % 100);
}

std::string unique_id() {
  ncclUniqueId id;
  NCCL_CHECK(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof id.internal);
}

void* init(const std::string& id, int world, int rank) {
  ncclUniqueId u;
  LOOM_CHECK(id.size() == sizeof u.internal, "NCCL: unique id of %zu bytes, expected %zu", id.size(),
             sizeof u.internal);
  std::memcpy(u.internal, id.data(), id.size());
  ncclComm_t c = nullptr;
  NCCL_CHECK(ncclCommInitRank(&c, world, u, rank));
  return c;
}

void group_start() { NCCL_CHECK(ncclGroupStart()); }
void group_end() { NCCL_CHECK(ncclGroupEnd()); }

static ncclDataType_t nccl_type(DType dt) {
  switch (dt) {
    case DType::F32: return ncclFloat32;
    case DType::BF16: return ncclBfloat16;
    case DType::F16: return ncclFloat16;
    case DType::F64: return ncclFloat64;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
    default: LOOM_CHECK(false, "NCCL: no reduction for dtype %s", dtype_name(dt));
  }
  return ncclFloat32;
}

void all_reduce_avg(void* comm, void* buf, size_t count, DType dt, Stream stream) {
  NCCL_CHECK(ncclAllReduce(buf, buf, count, nccl_type(dt), ncclAvg, static_cast<ncclComm_t>(comm),
                           reinterpret_cast<cudaStream_t>(stream)));
}

void all_gather(void* comm, const void* send, void* recv, size_t count, DType dt, Stream stream) {
  NCCL_CHECK(ncclAllGather(send, recv, count, nccl_type(dt), static_cast<ncclComm_t>(comm),
                           reinterpret_cast<cudaStream_t>(stream)));
}

void broadcast(void* comm, void* buf, size_t count, DType dt, int root, Stream stream) {
  NCCL_CHECK(ncclBroadcast(buf, buf, count, nccl_type(dt), root, static_cast<ncclComm_t>(comm),
                           reinterpret_cast<cudaStream_t>(stream)));
}

std::string async_error(void* comm) {
  ncclResult_t r = ncclSuccess;
  if (ncclCommGetAsyncError(static_cast<ncclComm_t>(comm), &r) != ncclSuccess) return "ncclCommGetAsyncError failed";
  if (r == ncclSuccess || r == ncclInProgress) return "";
  return strformat("NCCL asynchronous error: %s", ncclGetErrorString(r));
}

void abort(void* comm) {
  if (comm) ncclCommAbort(static_cast<ncclComm_t>(comm));
}
void destroy(void* comm) {
  if (comm) ncclCommDestroy(static_cast<ncclComm_t>(comm));
}

#else  // no NCCL in this build

static const char* kWhy = "this build has no NCCL (a CPU-only build, or nccl.h / libnccl not found by CMake)";
bool available() { return false; }
std::string version() { return kWhy; }
std::string unique_id() { LOOM_CHECK(false, "%s", kWhy); return ""; }
void* init(const std::string&, int, int) { LOOM_CHECK(false, "%s", kWhy); return nullptr; }
void group_start() { LOOM_CHECK(false, "%s", kWhy); }
void group_end() { LOOM_CHECK(false, "%s", kWhy); }
void all_reduce_avg(void*, void*, size_t, DType, Stream) { LOOM_CHECK(false, "%s", kWhy); }
void all_gather(void*, const void*, void*, size_t, DType, Stream) { LOOM_CHECK(false, "%s", kWhy); }
void broadcast(void*, void*, size_t, DType, int, Stream) { LOOM_CHECK(false, "%s", kWhy); }
std::string async_error(void*) { return ""; }
void abort(void*) {}
void destroy(void*) {}

#endif

}  // namespace loom::nccl
