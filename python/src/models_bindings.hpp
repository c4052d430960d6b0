// qkv._core's real models (models_bindings.cpp), registered by PYBIND11_MODULE in bindings.cpp.
#pragma once

#include <pybind11/pybind11.h>

// Adds ModelCore, write_safetensors and is_model_folder to the module.
void bind_models(pybind11::module_& m);
