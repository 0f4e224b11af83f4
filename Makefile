# loom front door. CMake is the source of truth; this file only drives it.
#   make            build everything (CUDA when nvcc is found), leave ./train at the root
#   make test       build and run every test through ctest (GPU tests skip without a GPU)
#   make bench      build and run the kernel benchmarks (GPU)
#   make bench-e2e  the SPEC training steps, loom beside PyTorch eager and torch.compile (GPU)
#   make bench-ab   the SPEC training steps under two settings AB_A / AB_B, alternated (bench/ab.sh)
#   make deps       install the Debian packages the build needs (no-op when present)
#   make CUDA=0 ... force the CPU-only build (its own build folder: build-cpu/)
#   make CUDA_ARCH=80 ...  build the CUDA backend for another architecture
#   make NATIVE=0 ...      a portable binary (no -march=native for the CPU code)
#   make SANITIZE=1 test   CPU-only build with ASan + UBSan in build-san/, tests run under them
#   make fuzz              build the libFuzzer targets (clang) in build-fuzz/ and run each for
#                          FUZZ_SECONDS (default 60); FUZZ_TARGETS="idx image" picks some
NVCC := $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
ifeq ($(NVCC),)
  CUDA ?= 0
else
  CUDA ?= 1
endif
CUDA_ARCH ?= 90
JOBS ?= $(shell nproc)
NATIVE ?= 1
SANITIZE ?= 0
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= safetensors config jsonl tokenizer image idx rows
ifeq ($(SANITIZE),1)
  CUDA := 0
  BUILD ?= build-san
endif

ifeq ($(CUDA),0)
  BUILD ?= build-cpu
  CMAKE_FLAGS := -DLOOM_CUDA=OFF -DLOOM_SANITIZE=$(if $(filter 1,$(SANITIZE)),ON,OFF)
else
  BUILD ?= build
  CMAKE_FLAGS := -DLOOM_CUDA=ON -DCMAKE_CUDA_COMPILER=$(NVCC) -DLOOM_CUDA_ARCH="$(CUDA_ARCH)"
endif

DEPS := cmake g++ make pkg-config libeigen3-dev catch2 nlohmann-json3-dev libpcre2-dev \
        libutf8proc-dev libstb-dev zlib1g-dev dataset-fashion-mnist \
        libjpeg62-turbo-dev clang libclang-rt-dev

.PHONY: all build test bench bench-e2e bench-ab deps clean fuzz
all: build
	@ln -sf $(BUILD)/train train

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DLOOM_NATIVE=$(if $(filter 0,$(NATIVE)),OFF,ON) $(CMAKE_FLAGS)

# ctest runs $(JOBS) test processes side by side; each takes 2 threads (kernels/cpu/parallel.h) unless
# OMP_NUM_THREADS says otherwise (with every core's threads in each of 8 processes on 16 cores,
# test_cpu_attention took over 180 s instead of 2.3)
test: build
	cd $(BUILD) && OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} ctest --output-on-failure -j $(JOBS)

# libFuzzer targets: clang, ASan + UBSan, CPU only (fuzz/run.sh builds, seeds and runs them)
fuzz:
	JOBS=$(JOBS) FUZZ_SECONDS=$(FUZZ_SECONDS) bash fuzz/run.sh $(FUZZ_TARGETS)

bench: build
	bash bench/run.sh $(BUILD)

bench-e2e: build
	bash bench/e2e.sh $(BUILD)

bench-ab: build
	bash bench/ab.sh $(BUILD)

deps:
	@missing=""; for p in $(DEPS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q $$missing; \
	else echo "deps: all present"; fi

clean:
	rm -rf build build-cpu build-san build-fuzz train
