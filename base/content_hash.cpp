#include "base/content_hash.h"

#include <string_view>

#include "base/fnv1a.h"
#include "base/mapped_file.h"

namespace kvbound {

std::string files_content_hash(const std::vector<std::string>& paths) {
  Fnv1a hash;
  for (const std::string& path : paths) {
    const auto file = MappedFile::open(path);
    hash.add(std::string_view(reinterpret_cast<const char*>(file->data()), file->size()));
  }
  return "fnv1a64:" + hash.hex();
}

}  // namespace kvbound
