#include "base/config.h"

#include <fcntl.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <stdexcept>

#include "base/atomic_file.h"
#include "base/errors.h"
#include "base/fnv1a.h"

namespace kvbound {
namespace {

// ---- scalar parsing (strict: the whole text must be the value) ----

bool parse_int(const std::string& text, std::int64_t& out) {
  const char* begin = text.data();
  const char* end = begin + text.size();
  if (begin != end && *begin == '+') ++begin;  // from_chars rejects a leading '+'
  if (begin == end || (*begin == '-' && text[0] == '+')) return false;  // no "+-1"
  const auto [ptr, ec] = std::from_chars(begin, end, out);
  return ec == std::errc() && ptr == end;
}

bool parse_float(const std::string& text, double& out) {
  static const std::map<std::string, double> yaml_specials = {
      {".inf", INFINITY},   {".Inf", INFINITY},   {".INF", INFINITY},   {"+.inf", INFINITY},
      {"+.Inf", INFINITY},  {"+.INF", INFINITY},  {"-.inf", -INFINITY}, {"-.Inf", -INFINITY},
      {"-.INF", -INFINITY}, {".nan", NAN},        {".NaN", NAN},        {".NAN", NAN}};
  if (const auto it = yaml_specials.find(text); it != yaml_specials.end()) {
    out = it->second;
    return true;
  }
  const char* begin = text.data();
  const char* end = begin + text.size();
  if (begin != end && *begin == '+') ++begin;
  if (begin == end || (*begin == '-' && text[0] == '+')) return false;  // no "+-1"
  const auto [ptr, ec] = std::from_chars(begin, end, out, std::chars_format::general);
  return ec == std::errc() && ptr == end;
}

bool parse_bool(const std::string& text, bool& out) {
  if (text == "true" || text == "True" || text == "TRUE") {
    out = true;
    return true;
  }
  if (text == "false" || text == "False" || text == "FALSE") {
    out = false;
    return true;
  }
  return false;
}

// ---- YAML node -> typed value ----

// Why a node does not convert: `where` is appended to the key ("[2]" for a list element).
struct ConversionError {
  std::string where;
  std::string message;
};

std::string describe_node(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Scalar: return "'" + node.Scalar() + "'";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Map: return "a mapping";
    default: return "nothing";
  }
}

const char* expected_scalar(ConfigType element) {
  switch (element) {
    case ConfigType::Int: return "an integer";
    case ConfigType::Float: return "a float";
    case ConfigType::Bool: return "true or false";
    default: return "a string";
  }
}

template <typename T>
T convert_scalar(const YAML::Node& node, ConfigType element, const std::string& where) {
  const auto reject = [&]() -> T { throw ConversionError{where, std::string("expected ") + expected_scalar(element) + ", got " + describe_node(node)}; };
  if constexpr (std::is_same_v<T, std::string>) {
    if (node.IsNull()) return "";
    if (!node.IsScalar()) return reject();
    return node.Scalar();
  } else {
    if (!node.IsScalar()) return reject();
    T value{};
    bool ok = false;
    if constexpr (std::is_same_v<T, std::int64_t>) ok = parse_int(node.Scalar(), value);
    if constexpr (std::is_same_v<T, double>) ok = parse_float(node.Scalar(), value);
    if constexpr (std::is_same_v<T, bool>) ok = parse_bool(node.Scalar(), value);
    if (!ok) return reject();
    return value;
  }
}

template <typename T>
std::vector<T> convert_list(const YAML::Node& node, ConfigType element) {
  if (node.IsScalar()) {
    // A lone scalar is a one-element list; if it does not convert, say a list was expected.
    try {
      return {convert_scalar<T>(node, element, "")};
    } catch (const ConversionError&) {
      throw ConversionError{"", std::string("expected a list of ") + config_type_name(element) + "s like [1, 2], got " +
                                    describe_node(node)};
    }
  }
  if (!node.IsSequence())
    throw ConversionError{"", std::string("expected a list of ") + config_type_name(element) + "s, got " + describe_node(node)};
  std::vector<T> out;
  for (std::size_t i = 0; i < node.size(); ++i)
    out.push_back(convert_scalar<T>(node[i], element, "[" + std::to_string(i) + "]"));
  return out;
}

ConfigValue convert(const YAML::Node& node, ConfigType type) {
  switch (type) {
    case ConfigType::Int: return convert_scalar<std::int64_t>(node, type, "");
    case ConfigType::Float: return convert_scalar<double>(node, type, "");
    case ConfigType::Bool: return convert_scalar<bool>(node, type, "");
    case ConfigType::String: return convert_scalar<std::string>(node, type, "");
    case ConfigType::IntList: return convert_list<std::int64_t>(node, ConfigType::Int);
    case ConfigType::FloatList: return convert_list<double>(node, ConfigType::Float);
    case ConfigType::StringList: return convert_list<std::string>(node, ConfigType::String);
  }
  throw std::logic_error("kvbound::Config: unhandled ConfigType");
}

// ---- typed value -> YAML text ----

std::string float_text(double v) {
  if (std::isnan(v)) return ".nan";
  if (std::isinf(v)) return v > 0 ? ".inf" : "-.inf";
  char buf[64];
  const auto [ptr, ec] = std::to_chars(buf, buf + sizeof buf, v);  // shortest text that reads back exactly
  std::string s(buf, ptr);
  // YAML 1.1 readers (PyYAML) take a number without a '.' for an int or a string: "2" -> "2.0", "2e-04" -> "2.0e-04".
  if (s.find('.') == std::string::npos) s.insert(std::min(s.find('e'), s.size()), ".0");
  return s;
}

struct ValueText {
  std::string operator()(std::int64_t v) const { return std::to_string(v); }
  std::string operator()(double v) const { return float_text(v); }
  std::string operator()(bool v) const { return v ? "true" : "false"; }
  std::string operator()(const std::string& v) const { return yaml_quote(v); }
  template <typename T>
  std::string operator()(const std::vector<T>& list) const {
    std::string s = "[";
    for (std::size_t i = 0; i < list.size(); ++i) s += (i ? ", " : "") + (*this)(list[i]);
    return s + "]";
  }
};

std::string value_text(const ConfigValue& value) { return std::visit(ValueText{}, value); }

// ---- schema helpers ----

std::vector<std::string> split_dotted(const std::string& key) {
  std::vector<std::string> parts;
  std::size_t start = 0;
  for (std::size_t dot; (dot = key.find('.', start)) != std::string::npos; start = dot + 1)
    parts.push_back(key.substr(start, dot - start));
  parts.push_back(key.substr(start));
  return parts;
}

bool valid_key(const std::string& key) {
  for (const std::string& part : split_dotted(key)) {
    if (part.empty()) return false;
    for (const char c : part)
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') return false;
  }
  return true;
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

// Optimal string alignment distance: insertions, deletions, substitutions and adjacent transpositions
// ("bugdets") each cost one.
std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i)
    for (std::size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// The names directly under `prefix` ("" or "eval."), in the order they were first declared.
std::vector<std::string> child_names(const std::vector<ConfigKey>& keys, const std::string& prefix) {
  std::vector<std::string> names;
  for (const ConfigKey& k : keys) {
    if (!starts_with(k.key, prefix)) continue;
    const std::string rest = k.key.substr(prefix.size());
    const std::string name = rest.substr(0, rest.find('.'));
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  return names;
}

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

// What to tell a user about an undeclared key: the close name they probably meant; else, when a prefix of
// the key is a declared value, that it has no keys under it; else what the nearest section does hold.
std::string unknown_key_hint(const ConfigSchema& schema, const std::string& key) {
  const std::string close = schema.closest(key);
  if (!close.empty()) return "did you mean " + close + "?";
  for (std::size_t dot = key.rfind('.'); dot != std::string::npos && dot > 0; dot = key.rfind('.', dot - 1)) {
    const std::string prefix = key.substr(0, dot);
    if (const ConfigKey* leaf = schema.find(prefix))
      return prefix + " is a value (" + config_type_name(leaf->type) + "), not a section";
    if (schema.is_section(prefix)) return prefix + " has: " + joined(child_names(schema.keys(), prefix + "."));
  }
  return "top-level names: " + joined(child_names(schema.keys(), ""));
}

// ---- loading ----

// Where values come from: the YAML file (errors carry its line numbers) or the --set overrides.
struct Source {
  std::string name;
  bool is_file;
};

[[noreturn]] void fail_at(const Source& source, const YAML::Mark& mark, const std::string& key, const std::string& message) {
  const bool has_line = source.is_file && mark.line >= 0;
  fail(has_line ? source.name + ":" + std::to_string(mark.line + 1) : source.name, key, message);
}

class Loader {
 public:
  Loader(const ConfigSchema& schema, std::map<std::string, ConfigValue>& values) : schema_(schema), values_(values) {}

  // Stores `node` under the dotted `key`: a leaf's value, or a section's mapping of further keys.
  // `mark` locates the key in the file; `seen` holds the leaves this source has set (duplicate check).
  void assign(const Source& source, const std::string& key, const YAML::Node& node, const YAML::Mark& mark,
              std::set<std::string>* seen) {
    if (const ConfigKey* declared = schema_.find(key)) {
      if (seen && !seen->insert(key).second) fail_at(source, mark, key, "duplicate key");
      try {
        values_[key] = convert(node, declared->type);
      } catch (const ConversionError& e) {
        fail_at(source, node.IsNull() ? mark : node.Mark(), key + e.where, e.message);
      }
    } else if (schema_.is_section(key)) {
      if (node.IsNull()) return;  // "eval:" with nothing under it
      if (!node.IsMap())
        fail_at(source, node.Mark(), key, "expected a mapping of keys (a section), got " + describe_node(node));
      assign_mapping(source, key + ".", node, seen);
    } else {
      fail_at(source, mark, key, "unknown key (" + unknown_key_hint(schema_, key) + ")");
    }
  }

  void assign_mapping(const Source& source, const std::string& prefix, const YAML::Node& map, std::set<std::string>* seen) {
    std::set<std::string> names;  // YAML forbids a key twice in one mapping; yaml-cpp keeps both
    // Range-for binds the pair yaml-cpp returns by value; `it->first` would dangle (operator-> yields a temporary).
    for (const auto& entry : map) {
      const YAML::Node& name = entry.first;
      if (!name.IsScalar() || name.Scalar().empty())
        fail_at(source, name.Mark(), prefix.empty() ? "(top level)" : prefix.substr(0, prefix.size() - 1),
                "expected a key name, got " + describe_node(name));
      const std::string key = prefix + name.Scalar();
      if (!names.insert(name.Scalar()).second) fail_at(source, name.Mark(), key, "duplicate key");
      assign(source, key, entry.second, name.Mark(), seen);
    }
  }

 private:
  const ConfigSchema& schema_;
  std::map<std::string, ConfigValue>& values_;
};

std::string read_file(const std::string& path) {
  if (std::filesystem::is_directory(path)) fail(path, "", "is a folder, expected a YAML file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "", std::string("cannot open: ") + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail(path, "", std::string("cannot read: ") + std::strerror(errno));
  return text.str();
}

// The file's single YAML document (null for an empty file).
YAML::Node parse_file(const std::string& path) {
  const std::string text = read_file(path);
  std::vector<YAML::Node> documents;
  try {
    documents = YAML::LoadAll(text);
  } catch (const YAML::Exception& e) {
    fail(path + ":" + std::to_string(e.mark.line + 1), "",
         "YAML syntax error at column " + std::to_string(e.mark.column + 1) + ": " + e.msg);
  }
  if (documents.size() > 1) fail(path, "", "holds " + std::to_string(documents.size()) + " YAML documents, expected one");
  return documents.empty() ? YAML::Node() : documents[0];
}

// Appends the keys under `prefix` ("" or "eval.") as nested YAML, in the order of child_names, so a section
// is written once with all its keys.
void write_section(const std::vector<ConfigKey>& keys, const std::map<std::string, ConfigValue>& values,
                   const std::string& prefix, std::size_t indent, std::string& out) {
  for (const std::string& name : child_names(keys, prefix)) {
    out += std::string(indent, ' ') + name + ":";
    if (const auto it = values.find(prefix + name); it != values.end()) {
      out += " " + value_text(it->second) + "\n";
    } else {
      out += "\n";
      write_section(keys, values, prefix + name + ".", indent + 2, out);
    }
  }
}

}  // namespace

const char* config_type_name(ConfigType type) {
  switch (type) {
    case ConfigType::Int: return "int";
    case ConfigType::Float: return "float";
    case ConfigType::Bool: return "bool";
    case ConfigType::String: return "string";
    case ConfigType::IntList: return "int list";
    case ConfigType::FloatList: return "float list";
    case ConfigType::StringList: return "string list";
  }
  return "?";
}

std::string yaml_quote(const std::string& text) {
  static const char* hex = "0123456789abcdef";
  std::string s = "\"";
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      s += '\\';
      s += c;
    } else if (c == '\n') {
      s += "\\n";
    } else if (c == '\t') {
      s += "\\t";
    } else if (u < 0x20 || u == 0x7f) {
      s += "\\x";
      s += hex[u >> 4];
      s += hex[u & 15];
    } else {
      s += c;  // UTF-8 bytes pass through
    }
  }
  return s + "\"";
}

// ---- ConfigSchema ----

ConfigSchema& ConfigSchema::add(std::string key, ConfigType type, std::string default_yaml, std::string help) {
  declare({std::move(key), type, std::move(default_yaml), std::move(help), /*required=*/false});
  return *this;
}

ConfigSchema& ConfigSchema::add_required(std::string key, ConfigType type, std::string help) {
  declare({std::move(key), type, "", std::move(help), /*required=*/true});
  return *this;
}

void ConfigSchema::declare(ConfigKey declared) {
  const std::string& key = declared.key;
  if (!valid_key(key)) throw std::logic_error("kvbound::ConfigSchema: malformed key '" + key + "'");
  if (find(key)) throw std::logic_error("kvbound::ConfigSchema: " + key + " declared twice");
  if (is_section(key)) throw std::logic_error("kvbound::ConfigSchema: " + key + " is already a section");
  for (std::size_t dot = key.find('.'); dot != std::string::npos; dot = key.find('.', dot + 1))
    if (find(key.substr(0, dot)))
      throw std::logic_error("kvbound::ConfigSchema: " + key + " would make the key " + key.substr(0, dot) + " a section");
  if (!declared.required) {
    try {
      convert(YAML::Load(declared.default_yaml), declared.type);
    } catch (const ConversionError& e) {
      throw std::logic_error("kvbound::ConfigSchema: default of " + key + e.where + ": " + e.message);
    } catch (const YAML::Exception& e) {
      throw std::logic_error("kvbound::ConfigSchema: default of " + key + ": " + e.what());
    }
  }
  keys_.push_back(std::move(declared));
}

const ConfigKey* ConfigSchema::find(const std::string& key) const {
  for (const ConfigKey& k : keys_)
    if (k.key == key) return &k;
  return nullptr;
}

bool ConfigSchema::is_section(const std::string& prefix) const {
  for (const ConfigKey& k : keys_)
    if (k.key.size() > prefix.size() && k.key[prefix.size()] == '.' && starts_with(k.key, prefix)) return true;
  return false;
}

std::string ConfigSchema::closest(const std::string& unknown) const {
  const std::vector<std::string> unknown_parts = split_dotted(unknown);
  const std::string& unknown_leaf = unknown_parts.back();
  // Beyond this many edits the "suggestion" would be a guess: about one edit per three letters typed.
  const std::size_t max_score = std::max<std::size_t>(1, unknown_leaf.size() / 3);
  std::string best;
  std::size_t best_score = max_score + 1, best_full = std::numeric_limits<std::size_t>::max();
  std::set<std::string> considered;
  for (const ConfigKey& k : keys_) {
    // The key's name or section at the depth of `unknown` ("eval" or "eval.budgets" for "eval.budgets").
    const std::vector<std::string> parts = split_dotted(k.key);
    if (parts.size() < unknown_parts.size()) continue;
    std::string name = parts[0];
    for (std::size_t i = 1; i < unknown_parts.size(); ++i) name += "." + parts[i];
    if (!considered.insert(name).second) continue;
    const std::size_t full = edit_distance(unknown, name);
    const std::size_t leaf = edit_distance(unknown_leaf, parts[unknown_parts.size() - 1]) + 1;
    const std::size_t score = std::min(full, leaf);
    if (score < best_score || (score == best_score && full < best_full)) {
      best = name;
      best_score = score;
      best_full = full;
    }
  }
  return best;
}

std::string ConfigSchema::describe() const {
  std::size_t key_width = 0, default_width = 0;
  std::vector<std::string> defaults;
  for (const ConfigKey& k : keys_) {
    defaults.push_back(k.required ? "(required)" : value_text(convert(YAML::Load(k.default_yaml), k.type)));
    key_width = std::max(key_width, k.key.size());
    default_width = std::max(default_width, defaults.back().size());
  }
  std::string out;
  for (std::size_t i = 0; i < keys_.size(); ++i) {
    const ConfigKey& k = keys_[i];
    const std::string type = config_type_name(k.type);
    out += "  " + k.key + std::string(key_width - k.key.size() + 2, ' ') + type + std::string(13 - type.size(), ' ') +
           defaults[i];
    if (!k.help.empty()) out += std::string(default_width - defaults[i].size() + 2, ' ') + k.help;
    out += "\n";
  }
  return out;
}

// ---- Config ----

Config::Config(ConfigSchema schema, std::map<std::string, ConfigValue> values)
    : schema_(std::move(schema)), values_(std::move(values)) {}

Config Config::load(const ConfigSchema& schema, const std::string& yaml_path, const std::vector<std::string>& overrides) {
  std::map<std::string, ConfigValue> values;
  for (const ConfigKey& k : schema.keys())
    if (!k.required) values[k.key] = convert(YAML::Load(k.default_yaml), k.type);
  Loader loader(schema, values);

  if (!yaml_path.empty()) {
    const Source file{yaml_path, true};
    const YAML::Node root = parse_file(yaml_path);
    if (!root.IsNull() && !root.IsMap())
      fail_at(file, root.Mark(), "", "expected a mapping of keys at the top level, got " + describe_node(root));
    std::set<std::string> seen;
    if (root.IsMap()) loader.assign_mapping(file, "", root, &seen);
  }

  const Source command_line{"--set", false};
  for (const std::string& override : overrides) {
    const std::size_t eq = override.find('=');
    const std::string key = override.substr(0, eq);
    if (eq == std::string::npos || key.empty() || key.find_first_of(" \t") != std::string::npos)
      fail("--set", "'" + override + "'", "expected KEY=VALUE");
    const std::string text = override.substr(eq + 1);
    YAML::Node node;
    try {
      node = YAML::Load(text);
    } catch (const YAML::Exception& e) {
      fail("--set", key, "value '" + text + "' is not valid YAML: " + e.msg);
    }
    loader.assign(command_line, key, node, YAML::Mark::null_mark(), nullptr);
  }

  for (const ConfigKey& k : schema.keys())
    if (k.required && !values.count(k.key))
      fail(yaml_path.empty() ? "--set" : yaml_path, k.key,
           "required key is not set (set it in the YAML or with --set " + k.key + "=VALUE)");
  return Config(schema, std::move(values));
}

const ConfigValue& Config::value(const std::string& key, ConfigType requested) const {
  const ConfigKey* declared = schema_.find(key);
  if (!declared) throw std::logic_error("kvbound::Config: " + key + " is not declared in the schema");
  if (declared->type != requested)
    throw std::logic_error("kvbound::Config: " + key + " is declared as " + config_type_name(declared->type) +
                           ", read as " + config_type_name(requested));
  return values_.at(key);
}

std::int64_t Config::get_int(const std::string& key) const { return std::get<std::int64_t>(value(key, ConfigType::Int)); }
double Config::get_float(const std::string& key) const { return std::get<double>(value(key, ConfigType::Float)); }
bool Config::get_bool(const std::string& key) const { return std::get<bool>(value(key, ConfigType::Bool)); }
std::string Config::get_string(const std::string& key) const {
  return std::get<std::string>(value(key, ConfigType::String));
}
std::vector<std::int64_t> Config::get_int_list(const std::string& key) const {
  return std::get<std::vector<std::int64_t>>(value(key, ConfigType::IntList));
}
std::vector<double> Config::get_float_list(const std::string& key) const {
  return std::get<std::vector<double>>(value(key, ConfigType::FloatList));
}
std::vector<std::string> Config::get_string_list(const std::string& key) const {
  return std::get<std::vector<std::string>>(value(key, ConfigType::StringList));
}

std::string Config::to_yaml() const {
  std::string out;
  write_section(schema_.keys(), values_, "", 0, out);
  return out;
}

std::string Config::hash() const {
  Fnv1a h;
  h.add_raw(to_yaml());
  return h.hex();
}

void Config::write(const std::string& path) const { write_file_atomic(path, to_yaml()); }

std::vector<std::string> extract_overrides(int& argc, char** argv) {
  std::vector<std::string> overrides;
  int kept = 0;
  bool options_ended = false;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (!options_ended && arg == "--") options_ended = true;
    if (!options_ended && arg == "--set") {
      if (i + 1 == argc) fail("--set", "", "expected KEY=VALUE after --set");
      overrides.push_back(argv[++i]);
    } else if (!options_ended && starts_with(arg, "--set=")) {
      overrides.push_back(arg.substr(6));
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  argv[argc] = nullptr;
  return overrides;
}

}  // namespace kvbound
