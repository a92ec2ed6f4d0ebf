#include "cli/sweep_inputs.h"

#include <algorithm>
#include <filesystem>
#include <sstream>

#include "base/content_hash.h"

namespace kvbound {
namespace {

namespace fs = std::filesystem;

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Every digit a double holds, so a changed float is a changed line.
std::string number_text(double value) {
  std::ostringstream out;
  out.precision(17);
  out << value;
  return out.str();
}

template <typename T>
std::string list_text(const std::vector<T>& values) {
  std::ostringstream out;
  out.precision(17);
  out << "[";
  for (std::size_t i = 0; i < values.size(); ++i) out << (i ? ", " : "") << values[i];
  out << "]";
  return out.str();
}

// `value` as a file whose bytes a step reads: itself when a regular file, a directory's regular files (sorted),
// nothing otherwise (a policy name, a number, a path that does not exist yet).
void add_files(const std::string& value, std::vector<std::string>& files) {
  std::error_code ec;
  if (value.empty()) return;
  if (fs::is_regular_file(value, ec)) {
    files.push_back(value);
  } else if (fs::is_directory(value, ec)) {
    std::vector<std::string> inside;
    for (const auto& e : fs::directory_iterator(value, ec))
      if (e.is_regular_file(ec)) inside.push_back(e.path().string());
    std::sort(inside.begin(), inside.end());
    files.insert(files.end(), inside.begin(), inside.end());
  }
}

}  // namespace

std::string sweep_step_inputs(const ConfigSchema& schema, const std::string& config_path,
                              const std::vector<std::string>& sets) {
  const Config config = Config::load(schema, config_path, sets);
  std::ostringstream out;
  std::vector<std::string> files;
  for (const ConfigKey& key : schema.keys()) {
    if (key.key == "model.threads" || ends_with(key.key, "out_dir")) continue;
    out << key.key << ": ";
    switch (key.type) {
      case ConfigType::Int: out << config.get_int(key.key); break;
      case ConfigType::Float: out << number_text(config.get_float(key.key)); break;
      case ConfigType::Bool: out << (config.get_bool(key.key) ? "true" : "false"); break;
      case ConfigType::String: {
        const std::string value = config.get_string(key.key);
        out << value;
        add_files(value, files);
        break;
      }
      case ConfigType::IntList: out << list_text(config.get_int_list(key.key)); break;
      case ConfigType::FloatList: out << list_text(config.get_float_list(key.key)); break;
      case ConfigType::StringList: {
        const std::vector<std::string> values = config.get_string_list(key.key);
        out << list_text(values);
        for (const std::string& v : values) add_files(v.substr(v.find('=') + 1), files);  // "NAME=PATH" or PATH
        break;
      }
    }
    out << "\n";
  }
  for (const std::string& file : files) out << "file " << file << " " << files_content_hash({file}) << "\n";
  return out.str();
}

std::string sweep_inputs_change(const std::string& recorded, const std::string& current) {
  if (recorded.empty()) return "no record of its inputs";
  if (recorded == current) return "";
  std::istringstream was(recorded), now(current);
  std::vector<std::string> old_lines;
  for (std::string line; std::getline(was, line);) old_lines.push_back(line);
  for (std::string line; std::getline(now, line);)
    if (std::find(old_lines.begin(), old_lines.end(), line) == old_lines.end()) return line;
  return "an input it had is gone";
}

}  // namespace kvbound
