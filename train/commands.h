// Subcommands of the kvbound CLI that live in their own translation units (train/main.cpp dispatches).
// Each parses its own options, returns the exit code, and throws kvbound::Error for bad input.
#pragma once
#include <string>

namespace kvbound {

// The default model as scripts/setup.sh places it (train/main.cpp).
std::string default_model_path();

int cmd_prepare(int argc, char** argv);  // train/cmd_prepare.cpp
int cmd_eval(int argc, char** argv);     // train/cmd_eval.cpp
int cmd_train(int argc, char** argv);    // train/cmd_train.cpp
int cmd_export(int argc, char** argv);   // train/cmd_export.cpp

}  // namespace kvbound
