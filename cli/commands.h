// The kvbound subcommands, one translation unit each (cli/cmd_NAME.cpp); cli/main.cpp dispatches.
// Each parses its own options, returns the exit code, and throws kvbound::Error for bad input.
#pragma once

namespace kvbound {

int cmd_info(int argc, char** argv);
int cmd_generate(int argc, char** argv);
int cmd_prepare(int argc, char** argv);
int cmd_train(int argc, char** argv);
int cmd_export(int argc, char** argv);
int cmd_eval(int argc, char** argv);
int cmd_sweep(int argc, char** argv);
int cmd_inspect(int argc, char** argv);

}  // namespace kvbound
