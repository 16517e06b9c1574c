#pragma once
// Threads of the CPU kernels (OpenMP), as torch::set_num_threads / get_num_threads. Results never depend
// on the count: every CPU kernel splits its work into pieces fixed by the shapes and combines partial
// results in a fixed order, so a run resumed with another thread count continues bit for bit.
namespace kiln {

void set_num_threads(int n);  // n >= 1
int get_num_threads();

}  // namespace kiln
