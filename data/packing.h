// packing.h: sequence packing for VLM training. Several samples share one row of row_len
// tokens; attention stays inside each sample (cu_seqlens), positions restart at 0 in each
// sample, and no next-token target crosses a sample boundary (SPEC section 1, "Packed rows").
//
//   row r, flattened offset r*row_len:  [ sample a | sample b | sample c | pad pad pad ]
//   cu_seqlens:                         0        a        a+b     a+b+c          row_len ...
//
// Each padding run is its own segment, so the segments tile every row and a varlen
// attention kernel needs no special case for padding (a padded query attends to padding of
// its own run only; its target is -100, so it never reaches the loss).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace loom {

// One tokenized training sample. labels are unshifted: labels[t] == ids[t] where token t is
// trained (the answer and its end token), -100 elsewhere (image tokens, prompt). Image tokens
// are already expanded (one id per image token). image: index of the sample's image, or -1.
struct Sample {
  std::vector<int32_t> ids;
  std::vector<int32_t> labels;
  int image = -1;
};

struct PackedBatch {
  int rows = 0, row_len = 0;
  std::vector<int32_t> ids, targets, pos;  // [rows*row_len]; targets already shifted
  std::vector<int32_t> cu_seqlens;         // offsets into the flattened rows; padding runs are segments
  int max_seqlen = 0;                      // longest segment (padding runs included)
  std::vector<int32_t> images;             // sample image indices in order of appearance
  std::vector<int32_t> image_positions;    // flattened positions of the image_token ids, in order
  int64_t real_tokens = 0, target_tokens = 0;
};

// Best-fit decreasing: samples in order of decreasing length (ties: lower index first), each
// into the open row with the least room that still fits it, else a new row. Returns rows of
// sample indices. Lengths above max_len (and lengths <= 0) are left out: the caller counts them.
std::vector<std::vector<int>> pack_best_fit(const std::vector<int>& lengths, int max_len);

// Lay out rows of samples. Throws when a row's samples exceed row_len, when labels and ids
// differ in length, or when a sample without an image holds image_token.
PackedBatch build_batch(const std::vector<std::vector<const Sample*>>& rows, int row_len, int32_t pad_id,
                        int32_t image_token);

// Rounds the host-side shapes of a batch so that different batches share them (the CUDA
// trainer captures one graph per shape, trainer.cpp): cu_seqlens grows to a multiple of
// seq_multiple sequences by empty ones at the end (cu_seqlens' last offset repeated) and
// max_seqlen to a multiple of len_multiple, at most row_len. Tokens, targets and the layout
// stay as they are, so attention and the loss compute the same values.
void round_batch_shapes(PackedBatch& b, int seq_multiple, int len_multiple);

// How well a packing did, and the two log lines of an epoch.
struct PackingStats {
  int64_t samples = 0;       // samples placed
  int64_t rows = 0;          // rows used
  int64_t real_tokens = 0;   // tokens of the placed samples
  int64_t too_long = 0;      // samples longer than a row: skipped
  int max_len = 0;           // row length
  // Compression: samples per row (the number of padded rows packing replaces per row).
  double compression() const { return rows ? double(samples) / double(rows) : 0.0; }
  // Padding waste before packing is defined as every sample padded to its own row of
  // max_len (pack_max_length) tokens; after: the rows actually used.
  double waste_before() const { return samples ? 1.0 - double(real_tokens) / (double(samples) * max_len) : 0.0; }
  double waste_after() const { return rows ? 1.0 - double(real_tokens) / (double(rows) * max_len) : 0.0; }
  // "Sequence packing: 10000 → 5500 sequences\nCompression: 1.82x, Padding waste: 52.3% → 15.7%"
  std::string log_lines() const;
};

// Rows of sample indices for one epoch: best-fit packing, or (packing off) one sample per row
// in the given order. Samples longer than row_len are skipped and counted in stats->too_long,
// or, with strict, a std::runtime_error naming the sample and its length.
std::vector<std::vector<int>> plan_rows(const std::vector<Sample>& samples, int row_len, bool packing,
                                        bool strict = false, PackingStats* stats = nullptr);

// Packed rows read from a text file (data.synth_rows): one row a line, the lengths in tokens of
// its samples separated by spaces or commas; blank lines and text after '#' are ignored. Throws
// a std::runtime_error naming the file and line for a field that is not a whole number, a
// sample of min_len tokens or fewer, a row of more than row_len tokens, and a file without rows.
std::vector<std::vector<int>> read_row_lengths(const std::string& path, int min_len, int row_len);
// The same over the file's text; `name` is the file named in the errors.
std::vector<std::vector<int>> parse_row_lengths(const std::string& text, const std::string& name, int min_len,
                                                int row_len);
// build_batch over rows of indices into `samples` (e.g. a slice of plan_rows' result).
PackedBatch build_batch(const std::vector<Sample>& samples, const std::vector<std::vector<int>>& rows, int row_len,
                        int32_t pad_id, int32_t image_token);

}  // namespace loom
