// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of TFRecord files (TensorBoard event
// logs), and its "masked" form that TFRecord stores. Checked against the RFC 3720 test vectors.
#pragma once
#include <cstdint>
#include <string_view>

namespace kvbound {

std::uint32_t crc32c(std::string_view bytes);
// ((crc >> 15) | (crc << 17)) + 0xa282ead8: TFRecord masks stored CRCs so that a CRC of data holding CRCs stays
// well distributed.
std::uint32_t masked_crc32c(std::string_view bytes);

}  // namespace kvbound
