// cupti_trace.cpp: a kernel-level timeline of any CUDA program, without changing it.
//
// Built as a shared library and loaded by the CUDA driver at initialization through
// CUDA_INJECTION64_PATH (the same hook profilers use). It records, through CUPTI's activity
// API, every kernel, memcpy and memset on the GPU (start/end in ns, stream, name) and every
// CUDA runtime call on the host (start/end, name), and at exit writes them as CSV to
// $LOOM_TRACE_FILE (default trace.csv):
//     kind,start_ns,end_ns,stream,name
// (for a host call, R, the stream column holds the calling thread's id instead)
// tools/trace/report.py turns that into the table that matters for a training step: GPU busy
// time against wall time, the idle gaps, the kernels by total time, and the host calls that
// block (synchronizations, pageable copies, cudaMalloc).
//
// Build (on a machine with the CUDA toolkit):
//   g++ -O2 -shared -fPIC tools/trace/cupti_trace.cpp -I/usr/local/cuda/include \
//       -L/usr/local/cuda/lib64 -lcupti -o build/libloom_trace.so
// Use:
//   CUDA_INJECTION64_PATH=$PWD/build/libloom_trace.so LOOM_TRACE_FILE=t.csv ./train bench_mim.cfg
//   python3 tools/trace/report.py t.csv
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cxxabi.h>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Rec {
  char kind;  // K kernel, C memcpy, S memset, R runtime call
  uint64_t start, end;
  uint32_t stream;  // GPU records: the stream; R: the host thread
  std::string name;
};

std::mutex g_mu;
std::vector<Rec>* g_recs = new std::vector<Rec>();  // leaked: written from atexit

void check(CUptiResult r, const char* what) {
  if (r != CUPTI_SUCCESS) {
    const char* s = nullptr;
    cuptiGetResultString(r, &s);
    std::fprintf(stderr, "cupti_trace: %s failed: %s\n", what, s ? s : "?");
  }
}

std::string short_name(const char* mangled) {
  int st = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &st);
  std::string s = st == 0 && d ? d : mangled;
  std::free(d);
  // keep "namespace::kernel<...>" short: drop the argument list, cap the template part
  for (size_t a; (a = s.find("(anonymous namespace)::")) != std::string::npos;) s.erase(a, 23);
  if (s.rfind("void ", 0) == 0) s.erase(0, 5);
  size_t p = s.find('(');
  if (p != std::string::npos) s = s.substr(0, p);
  if (s.size() > 120) s = s.substr(0, 120);
  for (char& c : s)
    if (c == ',') c = ';';
  return s;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t(8) << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::vector<Rec> out;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        auto* k = reinterpret_cast<CUpti_ActivityKernel10*>(rec);
        out.push_back({'K', k->start, k->end, k->streamId, short_name(k->name)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        auto* m = reinterpret_cast<CUpti_ActivityMemcpy6*>(rec);
        const char* kinds[] = {"?", "HtoD", "DtoH", "HtoA", "AtoH", "AtoA", "AtoD", "DtoA", "DtoD", "HtoH", "PtoP"};
        std::string n = std::string("memcpy ") + (m->copyKind < 11 ? kinds[m->copyKind] : "?") +
                        (m->srcKind == CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE ? " pageable " : " ") +
                        std::to_string(m->bytes);
        out.push_back({'C', m->start, m->end, m->streamId, n});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        auto* m = reinterpret_cast<CUpti_ActivityMemset4*>(rec);
        out.push_back({'S', m->start, m->end, m->streamId, "memset " + std::to_string(m->bytes)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME: {
        auto* a = reinterpret_cast<CUpti_ActivityAPI*>(rec);
        const char* n = nullptr;
        cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, a->cbid, &n);
        out.push_back({'R', a->start, a->end, a->threadId, n ? n : "?"});
        break;
      }
      default:
        break;
    }
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
  if (dropped) std::fprintf(stderr, "cupti_trace: %zu records dropped\n", dropped);
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mu);
  g_recs->insert(g_recs->end(), out.begin(), out.end());
}

void write_trace() {
  cuptiActivityFlushAll(1);
  const char* path = std::getenv("LOOM_TRACE_FILE");
  if (!path) path = "trace.csv";
  std::FILE* f = std::fopen(path, "w");
  if (!f) {
    std::fprintf(stderr, "cupti_trace: cannot write %s\n", path);
    return;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  std::fprintf(f, "kind,start_ns,end_ns,stream,name\n");
  for (auto& r : *g_recs)
    std::fprintf(f, "%c,%llu,%llu,%u,%s\n", r.kind, (unsigned long long)r.start, (unsigned long long)r.end, r.stream,
                 r.name.c_str());
  std::fclose(f);
  std::fprintf(stderr, "cupti_trace: %zu records -> %s\n", g_recs->size(), path);
}

}  // namespace

extern "C" int InitializeInjection(void) {
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "register callbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable memcpy");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable memset");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME), "enable runtime");
  std::atexit(write_trace);
  return 1;
}
