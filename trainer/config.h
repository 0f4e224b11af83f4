// config.h: the run configuration. An INI-like file validated against one schema table
// (config_schema.cpp), plus command-line overrides.
//
//   # comment                     a line comment; `#` after a value starts a comment too
//   [train]                       a section header
//   lr = 3e-4                     key = value (strings may be quoted: path = "a b.png")
//   [train.cuda]                  a device section: its values replace [train]'s when the run
//   steps = 12000                 is on that device (.cuda or .cpu); the command line still wins
//
//   Config c = Config::load("vlm_sft.cfg", {"--train.lr=1e-3"});
//   int steps = c.get_int("train.steps");
//
// Every error (std::runtime_error) names the file, the line and the key and lists the valid
// keys of the section (or the valid sections), so a typo is fixed from the message alone.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace loom {

enum class ConfigType { Int, Float, Bool, String };
const char* to_string(ConfigType t);

// One row of the schema: the source of the valid sections and keys.
struct ConfigKey {
  const char* section;
  const char* key;
  ConfigType type;
  const char* def;      // default, in file syntax ("" = empty string)
  const char* help;     // one line
  const char* choices;  // for strings: "a|b|c" restricts the value; nullptr = free text
};

// The schema table, in the order `dump()` writes it.
const std::vector<ConfigKey>& config_schema();
// The row for "section.key", or nullptr.
const ConfigKey* find_config_key(const std::string& section, const std::string& key);

class Config;
// Every key's constraints (ranges, divisibility, combinations of keys; config_rules.cpp).
// Throws one std::runtime_error listing each broken rule as "key = value: rule".
// Config::load calls it after the overrides.
void validate_config(const Config& c);

// A number that is the whole of s (nothing after it, no NUL inside, in range; floats finite),
// as config values are read; false otherwise. Also for command-line options.
bool parse_int(const std::string& s, int64_t* out);
bool parse_float(const std::string& s, double* out);

class Config {
 public:
  // Every key at its default.
  Config();

  // Load a file, then apply overrides ("--section.key=value"), then validate_config(). A bare name (no '/') is looked
  // up in configs/ (./configs/NAME, then configs/ beside or above the executable's folder);
  // ".cfg" is appended when the name has no extension and the plain name is not found.
  static Config load(const std::string& path_or_name, const std::vector<std::string>& overrides = {});
  // Parse file text; `origin` names the text in error messages.
  static Config parse(const std::string& text, const std::string& origin);
  // The file a name resolves to (throws, listing the places tried, when none exists).
  static std::string resolve_path(const std::string& path_or_name);

  // Apply one "--section.key=value" (the leading dashes are optional).
  void apply_override(const std::string& arg);
  // The values of the file's device sections ([train.cuda], [model.cpu], ...) for a run on
  // `device` ("cpu" or "cuda"): each replaces the file's value of its key unless the command
  // line set that key. Validates the result (validate_config) and returns the applied
  // "section.key = value" lines, which dump() also lists in its header.
  std::vector<std::string> apply_device_sections(const std::string& device);
  // Set "section.key" from text in file syntax; `where` prefixes error messages.
  void set(const std::string& dotted_key, const std::string& value, const std::string& where = "set");

  int get_int(const std::string& dotted_key) const;
  int64_t get_int64(const std::string& dotted_key) const;
  double get_float(const std::string& dotted_key) const;
  bool get_bool(const std::string& dotted_key) const;
  std::string get_str(const std::string& dotted_key) const;

  // The resolved config in file format: every key of the schema, overrides applied.
  std::string dump() const;
  // Every key's value: "section.key" -> value (validated, unquoted)
  const std::map<std::string, std::string>& values() const { return values_; }
  void save(const std::string& path) const;
  // The file this config was loaded from, the origin of parsed text ("" for defaults).
  const std::string& source() const { return source_; }

 private:
  const ConfigKey& key_or_throw(const std::string& dotted_key, ConfigType want) const;
  std::map<std::string, std::string> values_;  // "section.key" -> value (validated, unquoted)
  std::string source_;
  struct DeviceValue {
    std::string device, dotted, value;
  };
  std::vector<DeviceValue> device_values_;  // from [section.cpu] / [section.cuda], in file order
  std::vector<std::string> from_command_line_, device_applied_;
};

}  // namespace loom
