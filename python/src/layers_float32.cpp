// c2f python — every layer in float32 (one translation unit per dtype, so that a parallel build compiles
// the two at once).
#include "layers.hpp"

template void c2f_py::bind_layers<float>(pybind11::module_&);
