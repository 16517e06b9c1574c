// Runs every row of the bad-input table as its own parameterized test.
#include "robustness.h"

#include <set>

namespace kiln::robustness {
namespace {

std::vector<Row> all_rows() {
  std::vector<Row> rows;
  for (auto part : {shape_rows, dtype_device_rows, index_rows, numeric_rows, nn_rows, autograd_rows, optim_rows,
                    checkpoint_rows}) {
    std::vector<Row> r = part();
    rows.insert(rows.end(), r.begin(), r.end());
  }
  return rows;
}

class BadInput : public ::testing::TestWithParam<Row> {};

TEST_P(BadInput, Outcome) {
  const Row& row = GetParam();
  if (!row.expect_error) {
    try {
      row.run();
    } catch (const std::exception& e) {
      FAIL() << "expected success, threw: " << e.what();
    }
    return;
  }
  try {
    row.run();
  } catch (const kiln::Error& e) {
    std::string msg = e.what();
    for (const auto& f : row.fragments) EXPECT_NE(msg.find(f), std::string::npos) << "message \"" << msg << "\" lacks \"" << f << "\"";
    return;
  } catch (const std::exception& e) {
    FAIL() << "threw a non-kiln exception: " << e.what();
  }
  FAIL() << "did not throw";
}

INSTANTIATE_TEST_SUITE_P(Table, BadInput, ::testing::ValuesIn(all_rows()),
                         [](const ::testing::TestParamInfo<Row>& info) { return info.param.name; });

TEST(BadInputTable, HasAtLeast150UniqueRows) {
  std::vector<Row> rows = all_rows();
  std::set<std::string> names;
  for (const auto& r : rows) EXPECT_TRUE(names.insert(r.name).second) << "duplicate row " << r.name;
  EXPECT_GE(rows.size(), 150u);
}

}  // namespace
}  // namespace kiln::robustness
