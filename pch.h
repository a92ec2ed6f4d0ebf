// Precompiled header for every C++ translation unit: the ATen/c10 headers all of them use.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>
#include <map>
#include <memory>
#include <string>
#include <vector>
