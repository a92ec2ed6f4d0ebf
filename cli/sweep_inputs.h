// What one step of `kvbound sweep` (a train or an eval command) depends on, as text the sweep keeps beside the
// step's output: a re-run skips a finished step only when that text is unchanged, so a sweep re-run after a
// config, a weights file or a dataset changed redoes what they fed instead of reporting stale numbers.
#pragma once
#include <string>
#include <vector>

#include "base/config.h"

namespace kvbound {

// One line per config key ("eval.budgets: [64, 128]", the config resolved from `config_path` and the
// "KEY=VALUE" `sets`), then one line per file a key names ("file PATH fnv1a64:..."; a directory's files, not
// recursing; the entries of a "NAME=PATH" list too). model.threads and the *.out_dir keys are left out: the
// thread share follows --jobs and does not change what a step computes, and the output folder is the step's own.
std::string sweep_step_inputs(const ConfigSchema& schema, const std::string& config_path,
                              const std::vector<std::string>& sets);

// The first line of `current` that `recorded` lacks (what changed, for the message); "" when they are equal.
// An empty `recorded` (no record) answers "no record of its inputs".
std::string sweep_inputs_change(const std::string& recorded, const std::string& current);

}  // namespace kvbound
