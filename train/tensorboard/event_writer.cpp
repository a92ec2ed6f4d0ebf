#include "train/tensorboard/event_writer.h"

#include <chrono>
#include <filesystem>

#include "base/crc32c.h"
#include "base/errors.h"
#include "tensorboard_event.pb.h"

namespace kvbound {
namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string little_endian(std::uint64_t value, int bytes) {
  std::string out(static_cast<std::size_t>(bytes), '\0');
  for (int i = 0; i < bytes; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((value >> (8 * i)) & 0xFF);
  return out;
}

}  // namespace

EventWriter::EventWriter(const std::string& dir) {
  std::filesystem::create_directories(dir);
  path_ = (std::filesystem::path(dir) / ("events.out.tfevents." + std::to_string(static_cast<long long>(now_seconds())) +
                                         ".kvbound")).string();
  out_.open(path_, std::ios::binary | std::ios::trunc);
  if (!out_) fail(path_, "", "cannot write the TensorBoard event file");
  tensorboard::Event first;
  first.set_wall_time(now_seconds());
  first.set_file_version("brain.Event:2");
  record(first.SerializeAsString());
}

void EventWriter::scalar(const std::string& tag, std::int64_t step, double value) {
  tensorboard::Event e;
  e.set_wall_time(now_seconds());
  e.set_step(step);
  tensorboard::Summary::Value* v = e.mutable_summary()->add_value();
  v->set_tag(tag);
  v->set_simple_value(static_cast<float>(value));
  record(e.SerializeAsString());
}

void EventWriter::histogram(const std::string& tag, std::int64_t step, const Histogram& h) {
  tensorboard::Event e;
  e.set_wall_time(now_seconds());
  e.set_step(step);
  tensorboard::Summary::Value* v = e.mutable_summary()->add_value();
  v->set_tag(tag);
  tensorboard::HistogramProto* p = v->mutable_histo();
  p->set_min(h.min);
  p->set_max(h.max);
  p->set_num(h.num);
  p->set_sum(h.sum);
  p->set_sum_squares(h.sum_squares);
  for (double x : h.bucket_limit) p->add_bucket_limit(x);
  for (double x : h.bucket) p->add_bucket(x);
  record(e.SerializeAsString());
}

void EventWriter::record(const std::string& event_bytes) {
  const std::string length = little_endian(event_bytes.size(), 8);
  out_ << length << little_endian(masked_crc32c(length), 4) << event_bytes << little_endian(masked_crc32c(event_bytes), 4);
  out_.flush();
  if (!out_) fail(path_, "", "write failed");
}

}  // namespace kvbound
