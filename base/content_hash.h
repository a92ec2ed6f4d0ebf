// A fingerprint of files' bytes, "fnv1a64:<16 hex digits>" over each file's size and content in order: it
// identifies a model's weights across machines and paths (exports carry it next to the model's name). Not
// cryptographic: it only has to change when the bytes do.
#pragma once
#include <string>
#include <vector>

namespace kvbound {

// kvbound::Error naming the file when one cannot be read.
std::string files_content_hash(const std::vector<std::string>& paths);

}  // namespace kvbound
