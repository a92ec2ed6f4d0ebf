// The config schemas of `kvbound train` and `kvbound eval`: each command's own keys plus what the registries
// declare (every method's train or eval keys, every policy's keys). `kvbound sweep` routes a swept key to the
// command whose schema declares it.
#pragma once
#include "base/config.h"
#include "data/text_windows.h"

namespace kvbound {

ConfigSchema train_schema();
ConfigSchema eval_schema();

// A [from, to) FloatList key (eval.text_part, data.eval_text_part) as a TextPart; "config: KEY: ..." unless it
// has two entries (the bounds themselves are checked where the text is read).
TextPart text_part(const Config& config, const std::string& key);

}  // namespace kvbound
