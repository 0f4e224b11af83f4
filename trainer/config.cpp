// config.cpp: parsing, validation, overrides and dump of the run configuration.
// Values are kept as validated text (so `lr = 3e-4` dumps as written); getters convert.
#include "trainer/config.h"

#include "tensor/fileio.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <stdexcept>
#include <sys/stat.h>

namespace loom {

const char* to_string(ConfigType t) {
  switch (t) {
    case ConfigType::Int: return "int";
    case ConfigType::Float: return "float";
    case ConfigType::Bool: return "bool";
    case ConfigType::String: return "string";
  }
  return "?";
}

const ConfigKey* find_config_key(const std::string& section, const std::string& key) {
  for (const ConfigKey& k : config_schema())
    if (section == k.section && key == k.key) return &k;
  return nullptr;
}

namespace {

std::string trim(const std::string& s) {
  size_t a = s.find_first_not_of(" \t\r\n"), b = s.find_last_not_of(" \t\r\n");
  return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
}

std::vector<std::string> sections() {
  std::vector<std::string> out;
  for (const ConfigKey& k : config_schema())
    if (out.empty() || out.back() != k.section) out.push_back(k.section);
  return out;
}

bool is_section(const std::string& s) {
  for (const std::string& x : sections())
    if (x == s) return true;
  return false;
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); i++) out += (i ? sep : "") + v[i];
  return out;
}

std::string valid_sections() {
  return "valid sections: [" + join(sections(), "], [") + "] (each also as [section.cpu] / [section.cuda]: values for "
         "that device only)";
}

// "train.cuda" -> {"train", "cuda"}; a plain section -> {section, ""}.
std::pair<std::string, std::string> split_device_section(const std::string& header) {
  size_t dot = header.rfind('.');
  if (dot == std::string::npos) return {header, ""};
  return {header.substr(0, dot), header.substr(dot + 1)};
}

std::string valid_keys(const std::string& section) {
  std::vector<std::string> keys;
  for (const ConfigKey& k : config_schema())
    if (section == k.section) keys.push_back(k.key);
  return "valid keys of [" + section + "]: " + join(keys, ", ");
}

[[noreturn]] void fail(const std::string& where, const std::string& what) {
  throw std::runtime_error(where + ": " + what);
}

// Strip a trailing `# comment` that is not inside double quotes.
std::string strip_comment(const std::string& line) {
  bool quoted = false;
  for (size_t i = 0; i < line.size(); i++) {
    if (line[i] == '"') quoted = !quoted;
    if (line[i] == '#' && !quoted) return line.substr(0, i);
  }
  return line;
}

bool parse_bool(const std::string& s, bool* out) {
  if (s == "true" || s == "1" || s == "yes" || s == "on") return *out = true, true;
  if (s == "false" || s == "0" || s == "no" || s == "off") return *out = false, true;
  return false;
}

// Validate `raw` (file syntax, already trimmed) for `k`; return the stored text.
std::string validate(const ConfigKey& k, const std::string& raw, const std::string& where) {
  std::string v = raw;
  std::string name = std::string("[") + k.section + "] " + k.key;
  if (!v.empty() && v.front() == '"') {
    if (v.size() < 2 || v.back() != '"') fail(where, "unterminated quoted value for key " + name + ": " + raw);
    v = v.substr(1, v.size() - 2);
  }
  if (v.find('"') != std::string::npos)
    fail(where, "value of key " + name + " contains a double quote: " + raw);
  for (char c : v)  // a value is one line of text (dump() writes it back as one)
    if ((unsigned char)c < 0x20 && c != '\t')
      fail(where, "value of key " + name + " contains a control character (byte " + std::to_string(int((unsigned char)c)) + ")");
  int64_t i;
  double f;
  bool b;
  switch (k.type) {
    case ConfigType::Int:
      if (!parse_int(v, &i)) fail(where, "bad int value '" + v + "' for key " + name + " (" + k.help + ")");
      break;
    case ConfigType::Float:
      if (!parse_float(v, &f)) fail(where, "bad float value '" + v + "' for key " + name + " (" + k.help + ")");
      break;
    case ConfigType::Bool:
      if (!parse_bool(v, &b))
        fail(where, "bad bool value '" + v + "' for key " + name + " (expected true/false, yes/no, on/off or 1/0)");
      v = b ? "true" : "false";
      break;
    case ConfigType::String:
      if (k.choices) {
        std::string c = std::string("|") + k.choices + "|";
        if (v.empty() || v.find('|') != std::string::npos || c.find("|" + v + "|") == std::string::npos)
          fail(where, "bad value '" + v + "' for key " + name + " (one of " + k.choices + ")");
      }
      break;
  }
  return v;
}

bool file_exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string dirname_of(const std::string& p) {
  size_t s = p.find_last_of('/');
  return s == std::string::npos ? std::string(".") : (s == 0 ? std::string("/") : p.substr(0, s));
}

}  // namespace

bool parse_int(const std::string& s, int64_t* out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end != s.c_str() + s.size()) return false;  // all of it (a NUL inside is not an end)
  *out = v;
  return true;
}

bool parse_float(const std::string& s, double* out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (errno != 0 || end != s.c_str() + s.size() || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

Config::Config() {
  for (const ConfigKey& k : config_schema()) values_[std::string(k.section) + "." + k.key] = k.def;
}

std::string Config::resolve_path(const std::string& name) {
  if (name.find('/') != std::string::npos) {
    if (!file_exists(name)) throw std::runtime_error(name + ": config file not found");
    return name;
  }
  std::vector<std::string> dirs = {"configs"};
  char exe[4096];
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    exe[n] = '\0';
    std::string bin = dirname_of(exe);  // build/ when the executable is build/train
    dirs.push_back(bin + "/configs");
    dirs.push_back(dirname_of(bin) + "/configs");
  }
  std::vector<std::string> names = {name};
  if (name.find('.') == std::string::npos) names.push_back(name + ".cfg");
  std::vector<std::string> tried;
  for (const std::string& nm : names)
    for (const std::string& d : dirs) {
      std::string p = d + "/" + nm;
      if (file_exists(p)) return p;
      tried.push_back(p);
    }
  if (file_exists(name)) return name;  // a file in the working directory
  tried.push_back(name);
  throw std::runtime_error(name + ": config file not found (tried " + join(tried, ", ") + ")");
}

Config Config::parse(const std::string& text, const std::string& origin) {
  Config c;
  c.source_ = origin;  // error messages of later checks name the text too (e.g. a checkpoint's trainer.json)
  std::map<std::string, int> seen;  // "section.key" -> line of first definition
  std::string section;
  std::istringstream in(text);
  std::string raw;
  for (int lineno = 1; std::getline(in, raw); lineno++) {
    std::string where = origin + ":" + std::to_string(lineno);
    std::string line = trim(strip_comment(raw));
    if (line.empty()) continue;
    if (line.front() == '[') {
      if (line.back() != ']') fail(where, "unterminated section header '" + line + "'; " + valid_sections());
      section = trim(line.substr(1, line.size() - 2));
      auto [base, dev] = split_device_section(section);
      if (!is_section(base)) fail(where, "unknown section [" + section + "]; " + valid_sections());
      if (!dev.empty() && dev != "cpu" && dev != "cuda")
        fail(where, "unknown device '" + dev + "' in section [" + section + "] (a device section is [" + base +
                        ".cpu] or [" + base + ".cuda])");
      continue;
    }
    size_t eq = line.find('=');
    if (eq == std::string::npos) {
      std::string key = trim(line);
      fail(where, "missing '=' after key '" + key + "' (expected key = value)" +
                      (section.empty() ? "; " + valid_sections() : "; " + valid_keys(section)));
    }
    std::string key = trim(line.substr(0, eq)), value = trim(line.substr(eq + 1));
    if (section.empty()) fail(where, "key '" + key + "' before any [section] header; " + valid_sections());
    auto [base, dev] = split_device_section(section);
    if (key.empty()) fail(where, "empty key before '=' in [" + section + "]; " + valid_keys(base));
    const ConfigKey* k = find_config_key(base, key);
    if (!k) fail(where, "unknown key '" + key + "' in [" + section + "]; " + valid_keys(base));
    if (!dev.empty() && base == "train" && key == "device")
      fail(where, "train.device in [" + section + "]: the device a run uses cannot depend on the device");
    auto it = seen.find(section + "." + key);
    if (it != seen.end())
      fail(where, "duplicate key '" + key + "' in [" + section + "] (first set at line " +
                      std::to_string(it->second) + ")");
    seen[section + "." + key] = lineno;
    std::string v = validate(*k, value, where);
    if (dev.empty()) c.values_[base + "." + key] = v;
    else c.device_values_.push_back({dev, base + "." + key, v});
  }
  return c;
}

Config Config::load(const std::string& path_or_name, const std::vector<std::string>& overrides) {
  std::string path = resolve_path(path_or_name);
  std::ifstream f(path);
  if (!f) throw std::runtime_error(path + ": cannot open config file");
  std::stringstream ss;
  ss << f.rdbuf();
  Config c = parse(ss.str(), path);
  c.source_ = path;
  for (const std::string& o : overrides) c.apply_override(o);
  validate_config(c);
  return c;
}

std::vector<std::string> Config::apply_device_sections(const std::string& device) {
  if (device != "cpu" && device != "cuda") fail("config", "apply_device_sections: device '" + device + "' (cpu, cuda)");
  std::vector<std::string> applied;
  for (const DeviceValue& d : device_values_) {
    if (d.device != device) continue;
    if (std::find(from_command_line_.begin(), from_command_line_.end(), d.dotted) != from_command_line_.end()) continue;
    values_[d.dotted] = d.value;
    size_t dot = d.dotted.find('.');
    applied.push_back("[" + d.dotted.substr(0, dot) + "." + device + "] " + d.dotted.substr(dot + 1) + " = " + d.value);
  }
  device_values_.clear();  // applied once: the resolved config has no device sections left
  device_applied_ = applied;
  validate_config(*this);
  return applied;
}

// arg with bytes below 0x20 (but tab) written as \xNN, for messages that name it
static std::string printable(const std::string& arg) {
  std::string out;
  char b[8];
  for (char c : arg)
    if ((unsigned char)c < 0x20 && c != '\t') std::snprintf(b, sizeof b, "\\x%02x", (unsigned char)c), out += b;
    else out += c;
  return out;
}

void Config::apply_override(const std::string& arg) {
  std::string where = "command line override '" + printable(arg) + "'";
  std::string s = arg;
  while (!s.empty() && s.front() == '-') s.erase(0, 1);
  size_t eq = s.find('=');
  if (eq == std::string::npos) fail(where, "missing '=' (expected --section.key=value)");
  std::string dotted = trim(s.substr(0, eq));
  size_t dot = dotted.find('.');
  if (dot == std::string::npos)
    fail(where, "key '" + dotted + "' has no section (expected --section.key=value); " + valid_sections());
  std::string section = dotted.substr(0, dot), key = dotted.substr(dot + 1);
  if (!is_section(section)) fail(where, "unknown section [" + section + "]; " + valid_sections());
  set(dotted, trim(s.substr(eq + 1)), where);
  from_command_line_.push_back(dotted);
}

void Config::set(const std::string& dotted, const std::string& value, const std::string& where) {
  size_t dot = dotted.find('.');
  std::string section = dot == std::string::npos ? dotted : dotted.substr(0, dot);
  std::string key = dot == std::string::npos ? std::string() : dotted.substr(dot + 1);
  if (!is_section(section)) fail(where, "unknown section [" + section + "]; " + valid_sections());
  const ConfigKey* k = find_config_key(section, key);
  if (!k) fail(where, "unknown key '" + key + "' in [" + section + "]; " + valid_keys(section));
  values_[dotted] = validate(*k, trim(value), where);
}

const ConfigKey& Config::key_or_throw(const std::string& dotted, ConfigType want) const {
  size_t dot = dotted.find('.');
  std::string section = dot == std::string::npos ? dotted : dotted.substr(0, dot);
  std::string key = dot == std::string::npos ? std::string() : dotted.substr(dot + 1);
  std::string where = source_.empty() ? "config" : source_;
  if (!is_section(section)) fail(where, "get of unknown section [" + section + "]; " + valid_sections());
  const ConfigKey* k = find_config_key(section, key);
  if (!k) fail(where, "get of unknown key '" + key + "' in [" + section + "]; " + valid_keys(section));
  if (k->type != want)
    fail(where, "key " + dotted + " is " + to_string(k->type) + ", read as " + to_string(want));
  return *k;
}

int64_t Config::get_int64(const std::string& dotted) const {
  key_or_throw(dotted, ConfigType::Int);
  int64_t v = 0;
  parse_int(values_.at(dotted), &v);
  return v;
}

int Config::get_int(const std::string& dotted) const {
  int64_t v = get_int64(dotted);
  if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max())
    fail(source_.empty() ? "config" : source_, "key " + dotted + " = " + std::to_string(v) + " does not fit an int");
  return int(v);
}

double Config::get_float(const std::string& dotted) const {
  key_or_throw(dotted, ConfigType::Float);
  double v = 0;
  parse_float(values_.at(dotted), &v);
  return v;
}

bool Config::get_bool(const std::string& dotted) const {
  key_or_throw(dotted, ConfigType::Bool);
  return values_.at(dotted) == "true";
}

std::string Config::get_str(const std::string& dotted) const {
  key_or_throw(dotted, ConfigType::String);
  return values_.at(dotted);
}

std::string Config::dump() const {
  std::ostringstream out;
  out << "# resolved config (schema defaults < " << (source_.empty() ? "no file" : source_)
      << " < command-line overrides)\n";
  for (const std::string& a : device_applied_) out << "# device section: " << a << "\n";
  std::string section;
  for (const ConfigKey& k : config_schema()) {
    if (section != k.section) {
      section = k.section;
      out << (out.tellp() > 0 ? "\n" : "") << "[" << section << "]\n";
    }
    const std::string& v = values_.at(section + "." + k.key);
    bool quote = k.type == ConfigType::String &&
                 (v.empty() || v.find('#') != std::string::npos || v != trim(v));
    std::string line = std::string(k.key) + " = " + (quote ? "\"" + v + "\"" : v);
    if (line.size() < 32) line.resize(32, ' ');
    out << line << "  # " << k.help << "\n";
  }
  return out.str();
}

void Config::save(const std::string& path) const {
  std::string text = dump();
  write_file_atomic(path, {{text.data(), text.size()}});
}

}  // namespace loom
