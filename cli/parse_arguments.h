// A subcommand's options parsed by cxxopts, refusing arguments no option took: cxxopts sets extra positional
// arguments aside without a word, so `kvbound train CONFIG --set a=1 b=2` silently trained without b=2 (every
// config override needs its own --set).
#pragma once
#include <cxxopts.hpp>

#include "base/errors.h"

namespace kvbound {

inline cxxopts::ParseResult parse_arguments(cxxopts::Options& options, int argc, char** argv) {
  cxxopts::ParseResult parsed = options.parse(argc, argv);
  if (!parsed.unmatched().empty())
    fail("arguments", "", "unexpected '" + parsed.unmatched().front() +
                              "' (each option takes one value; each config override is its own --set key=value)");
  return parsed;
}

}  // namespace kvbound
