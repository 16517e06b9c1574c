#include <kiln/distributed/rendezvous.h>

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <kiln/core/error.h>

namespace kiln::distributed {

namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int env_int(const char* name, std::optional<int> fallback = std::nullopt) {
  const auto v = env(name);
  if (!v) {
    KILN_CHECK(fallback.has_value(), "init_process_group: RANK is set but ", name, " is not");
    return *fallback;
  }
  char* end = nullptr;
  const long x = std::strtol(v->c_str(), &end, 10);
  KILN_CHECK(end != nullptr && *end == '\0' && x >= 0 && x < (1L << 30), "init_process_group: ", name, "='", *v,
             "' is not a non-negative integer");
  return int(x);
}

// A socket closed when it goes out of scope.
struct Socket {
  int fd = -1;
  explicit Socket(int f = -1) : fd(f) {}
  ~Socket() {
    if (fd >= 0) ::close(fd);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
};

using Clock = std::chrono::steady_clock;

int ms_left(Clock::time_point deadline) {
  return int(std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count()));
}

// Sends or receives exactly n bytes before the deadline.
bool transfer(int fd, void* data, size_t n, bool send, Clock::time_point deadline) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    pollfd pfd{fd, short(send ? POLLOUT : POLLIN), 0};
    if (::poll(&pfd, 1, ms_left(deadline)) <= 0) return false;
    const ssize_t k = send ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (k <= 0) return false;
    p += k;
    n -= size_t(k);
  }
  return true;
}

}  // namespace

int launched_world_size() {
  for (const char* name : {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"})
    if (const auto v = env(name)) return std::max(1, std::atoi(v->c_str()));
  return 1;
}

std::optional<LaunchEnv> launch_env() {
  if (!env("RANK")) return std::nullopt;
  LaunchEnv e;
  e.rank = env_int("RANK");
  e.world_size = env_int("WORLD_SIZE");
  e.local_rank = env_int("LOCAL_RANK", e.rank);
  KILN_CHECK(e.world_size >= 1 && e.rank < e.world_size, "init_process_group: RANK=", e.rank, " is not below WORLD_SIZE=",
             e.world_size);
  e.master_addr = env("MASTER_ADDR").value_or("127.0.0.1");
  e.master_port = env_int("MASTER_PORT", e.world_size == 1 ? std::optional<int>(0) : std::nullopt);
  KILN_CHECK(e.world_size == 1 || (e.master_port > 0 && e.master_port < 65536), "init_process_group: MASTER_PORT=",
             e.master_port, " is not a port");
  return e;
}

std::vector<uint8_t> share_from_rank0(const LaunchEnv& e, const std::vector<uint8_t>& payload,
                                      std::chrono::milliseconds timeout) {
  if (e.world_size == 1) return payload;
  const auto deadline = Clock::now() + timeout;
  const std::string where = e.master_addr + ":" + std::to_string(e.master_port);
  if (e.rank == 0) {
    Socket server(::socket(AF_INET6, SOCK_STREAM, 0));
    KILN_CHECK(server.fd >= 0, "rendezvous: socket failed: ", std::strerror(errno));
    const int on = 1, off = 0;
    ::setsockopt(server.fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    ::setsockopt(server.fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof(off));  // IPv4 peers too
    sockaddr_in6 addr{};
    addr.sin6_family = AF_INET6;
    addr.sin6_addr = in6addr_any;
    addr.sin6_port = htons(uint16_t(e.master_port));
    KILN_CHECK(::bind(server.fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0, "rendezvous: rank 0 cannot "
               "listen on port ", e.master_port, ": ", std::strerror(errno), " (set MASTER_PORT to a free port)");
    KILN_CHECK(::listen(server.fd, e.world_size) == 0, "rendezvous: listen failed: ", std::strerror(errno));
    const uint64_t n = payload.size();
    for (int served = 1; served < e.world_size; ++served) {
      pollfd pfd{server.fd, POLLIN, 0};
      KILN_CHECK(::poll(&pfd, 1, ms_left(deadline)) > 0, "rendezvous: rank 0 waited ", timeout.count(), " ms at ",
                 where, " but only ", served - 1, " of ", e.world_size - 1, " ranks connected");
      Socket peer(::accept(server.fd, nullptr, nullptr));
      KILN_CHECK(peer.fd >= 0, "rendezvous: accept failed: ", std::strerror(errno));
      uint64_t size = n;
      KILN_CHECK(transfer(peer.fd, &size, sizeof(size), true, deadline) &&
                     transfer(peer.fd, const_cast<uint8_t*>(payload.data()), n, true, deadline),
                 "rendezvous: rank 0 could not send to a peer at ", where);
    }
    return payload;
  }
  // other ranks: connect (rank 0 may not listen yet: retry), then read the size and the bytes
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(e.master_addr.c_str(), std::to_string(e.master_port).c_str(), &hints, &found);
  KILN_CHECK(rc == 0 && found != nullptr, "rendezvous: cannot resolve MASTER_ADDR ", e.master_addr, ": ",
             ::gai_strerror(rc));
  std::vector<uint8_t> out;
  while (true) {
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
      Socket s(::socket(a->ai_family, a->ai_socktype, a->ai_protocol));
      if (s.fd < 0 || ::connect(s.fd, a->ai_addr, a->ai_addrlen) != 0) continue;
      uint64_t size = 0;
      if (!transfer(s.fd, &size, sizeof(size), false, deadline) || size > (1u << 20)) continue;
      out.resize(size_t(size));
      if (!transfer(s.fd, out.data(), out.size(), false, deadline)) continue;
      ::freeaddrinfo(found);
      return out;
    }
    if (Clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ::freeaddrinfo(found);
  KILN_FAIL("rendezvous: rank ", e.rank, " could not reach rank 0 at ", where, " within ", timeout.count(), " ms");
}

}  // namespace kiln::distributed
