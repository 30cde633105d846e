/* The embedded switch's native data path (work in progress: the module is empty for now). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef datapath_module = {
    PyModuleDef_HEAD_INIT, "_datapath", "The embedded switch's native data path.", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__datapath(void) { return PyModule_Create(&datapath_module); }
