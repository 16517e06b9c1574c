// One rank of tests/distributed/launcher/run.sh's job under scripts/kilnrun: the environment-variable
// rendezvous brings rank 0's bytes to every rank over TCP; each rank prints what it received.
// argv[1]: the timeout in ms (default 20000).
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <kiln/core/error.h>
#include <kiln/distributed/rendezvous.h>

int main(int argc, char** argv) {
  try {
    const auto env = kiln::distributed::launch_env();
    if (!env) {
      std::printf("no RANK in the environment\n");
      return 2;
    }
    const std::string mine = "payload of rank " + std::to_string(env->rank);
    const std::vector<uint8_t> got = kiln::distributed::share_from_rank0(
        *env, std::vector<uint8_t>(mine.begin(), mine.end()),
        std::chrono::milliseconds(argc > 1 ? std::stoll(argv[1]) : 20000));
    std::printf("rank %d of %d (local %d) received '%s'\n", env->rank, env->world_size, env->local_rank,
                std::string(got.begin(), got.end()).c_str());
    return 0;
  } catch (const kiln::Error& e) {
    std::printf("kiln::Error: %s\n", e.what());
    return 1;
  }
}
