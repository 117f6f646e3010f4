// The program the distrun tests launch to meet through a real rendezvous (comm::rendezvous over
// env://, so wherever distrun says the ranks meet: MASTER_ADDR/MASTER_PORT, or etcd under
// --rdzv-backend etcd). Usage: distrun_rendezvous_child meet K rejoin|anew
//
// Every run first prints "where MASTER_ADDR=.. MASTER_PORT=.. DISTOPTIM_RDZV_INIT_METHOD=..
// DISTRUN_RESTART_COUNT=.." ("<unset>" for a variable not set). Then:
//   - a rank restarted alone (DISTRUN_RESTART_COUNT > 0, `rejoin`) opens the store (open_store:
//     a new rendezvous would count its rank twice), reads every rank's "hello/R", announces
//     "rejoined/R" and waits for every other rank's "seen/R"; prints "rejoined rank=R" and exits
//     0;
//   - any other run meets the others (rendezvous), checks its rank and the world size against
//     RANK and WORLD_SIZE, sets "hello/R" and reads every rank's (a store round trip), and prints
//     "met rank=R world_size=W". Rank K, in its first run, then kills itself with SIGKILL. With K
//     < 0, or in a later attempt of `anew` (--restart-policy all), every rank exits 0; in the
//     first attempt of `anew`, the others sleep until distrun stops them; with `rejoin`, they wait
//     for "rejoined/K", set "seen/R", print "saw rank K rejoin" and exit 0.
// Exit status 1 with a line on stderr when a check or the store fails.

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>

#include <distoptim/comm/rendezvous.h>

namespace comm = distoptim::comm;

namespace {

constexpr auto kTimeout = std::chrono::seconds(25);

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "<unset>";
}

int env_int(const char* name) { return std::atoi(env(name).c_str()); }

void say(const std::string& line) {
  std::fputs((line + "\n").c_str(), stdout);
  std::fflush(stdout);
}

[[noreturn]] void fail(const std::string& why) {
  std::fprintf(stderr, "distrun_rendezvous_child: %s\n", why.c_str());
  std::exit(1);
}

std::vector<uint8_t> bytes(const std::string& text) { return {text.begin(), text.end()}; }

std::string text(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }

std::string key(const char* what, int rank) {
  return what + std::string("/") + std::to_string(rank);
}

// Reads every rank's hello, as each rank wrote it.
void read_hellos(comm::DeadlineStore& store, int world_size) {
  for (int r = 0; r < world_size; ++r) {
    const std::string got = text(store.get(key("hello", r)));
    if (got != "hello from " + std::to_string(r)) {
      fail("rank " + std::to_string(r) + "'s hello reads '" + got + "'");
    }
  }
}

int rejoin(int rank, int world_size) {
  const comm::Rendezvous r =
      comm::open_store(comm::RendezvousOptions("env://").rank(rank).timeout(kTimeout));
  read_hellos(*r.store, world_size);
  r.store->set(key("rejoined", rank), bytes("restart " + env("DISTRUN_RESTART_COUNT")));
  for (int other = 0; other < world_size; ++other) {
    if (other != rank) r.store->get(key("seen", other));
  }
  say("rejoined rank=" + std::to_string(rank));
  return 0;
}

int meet(int killed_rank, const std::string& how) {
  const int rank = env_int("RANK");
  const int world_size = env_int("WORLD_SIZE");
  const int restart_count = env_int("DISTRUN_RESTART_COUNT");
  if (restart_count > 0 && how == "rejoin") return rejoin(rank, world_size);

  const comm::Rendezvous r = comm::rendezvous(comm::RendezvousOptions("env://").timeout(kTimeout));
  if (r.rank != rank || r.world_size != world_size) {
    fail("met as rank " + std::to_string(r.rank) + " of " + std::to_string(r.world_size) +
         "; RANK=" + std::to_string(rank) + " WORLD_SIZE=" + std::to_string(world_size));
  }
  r.store->set(key("hello", rank), bytes("hello from " + std::to_string(rank)));
  read_hellos(*r.store, world_size);
  say("met rank=" + std::to_string(rank) + " world_size=" + std::to_string(world_size));
  if (rank == killed_rank && restart_count == 0) {
    say("killing myself");
    ::kill(::getpid(), SIGKILL);
  }
  if (killed_rank < 0 || restart_count > 0) return 0;
  if (how == "anew") {
    std::this_thread::sleep_for(std::chrono::seconds(60));
    fail("distrun never stopped this rank");
  }
  const std::string rejoined = text(r.store->get(key("rejoined", killed_rank)));
  r.store->set(key("seen", rank), bytes("1"));
  say("saw rank " + std::to_string(killed_rank) + " rejoin (" + rejoined + ")");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "meet" || argc != 4 ||
      (std::string(argv[3]) != "rejoin" && std::string(argv[3]) != "anew")) {
    fail("bad arguments; usage: distrun_rendezvous_child meet K rejoin|anew");
  }
  say("where MASTER_ADDR=" + env("MASTER_ADDR") + " MASTER_PORT=" + env("MASTER_PORT") +
      " DISTOPTIM_RDZV_INIT_METHOD=" + env("DISTOPTIM_RDZV_INIT_METHOD") +
      " DISTRUN_RESTART_COUNT=" + env("DISTRUN_RESTART_COUNT"));
  try {
    return meet(std::atoi(argv[2]), argv[3]);
  } catch (const c10::Error& e) {
    fail(e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail(e.what());
  }
}
