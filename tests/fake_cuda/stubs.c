/* Weak stubs for every driver symbol cudarc resolves; libcuda.c's strong definitions win. A
 * call to a stub is reported on stderr and fails with CUDA_ERROR_NOT_SUPPORTED (801), so a
 * driver call the fake does not model shows up instead of passing silently. */
#include <stdio.h>

#define SYM(name)                                                              \
  int __attribute__((weak)) name(void) {                                       \
    fprintf(stderr, "fake libcuda: %s is not modelled\n", #name);             \
    return 801;                                                                \
  }
#include "symbols.h"
