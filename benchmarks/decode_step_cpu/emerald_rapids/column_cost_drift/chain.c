#include <stdint.h>
// n dependent 64-bit multiplies (3 cycles each on Intel cores): the time of this call gives the core's clock
uint64_t chain(uint64_t n) {
  uint64_t x = 3, m = 1;
  for (uint64_t i = 0; i < n; i += 8) {
    __asm__ volatile("imul %1, %0\n\timul %1, %0\n\timul %1, %0\n\timul %1, %0\n\t"
                     "imul %1, %0\n\timul %1, %0\n\timul %1, %0\n\timul %1, %0" : "+r"(x) : "r"(m));
  }
  return x;
}
