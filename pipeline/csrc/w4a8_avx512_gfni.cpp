// w4a8_avx512.cpp's kernels built again with GFNI (w4a8::kAvx512Gfni): a CPU without GFNI never
// runs this object's code, and the plain AVX-512 build holds no GFNI instruction.
#define LOWBIT_W4A8_GFNI
#include "w4a8_avx512.cpp"
