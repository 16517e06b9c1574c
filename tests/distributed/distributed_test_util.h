#pragma once
// The process group the distributed tests share (made once: every rank must make it).
#include <memory>

#include <kiln/distributed/process_group.h>

namespace kiln::testing {

inline const std::shared_ptr<distributed::ProcessGroup>& world() {
  static const std::shared_ptr<distributed::ProcessGroup> pg = distributed::init_process_group();
  return pg;
}

}  // namespace kiln::testing
