// Saves that run at once: several threads (or ranks) writing one path each get their own temporary file,
// so every save succeeds and the path always holds one complete archive; temporaries left by processes
// that died mid-save are removed by the next save.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <thread>

#include <kiln/core/ops.h>

#include "test_util.h"

namespace kiln::archive::test {
namespace {

Archive numbered(int64_t n) {
  Archive a;
  a.add("w", full({64, 64}, double(n)));
  a.set("n", n);
  return a;
}

TEST(ConcurrentSave, ThreadsSavingOnePathAllSucceedAndReadersAlwaysFindAWholeFile) {
  TempDir dir;
  const std::string path = dir.file("shared.h5");
  save(path, numbered(-1));
  constexpr int kThreads = 4, kSaves = 20;
  std::atomic<int> failures{0}, bad_reads{0};
  std::atomic<bool> writing{true};
  std::thread reader([&] {
    while (writing) {
      try {
        Archive a = load(path);
        const int64_t n = a.get_int("n");
        // A whole file: the tensor holds the value its attribute names, everywhere.
        if (!all_true(eq(a.tensor("w"), full({64, 64}, double(n))))) ++bad_reads;
      } catch (const Error&) {
        ++bad_reads;
      }
    }
  });
  std::vector<std::thread> writers;
  for (int t = 0; t < kThreads; ++t)
    writers.emplace_back([&, t] {
      for (int i = 0; i < kSaves; ++i) {
        try {
          save(path, numbered(t * 1000 + i));
        } catch (const Error&) {
          ++failures;
        }
      }
    });
  for (auto& w : writers) w.join();
  writing = false;
  reader.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(bad_reads.load(), 0);
  EXPECT_TRUE(temp_files(dir.path()).empty());
}

TEST(ConcurrentSave, TemporariesOfDeadProcessesAreRemovedByTheNextSave) {
  TempDir dir;
  const std::string path = dir.file("ckpt.h5");
  // Children that "die mid-save": each leaves a temporary named as a save of its own would.
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof host - 1), 0);
  std::string h(host);
  std::replace(h.begin(), h.end(), '.', '_');
  std::vector<std::string> stale;
  for (int i = 0; i < 3; ++i) {
    pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) ::_exit(0);
    ASSERT_EQ(::waitpid(child, nullptr, 0), child);
    stale.push_back(path + ".tmp." + h + "." + std::to_string(child) + ".0");
    std::ofstream(stale.back()) << "partial";
  }
  // A live process's temporary (this one's parent shell stands in) and another host's stay.
  const std::string live = path + ".tmp." + h + "." + std::to_string(::getppid()) + ".0";
  const std::string other_host = path + ".tmp.otherhost.1.0";
  std::ofstream(live) << "in progress";
  std::ofstream(other_host) << "not ours";

  save(path, numbered(1));
  for (const auto& s : stale) EXPECT_FALSE(std::filesystem::exists(s)) << s;
  EXPECT_TRUE(std::filesystem::exists(live));
  EXPECT_TRUE(std::filesystem::exists(other_host));
  EXPECT_EQ(load(path).get_int("n"), 1);
}

}  // namespace
}  // namespace kiln::archive::test
