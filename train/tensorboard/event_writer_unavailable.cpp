// EventWriter in a build without protobuf (KVBOUND_WITH_TENSORBOARD=OFF): run.tensorboard defaults to false
// there (cli/command_schemas.cpp), and asking for it anyway fails in one line naming the key.
#include "train/tensorboard/event_writer.h"

#include "base/errors.h"

namespace kvbound {

EventWriter::EventWriter(const std::string& dir) {
  fail(dir, "run.tensorboard", "this kvbound was built without protobuf (KVBOUND_WITH_TENSORBOARD=OFF): set "
       "run.tensorboard: false, or rebuild with libprotobuf-dev");
}

void EventWriter::scalar(const std::string&, std::int64_t, double) {}
void EventWriter::histogram(const std::string&, std::int64_t, const Histogram&) {}
void EventWriter::record(const std::string&) {}

}  // namespace kvbound
