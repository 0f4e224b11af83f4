// scratch_dir.h: where the tests write their files. Each test binary makes one directory under
// $TMPDIR (or /tmp), named loom_test_<binary>_XXXXXX by mkdtemp, and removes it with everything in
// it when it exits, so that a run of `make test` leaves nothing behind. LOOM_KEEP_TEST_FILES=1
// keeps it (its path is printed at exit) to look at the files of a failing test.
#pragma once
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace loom_test {

// the binary's scratch directory, made on first use
inline const std::string& scratch_root() {
  static const std::string root = [] {
    const char* t = std::getenv("TMPDIR");
    std::string name = "test";
    std::error_code ec;
    const std::string exe = std::filesystem::read_symlink("/proc/self/exe", ec).filename().string();
    if (!ec && !exe.empty() && exe.size() < 64) name = exe;
    std::string tmpl = std::string(t && *t ? t : "/tmp") + "/loom_" + name + "_XXXXXX";
    if (!mkdtemp(tmpl.data())) throw std::runtime_error("scratch_dir.h: cannot make " + tmpl);
    static pid_t owner = ::getpid();  // a forked child that exits must not remove it
    static std::string path = tmpl;  // made before the handler is registered, so alive when it runs
    std::atexit([] {
      if (::getpid() != owner) return;
      const char* keep = std::getenv("LOOM_KEEP_TEST_FILES");
      if (keep && keep[0] == '1') {
        std::fprintf(stderr, "test files kept in %s\n", path.c_str());
        return;
      }
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    });
    return tmpl;
  }();
  return root;
}

// a path inside the scratch directory, with nothing there (whatever a test left there before is
// removed); the caller creates the file or directory
inline std::string scratch_path(const std::string& name) {
  const std::string p = scratch_root() + "/" + name;
  std::error_code ec;
  std::filesystem::remove_all(p, ec);
  return p;
}

// an empty directory inside the scratch directory
inline std::string scratch_subdir(const std::string& name) {
  const std::string d = scratch_path(name);
  std::filesystem::create_directories(d);
  return d;
}

}  // namespace loom_test
