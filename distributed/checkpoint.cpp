#include <kiln/distributed/checkpoint.h>

#include <vector>

#include <kiln/distributed/zero_adamw.h>

namespace kiln::distributed {

void save_checkpoint(ProcessGroup& group, const std::string& path, const nn::Module& model,
                     const optim::SavedComponents& components, const optim::Metadata& metadata, int64_t step) {
  // sharded optimizer state is gathered first, on every rank (a collective)
  std::vector<ZeroAdamW*> sharded;
  for (const auto& [name, c] : components)
    if (auto* z = dynamic_cast<ZeroAdamW*>(const_cast<Stateful*>(c))) sharded.push_back(z);
  for (ZeroAdamW* z : sharded) z->consolidate_state();
  if (group.rank() == 0) optim::save_checkpoint(path, model, components, metadata, step);
  group.barrier();
  for (ZeroAdamW* z : sharded) z->release_consolidated_state();
}

}  // namespace kiln::distributed
