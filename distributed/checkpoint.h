#pragma once
// Data-parallel checkpoints. Under DistributedDataParallel every rank holds the same model and optimizer
// state, so rank 0 alone writes the file (atomically, as optim::save_checkpoint: a temporary file renamed
// into place) while the other ranks wait at a barrier, and every rank loads the same file. The file is the
// one a single process writes: a run saved at one world size resumes at any other, 1 included
// (docs/checkpoint-format.md). The default generator's state saved is rank 0's. A ZeroAdamW component is
// consolidated first (on every rank), so the file holds the whole AdamW state, as a single process's would.
//
//   distributed::save_checkpoint(*pg, "run.h5", model, {{"optimizer", &opt}}, {}, step);
//   optim::load_checkpoint("run.h5", model, {{"optimizer", &opt}});   // on every rank
#include <string>

#include <kiln/distributed/process_group.h>
#include <kiln/optim/checkpoint.h>

namespace kiln::distributed {

// Rank 0 writes; every rank returns once the file is complete (a failed write raises on rank 0 and leaves
// the others at the barrier until its timeout).
void save_checkpoint(ProcessGroup& group, const std::string& path, const nn::Module& model,
                     const optim::SavedComponents& components, const optim::Metadata& metadata = {},
                     int64_t step = 0);

}  // namespace kiln::distributed
