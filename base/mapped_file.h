// Read-only memory map of a whole file. Weights are viewed in place (zero copy) where the
// on-disk dtype is the compute dtype; the mapping lives as long as any tensor that views it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace kvbound {

class MappedFile {
 public:
  // Throws kvbound::Error naming the path when the file cannot be opened or mapped.
  static std::shared_ptr<const MappedFile> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::uint8_t* data() const { return data_; }
  std::size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // Drops the resident pages wholly inside [begin, begin + size) (e.g. quantized weights already
  // decoded into their own memory). Reading them again re-faults them from the file, so views stay valid.
  void release(const std::uint8_t* begin, std::size_t size) const;

 private:
  MappedFile(std::string path, const std::uint8_t* data, std::size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const std::uint8_t* data_;
  std::size_t size_;
};

}  // namespace kvbound
