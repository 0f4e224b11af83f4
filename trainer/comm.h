// comm.h: the few NCCL calls data parallel needs, behind plain types (trainer/comm_nccl.cpp).
// In a build without NCCL (CPU-only, or nccl.h not found) available() is false and every other
// call throws saying so.
#pragma once
#include <cstddef>
#include <string>

#include "tensor/tensor.h"

namespace loom::nccl {

bool available();
std::string version();                 // "2.28.9" (the library loaded), or why there is none
std::string unique_id();               // ncclGetUniqueId: 128 opaque bytes (rank 0)
void* init(const std::string& id, int world, int rank);  // ncclCommInitRank
void group_start();
void group_end();
// In place on `stream` (the compute stream): sum / world of every rank's buffer.
void all_reduce_avg(void* comm, void* buf, size_t count, DType dt, Stream stream);
// NCCL's asynchronous error of the communicator ("" when none)
std::string async_error(void* comm);
void abort(void* comm);
void destroy(void* comm);

}  // namespace loom::nccl
