// fileio.h: durable file writes. A write that fails (ENOSPC, EIO, EFBIG) throws naming the
// file and the system's reason, and never leaves a half-written file under the final name.
//
//   write_file_atomic(dir + "/model.safetensors", {{header.data(), header.size()}, ...});
//
// The bytes go to PATH.tmp, are fsync'ed, renamed to PATH, and the folder is fsync'ed so the
// rename itself survives a power cut (rename is atomic; without the folder's fsync it may
// not yet be on the disk).
#pragma once
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace loom {

using ByteSpan = std::pair<const void*, size_t>;

// Writes the pieces, in order, to path (through path + ".tmp"); throws on any failure.
void write_file_atomic(const std::string& path, const std::vector<ByteSpan>& pieces);
// fsync a folder (after a rename or an unlink in it); throws on failure.
void fsync_dir(const std::string& dir);
// fsync an open file by its path (for files written with stdio/iostreams); throws on failure.
void fsync_path(const std::string& path);
// The folder part of a path ("." when none).
std::string parent_dir(const std::string& path);

}  // namespace loom
