#pragma once
// ExpandingArray<N>: N integers given either as one value for every dim or as a list of N, so layer
// options read naturally: Conv2d(3, 16, 3, {.stride = 2}) or MaxPool2d({2, 1}, {.padding = {1, 0}}).
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <ostream>

#include <kiln/core/error.h>

namespace kiln::nn {

template <size_t N>
struct ExpandingArray {
  ExpandingArray(int64_t value) { values.fill(value); }  // NOLINT(google-explicit-constructor)
  ExpandingArray(std::initializer_list<int64_t> list) {   // NOLINT(google-explicit-constructor)
    KILN_CHECK(list.size() == N || list.size() == 1, "expected ", N, " values (or a single one), got ", list.size());
    if (list.size() == 1) {
      values.fill(*list.begin());
    } else {
      size_t i = 0;
      for (int64_t v : list) values[i++] = v;
    }
  }
  ExpandingArray(const std::array<int64_t, N>& a) : values(a) {}  // NOLINT(google-explicit-constructor)

  operator std::array<int64_t, N>() const { return values; }  // NOLINT(google-explicit-constructor)
  int64_t operator[](size_t i) const { return values[i]; }
  bool operator==(const ExpandingArray&) const = default;

  std::array<int64_t, N> values;
};

template <size_t N>
std::ostream& operator<<(std::ostream& os, const ExpandingArray<N>& a) {
  os << "(";
  for (size_t i = 0; i < N; ++i) os << (i ? ", " : "") << a.values[i];
  return os << ")";
}

}  // namespace kiln::nn
