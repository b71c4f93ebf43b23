// The Python module `primus_turbo.pytorch._C`. It exports no Python functions: importing it runs
// the static TORCH_LIBRARY_FRAGMENT registrations of every csrc/pytorch/*_bindings.cpp, after
// which the ops are reachable as torch.ops.primus_turbo_cpp_extension.<name>.
#include <Python.h>

static struct PyModuleDef primus_turbo_c_module = {
    PyModuleDef_HEAD_INIT, "_C", "Primus-Turbo CUDA ops (registered under torch.ops.primus_turbo_cpp_extension)",
    -1, nullptr,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&primus_turbo_c_module); }
