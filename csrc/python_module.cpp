// Python module init for torch_ext._C. The ops register through TORCH_LIBRARY when the shared
// library loads; this file exists only so that `import torch_ext._C` can load it (the pattern of
// pytorch/extension-cpp). The CMake (LibTorch) build leaves it out.
#include <Python.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT,
                                          "_C",
                                          "entropy_attn operators (see torch.ops.entropy_attn)",
                                          -1,
                                          nullptr,
                                          nullptr,
                                          nullptr,
                                          nullptr,
                                          nullptr};
  return PyModule_Create(&module_def);
}
}
