#include <kiln/distributed/checkpoint.h>

namespace kiln::distributed {

void save_checkpoint(ProcessGroup& group, const std::string& path, const nn::Module& model,
                     const optim::SavedComponents& components, const optim::Metadata& metadata, int64_t step) {
  if (group.rank() == 0) optim::save_checkpoint(path, model, components, metadata, step);
  group.barrier();
}

}  // namespace kiln::distributed
