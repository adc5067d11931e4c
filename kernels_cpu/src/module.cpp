// The extension is loaded for its op registrations (TORCH_LIBRARY in ops.cpp); this empty module only gives
// Python something to import.
#include <Python.h>

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "ipex_train._C", "ipex_train C++ kernels (see torch.ops.ipex_train)",
                            -1, nullptr};
  return PyModule_Create(&def);
}
