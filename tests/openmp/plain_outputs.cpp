// Built WITHOUT OpenMP: writes every layer's outputs (tests/openmp/outputs.hpp) to the file named on
// the command line, for test_openmp to compare its -fopenmp build against.
#include "openmp/outputs.hpp"

#include <cstdio>

#if defined(_OPENMP)
#error "openmp_plain_outputs must be built without OpenMP"
#endif

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUTPUT_FILE\n", argv[0]);
    return 2;
  }
  const c2f_openmp::Outputs outputs = c2f_openmp::compute();
  c2f_openmp::write(outputs, argv[1]);
  std::printf("wrote %zu outputs of the plain build to %s\n", outputs.size(), argv[1]);
  return 0;
}
