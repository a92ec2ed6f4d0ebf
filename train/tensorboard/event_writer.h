// A TensorBoard event file, written with the protobuf library (train/tensorboard/tensorboard_event.proto):
// TFRecord records (uint64 length, masked CRC-32C of the length, one serialised Event, masked CRC-32C of it),
// the first holding file_version "brain.Event:2". Flushed after every event, so a crash loses at most the
// record being written (TensorBoard skips a truncated last record).
#pragma once
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "train/tensorboard/histogram.h"

namespace kvbound {

class EventWriter {
 public:
  // Creates DIR (and parents) and DIR/events.out.tfevents.<unix seconds>.kvbound; kvbound::Error naming it
  // when it cannot be written.
  explicit EventWriter(const std::string& dir);
  void scalar(const std::string& tag, std::int64_t step, double value);
  void histogram(const std::string& tag, std::int64_t step, const Histogram& histogram);
  const std::string& path() const { return path_; }

 private:
  void record(const std::string& event_bytes);
  std::string path_;
  std::ofstream out_;
};

}  // namespace kvbound
