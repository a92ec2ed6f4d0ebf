// The config schemas of `kvbound train` and `kvbound eval`: each command's own keys plus what the registries
// declare (every method's train or eval keys, every policy's keys). `kvbound sweep` routes a swept key to the
// command whose schema declares it.
#pragma once
#include "base/config.h"

namespace kvbound {

ConfigSchema train_schema();
ConfigSchema eval_schema();

}  // namespace kvbound
