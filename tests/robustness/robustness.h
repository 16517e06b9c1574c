#pragma once
// The bad-input table: each row calls the public API the way a careless (or unlucky) user would and
// states the exact outcome — a kiln::Error whose message holds every listed fragment (the op's name and
// the offending shapes, dtypes or devices), or a defined result checked inside the row (PyTorch's value
// where PyTorch defines one). Every row is its own test, so a regression names the row.
#include <gtest/gtest.h>

#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include <kiln/core/error.h>

namespace kiln::robustness {

struct Row {
  std::string name;                   // unique, [A-Za-z0-9_]: becomes the test's name
  std::function<void()> run;          // the call; for `ok` rows it also checks the value (EXPECT_*/ASSERT_*)
  std::vector<std::string> fragments; // error rows: substrings the kiln::Error message must contain
  bool expect_error = true;
};

// gtest prints a row by its name (not its bytes) when a test fails.
inline void PrintTo(const Row& row, std::ostream* os) { *os << row.name; }

// A row whose call must throw kiln::Error naming every fragment.
inline Row error(std::string name, std::function<void()> run, std::vector<std::string> fragments) {
  return {std::move(name), std::move(run), std::move(fragments), true};
}
// A row whose call must succeed; `run` asserts the defined value itself.
inline Row ok(std::string name, std::function<void()> run) { return {std::move(name), std::move(run), {}, false}; }

// One function per category; the files are named after them (table_<category>.cpp).
std::vector<Row> shape_rows();         // shapes, views, broadcasting, in place, overflow
std::vector<Row> dtype_device_rows();  // dtypes and devices
std::vector<Row> index_rows();         // indices, empty tensors, factories
std::vector<Row> numeric_rows();       // NaN / Inf inputs and their defined values
std::vector<Row> nn_rows();            // nn modules and functional ops
std::vector<Row> autograd_rows();      // autograd misuse
std::vector<Row> optim_rows();         // optimizer, scheduler, scaler misuse
std::vector<Row> checkpoint_rows();    // checkpoint misuse

}  // namespace kiln::robustness
