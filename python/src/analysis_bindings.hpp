// qkv._core's qkv::analysis functions (analysis_bindings.cpp), registered by PYBIND11_MODULE in
// bindings.cpp.
#pragma once

#include <pybind11/pybind11.h>

// Adds row_entropy and head_entropy to the module.
void bind_analysis(pybind11::module_& m);
