// The control of ops_includes_modules.cpp: the same include root, a header of the layer itself.
#include "ops/rms_norm.h"
