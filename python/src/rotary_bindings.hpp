// qkv._core's rotary tables (rotary_bindings.cpp), registered by PYBIND11_MODULE in bindings.cpp.
#pragma once

#include <pybind11/pybind11.h>

// Adds RotaryTableOptions and RotaryTableCore to the module.
void bind_rotary_tables(pybind11::module_& m);
