#pragma once
// Rendezvous by environment variables, as torchrun (and scripts/kilnrun) set them:
//   RANK, WORLD_SIZE   this process's rank and the number of ranks
//   LOCAL_RANK         its rank on this machine (the GPU it drives); default RANK
//   MASTER_ADDR, MASTER_PORT   where rank 0 listens (a host name or address reachable from every machine)
// Rank 0 serves a few bytes (the NCCL unique id) over TCP to every other rank, which connects (retrying
// until rank 0 listens, within the timeout). Works on one machine or across several.
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kiln::distributed {

struct LaunchEnv {
  int rank = 0, world_size = 1, local_rank = 0;
  std::string master_addr;
  int master_port = 0;
};

// The launcher's variables, or nullopt when RANK is not set; kiln::Error when they are set but incomplete or
// inconsistent (naming the variable).
std::optional<LaunchEnv> launch_env();

// The number of ranks the launcher started: WORLD_SIZE (kilnrun, torchrun), OMPI_COMM_WORLD_SIZE (mpirun), else 1.
int launched_world_size();

// Rank 0's `payload` on every rank (rank 0 returns its own). kiln::Error, naming the address and the timeout,
// when the ranks do not meet in time.
std::vector<uint8_t> share_from_rank0(const LaunchEnv& env, const std::vector<uint8_t>& payload,
                                      std::chrono::milliseconds timeout);

}  // namespace kiln::distributed
