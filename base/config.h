// Typed configuration for `kvbound eval` / `kvbound train`: a recipe's YAML file plus dotted command-line
// overrides (`--set train.lr=1e-4`), validated against a schema that declares every key a command accepts.
//
// Rules (the user-facing contract):
// - Nested YAML maps flatten to dotted keys (`eval: {budgets: ...}` is `eval.budgets`); a YAML key may also
//   be written dotted (`eval.budgets: [64]`). A key the schema does not declare is an error that names the
//   closest declared key; so is a key written twice in one file.
// - Override values are YAML: `x=3`, `x=[64, 128]`, `x="a b"`. Later overrides win over earlier ones, which
//   win over the file, which wins over the defaults.
// - Int: an integer (no fraction, no exponent). Float: any number, YAML's .inf/.nan included.
//   Bool: true/false (True/TRUE/False/FALSE); yes/no/on/off/0/1 are rejected.
//   String: any scalar, taken as written; an empty value or null is the empty string.
//   Lists: a YAML list of elements of that type, or a single scalar meaning a one-element list
//   (`--set eval.budgets=64` is `[64]`); null is not a list, write `[]` for an empty one.
// - Errors are kvbound::Error, one line: "FILE:LINE: KEY: what is wrong" for the YAML file,
//   "--set: KEY: what is wrong" for an override.
// Asking for an undeclared key, or for a key as the wrong type, is a programming error: std::logic_error.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

namespace kvbound {

// The order matches ConfigValue's alternatives.
enum class ConfigType { Int, Float, Bool, String, IntList, FloatList, StringList };

using ConfigValue = std::variant<std::int64_t, double, bool, std::string, std::vector<std::int64_t>,
                                 std::vector<double>, std::vector<std::string>>;

// "int", "float", "bool", "string", "int list", "float list", "string list".
const char* config_type_name(ConfigType type);

struct ConfigKey {
  std::string key;           // dotted: "eval.budgets"
  ConfigType type;
  std::string default_yaml;  // YAML text of the default ("[64, 128]"); unused when required
  std::string help;
  bool required = false;
};

// Every key a command accepts, declared once. Declaring a malformed key (components other than
// [A-Za-z0-9_]), a key twice, a key that is also a section of another key, or a default that does not
// parse as the key's type throws std::logic_error.
class ConfigSchema {
 public:
  ConfigSchema& add(std::string key, ConfigType type, std::string default_yaml, std::string help);
  ConfigSchema& add_required(std::string key, ConfigType type, std::string help);

  const std::vector<ConfigKey>& keys() const { return keys_; }  // in declaration order
  const ConfigKey* find(const std::string& key) const;
  // Whether `prefix` is a section, i.e. some key starts with "prefix.".
  bool is_section(const std::string& prefix) const;
  // The declared key or section that `unknown` is probably a typo of: among names with as many dotted
  // components, the one with the smallest edit distance over the whole name, or over the last component
  // plus one (so a leaf placed under the wrong section is still found). Empty when nothing is within about
  // one edit per three letters of the last component.
  std::string closest(const std::string& unknown) const;
  // One line per key, in declaration order: key, type, default (or "(required)"), help. For --help.
  std::string describe() const;

 private:
  void declare(ConfigKey key);

  std::vector<ConfigKey> keys_;
};

class Config {
 public:
  // Defaults, then `yaml_path` (empty: none), then each "KEY=VALUE" override in order; then every required
  // key must have a value.
  static Config load(const ConfigSchema& schema, const std::string& yaml_path,
                     const std::vector<std::string>& overrides);

  std::int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;
  bool get_bool(const std::string& key) const;
  std::string get_string(const std::string& key) const;
  std::vector<std::int64_t> get_int_list(const std::string& key) const;
  std::vector<double> get_float_list(const std::string& key) const;
  std::vector<std::string> get_string_list(const std::string& key) const;

  // The resolved config as nested YAML: every key, defaults included, in declaration order; strings
  // double-quoted, floats in shortest round-trip form. Loading it back gives the same config.
  std::string to_yaml() const;
  // FNV-1a 64 of to_yaml(), 16 lowercase hex digits: identifies the resolved config in exports.
  std::string hash() const;
  // Writes to_yaml() to `path` with write_file_atomic (missing folders created; temp file, fsync, rename).
  void write(const std::string& path) const;

 private:
  Config(ConfigSchema schema, std::map<std::string, ConfigValue> values);
  const ConfigValue& value(const std::string& key, ConfigType requested) const;

  ConfigSchema schema_;
  std::map<std::string, ConfigValue> values_;
};

// Removes every "--set KEY=VALUE" and "--set=KEY=VALUE" from argv (before a bare "--"), compacting argv and
// argc, and returns the values in order. Commands call it before cxxopts parses the rest, because
// cxxopts splits vector options at commas and would break `--set eval.budgets=[64,128]`.
std::vector<std::string> extract_overrides(int& argc, char** argv);

// `text` as a double-quoted, escaped YAML scalar: for defaults computed at run time (paths).
std::string yaml_quote(const std::string& text);

}  // namespace kvbound
